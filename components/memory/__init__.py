"""Experience memory: a Qdrant-backed bank of successful training rollouts, retrieved for the composer.

Modules: `records` (Experience, reports, errors), `storage` (manifest, lock, engine of a bank), `bank`
(`ExperienceBank`: open, size, versions, audit), `ingest` (validate, dedupe, store), `retrieval` (search,
`Retriever`), `snapshots` (snapshot, restore), `backends` (Qdrant Edge / qdrant-client engines, search
settings), `embedders`, `cli` (`lopd bank ...`). Import from the package: `from components.memory import
ExperienceBank`.

    from components.memory import ExperienceBank, Experience
    bank = ExperienceBank.open("runs/bank", "envscaler")         # ":memory:", a directory, or an http(s) URL
    bank.add([Experience(task_id, env_id, "train", task, trace, reward=1.0)])
    bank.retrieve(task, task_id, k=3)                            # never returns entries of task_id
    retrieve = bank.retriever(k=3)                               # what the train step consumes
    retrieve(task, task_id) -> list[str]                         # Experience.document texts, best first

Each entry is a task plus a compact action-result trace (observations omitted). Documents embed
"Task: ...\nTrace:\n..." (task + trace); queries embed the task behind an instruction prompt (app. A.3).
Search is inner product over L2-normalised vectors: exact below `SearchSettings.exact_below` entries;
above it HNSW where HNSW is measured to keep recall@3 >= `SearchSettings.min_recall` on the bank's own
vectors, exact search where it does not (`backends.probe_hnsw_recall`).

Guards (the summary's pitfalls): a query never retrieves its own task's entries (a filter inside the
engine, so k results still come back); only training-split successes may enter the bank (an evaluation
split raises `SplitLeakError`); `audit()` reports evaluation task ids found in a bank. Self-retrieval
exists only as `allow_self_retrieval=True`, to reproduce the reference code, and logs a warning.

Versions: every `add` that stores something new advances the bank version by one and stamps the new
entries with it, so the count at each version is known (`versions()`), e.g. to trigger re-training once
the bank has grown by N entries. `snapshot(dest_dir)` writes a restorable copy of the current version
and returns an `ArtifactRef(kind="bank_snapshot")`; `ExperienceBank.restore(ref, location, name)`
brings it back.
"""

from components.memory.backends import SearchSettings
from components.memory.bank import ExperienceBank, open_snapshot
from components.memory.embedders import HashingEmbedder, SentenceTransformerEmbedder
from components.memory.ingest import experiences_from_jsonl
from components.memory.records import (
    LOCK_FILE,
    TIE_MARGIN,
    AuditReport,
    BankDamagedError,
    BankMismatchError,
    BankVersion,
    Experience,
    IngestReport,
    SplitLeakError,
    compact_trace,
    experience_id,
)
from components.memory.retrieval import Retriever

__all__ = [
    "LOCK_FILE",
    "TIE_MARGIN",
    "AuditReport",
    "BankDamagedError",
    "BankMismatchError",
    "BankVersion",
    "Experience",
    "ExperienceBank",
    "HashingEmbedder",
    "IngestReport",
    "Retriever",
    "SearchSettings",
    "SentenceTransformerEmbedder",
    "SplitLeakError",
    "compact_trace",
    "experience_id",
    "experiences_from_jsonl",
    "open_snapshot",
]
