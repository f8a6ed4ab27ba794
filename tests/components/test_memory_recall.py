"""Retrieval recall of the experience bank on its real engines (Qdrant Edge, qdrant-client local mode):
`ExperienceBank.retrieve` against numpy brute force, on clustered and on uniformly random vectors.

The HNSW settings here are deliberately weak and Qdrant's full-scan switch is off (1 KB), so that a small
bank really searches its graph: on clustered vectors that graph still finds the true neighbours, on uniform
ones it finds about half of them, and the bank must notice that and search exactly (issue 12, item 8).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from components.memory import Experience, ExperienceBank, SearchSettings
from components.memory.backends import edge_available

DIM, N, PER_TASK, K, QUERIES = 128, 1500, 3, 3, 40
WEAK_HNSW = SearchSettings(
    exact_below=N // 3, hnsw_m=8, hnsw_ef_construct=32, hnsw_ef=16, full_scan_threshold_kb=1, recall_probes=64
)
ENGINES = [
    "memory",
    pytest.param("edge", marks=pytest.mark.skipif(not edge_available(), reason="qdrant-edge-py not installed")),
]


def make_vectors(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        x = rng.standard_normal((n, DIM))
    else:  # a low-dimensional Gaussian mixture in 128-d: the shape of sentence embeddings
        centres = rng.standard_normal((40, 8))
        z = centres[rng.integers(0, 40, n)] + 0.5 * rng.standard_normal((n, 8))
        x = z @ np.linalg.qr(rng.standard_normal((DIM, 8)))[0].T + 0.02 * rng.standard_normal((n, DIM))
    x = x.astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


class TableEmbedder:
    """Text naming "v<i>" -> row i of a fixed table of unit vectors (documents and queries alike)."""

    query_prompt = None

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self.name = f"table-{table.shape[1]}"

    @property
    def dim(self) -> int:
        return self.table.shape[1]

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        return self.table[[int(re.search(r"v(\d+)", t).group(1)) for t in texts]]

    embed_queries = embed_documents


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["clustered", "uniform"])
def test_retrieve_recall_against_bruteforce(tmp_path, engine, kind):
    rng = np.random.default_rng(0)
    x = make_vectors(kind, N, rng)
    src = rng.integers(0, N, QUERIES)
    q = x[src] + (0.3 / np.sqrt(DIM)) * rng.standard_normal((QUERIES, DIM)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    embedder = TableEmbedder(np.concatenate([x, q]))
    location = ":memory:" if engine == "memory" else str(tmp_path)
    bank = ExperienceBank.open(location, "recall", embedder, search=WEAK_HNSW, backend=engine)
    try:
        bank.add([Experience(f"t{i // PER_TASK}", "env", "train", f"v{i}", f"do({i})", 1.0) for i in range(N)])
        found = 0
        for j, i in enumerate(src):
            own = i // PER_TASK
            got = bank.retrieve(f"v{N + j}", f"t{own}", k=K)
            assert len(got) == K and all(e.task_id != f"t{own}" for e in got)
            scores = x @ q[j]
            scores[own * PER_TASK : (own + 1) * PER_TASK] = -np.inf
            kth = -np.partition(-scores, K - 1)[K - 1]
            found += sum(e.score >= kth - 1e-5 for e in got)  # ties count as found
        recall = found / (K * QUERIES)
        stats = bank.stats()
        assert recall >= 0.95, (kind, engine, recall, stats["search"], stats["hnsw_recall"])
        if engine == "edge":
            assert bank._backend.shard.info().indexed_vectors_count > 0  # the graph exists and was measured
            measured = stats["hnsw_recall"]
            assert measured is not None
            assert stats["search"] == ("hnsw" if measured >= WEAK_HNSW.min_recall else "exact")
            if kind == "uniform":  # the weak graph cannot keep recall here: the bank must search exactly
                assert measured < 0.8 and stats["search"] == "exact"
        else:
            assert stats["search"] == "exact" and stats["hnsw_recall"] is None  # local mode is always exact
    finally:
        bank.close()


def test_search_settings_rule_and_manifest_round_trip():
    s = SearchSettings()
    assert s.use_exact(s.exact_below - 1, 1.0)  # small banks: always exact
    assert s.use_exact(s.exact_below, None)  # not measured yet: exact
    assert s.use_exact(s.exact_below, s.min_recall - 0.01)
    assert not s.use_exact(s.exact_below, s.min_recall)
    assert SearchSettings.from_dict(s.to_dict()) == s
    old = {"exact_below": 20_000, "hnsw_m": 16, "hnsw_ef_construct": 100, "hnsw_ef": 128, "full_scan_threshold_kb": 1}
    assert SearchSettings.from_dict(old).min_recall == 0.95  # an older manifest takes today's defaults
    assert isinstance(SearchSettings.from_dict({"min_recall": "0.9"}).min_recall, float)
