"""Experience memory: a Qdrant-backed bank of successful training rollouts, retrieved for the composer.

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
vectors, exact search where it does not (`memory_backends.probe_hnsw_recall`).

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

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from components.memory_backends import (
    Backend,
    ClientBackend,
    EdgeBackend,
    SearchSettings,
    edge_available,
    probe_hnsw_recall,
)
from components.memory_embedders import Embedder, HashingEmbedder, SentenceTransformerEmbedder, make_embedder
from lopd_core.artifacts import ArtifactRef, sha256_path
from lopd_core.conversation import Message, Trajectory

if TYPE_CHECKING:
    from components.common import StageSpec

__all__ = [
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
    "experiences_from_jsonl",
]

logger = logging.getLogger(__name__)

TRAIN_SPLIT = "train"
DEFAULT_MIN_REWARD = 1.0
MANIFEST_FORMAT = 1
MANIFEST_FILE = "bank.json"
LOCK_FILE = "bank.lock"
METADATA_KEY = "lopd_bank"  # collection metadata key on a server
ENGINE_DIRS = {"edge": "edge", "local": "qdrant"}
LOCAL_COLLECTION = "bank"  # collection name inside a local-mode bank directory (the directory names the bank)
# Fixed namespace for point ids: uuid5(namespace, task_id + trace digest).
ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_DNS, "experience-bank.lopd")
QUERY_CACHE_SIZE = 8192
INSERT_BATCH = 512
TIE_MARGIN = 4  # extra hits fetched so that ties at the k-th place are broken by point id


class SplitLeakError(ValueError):
    """An evaluation-split experience was offered to a training bank."""


class BankDamagedError(RuntimeError):
    """A directory bank's files cannot be read (a crash, a partial copy, a disk error): restore a snapshot."""


class BankMismatchError(ValueError):
    """A bank was reopened with settings (embedder, dimension) that differ from the ones it was built with."""


def experience_id(task_id: str, trace: str) -> str:
    """Deterministic point id: uuid5 of the task id and the trace's sha256, so re-ingestion is idempotent."""
    digest = hashlib.sha256(trace.encode()).hexdigest()
    return str(uuid.uuid5(ID_NAMESPACE, f"{task_id}\n{digest}"))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Experience:
    """One successful rollout as the bank stores it. `score` is the similarity, set by `retrieve`."""

    task_id: str
    env_id: str
    split: str
    task: str
    trace: str
    reward: float
    source_run: str = ""
    created: str = ""  # ISO-8601 UTC; the bank fills it in when empty
    bank_version: int = 0  # set by the bank: the version at which this entry was added
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def document(self) -> str:
        """The text that is embedded and handed to the composer as a retrieved item."""
        return f"Task: {self.task}\nTrace:\n{self.trace}"

    @property
    def context(self) -> tuple[str, str]:
        """(task, trace): the pieces of "Task to solve: ... / Reference past trajectory: ..."."""
        return self.task, self.trace

    @property
    def point_id(self) -> str:
        return experience_id(self.task_id, self.trace)

    def problems(self) -> list[str]:
        """What makes this record unusable (empty list when valid)."""
        out = []
        for name in ("task_id", "env_id", "split", "task", "trace", "source_run", "created"):
            value = getattr(self, name)
            if not isinstance(value, str):
                out.append(f"{name} must be a str, got {type(value).__name__}")
        for name in ("task_id", "split", "task", "trace"):
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                out.append(f"{name} is empty")
        reward = self.reward
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            out.append(f"reward must be a number, got {type(reward).__name__}")
        elif not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
            out.append(f"reward must lie in [0, 1], got {reward}")
        if not isinstance(self.metadata, dict):
            out.append(f"metadata must be a dict, got {type(self.metadata).__name__}")
        else:
            try:
                json.dumps(self.metadata)
            except (TypeError, ValueError) as exc:
                out.append(f"metadata is not JSON-serialisable ({exc})")
        return out

    def to_payload(self) -> dict[str, Any]:
        payload = asdict(self)
        payload.pop("score")
        payload["reward"] = float(self.reward)
        return payload

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], score: float | None = None) -> Experience:
        known = {f.name for f in fields(cls)} - {"score"}
        return cls(**{k: v for k, v in payload.items() if k in known}, score=score)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Experience:
        """From a dict (e.g. a JSON line). Unknown keys go to `metadata`; raises TypeError if required ones miss."""
        known = {f.name for f in fields(cls)} - {"score", "bank_version"}
        extra = {k: v for k, v in data.items() if k not in known and k not in ("score", "bank_version")}
        kwargs = {k: v for k, v in data.items() if k in known}
        if extra:
            kwargs["metadata"] = {**dict(kwargs.get("metadata") or {}), **extra}
        return cls(**kwargs)

    @classmethod
    def from_trajectory(cls, traj: Trajectory, source_run: str = "") -> Experience:
        """A bank entry from a rollout: its `trace`, or a compact trace built from its messages when empty."""
        return cls(
            task_id=traj.task_id,
            env_id=traj.env_id,
            split=traj.split,
            task=traj.task,
            trace=traj.trace or compact_trace(traj.messages),
            reward=traj.reward,
            source_run=source_run or str(traj.metadata.get("run_id", "")),
            metadata={"n_turns": traj.n_turns, "n_calls": traj.n_calls, "finish_reason": traj.finish_reason},
        )


def compact_trace(messages: Sequence[Message], max_result_chars: int = 160) -> str:
    """Action-result trace: each assistant action in full, each tool result cut to `max_result_chars`."""
    lines = []
    for m in messages:
        if m.role == "assistant" and m.content.strip():
            lines.append(f"Action: {m.content.strip()}")
        elif m.role == "tool":
            text = " ".join(m.content.split())
            lines.append(f"Result: {text[:max_result_chars]}{'...' if len(text) > max_result_chars else ''}")
    return "\n".join(lines)


@dataclass
class IngestReport:
    received: int = 0
    added: int = 0
    duplicates: int = 0  # already in the bank, or repeated within the batch
    rejected: list[str] = field(default_factory=list)  # one message per bad record, naming it
    version: int = 0
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BankVersion:
    version: int
    added: int  # entries stamped with this version
    count: int  # bank size at this version


@dataclass
class AuditReport:
    count: int
    version: int
    non_train_split: list[dict[str, str]] = field(default_factory=list)  # {task_id, split}
    eval_task_ids_found: list[str] = field(default_factory=list)
    eval_task_texts_found: list[str] = field(default_factory=list)  # bank task ids whose text is an eval task
    below_min_reward: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.non_train_split or self.eval_task_ids_found or self.eval_task_texts_found)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _describe(index: int, record: Any) -> str:
    task_id = record.get("task_id") if isinstance(record, Mapping) else getattr(record, "task_id", None)
    return f"record {index} (task_id={task_id!r})"


def _normalise_text(text: str) -> str:
    return " ".join(text.lower().split())


class Retriever:
    """The callable the train step consumes: `(task, task_id) -> list[str]` of retrieved documents."""

    def __init__(self, bank: ExperienceBank, k: int = 3, allow_self_retrieval: bool = False) -> None:
        self.bank = bank
        self.k = k
        self.allow_self_retrieval = allow_self_retrieval
        if allow_self_retrieval:
            bank._warn_self_retrieval()

    def experiences(self, task: str, task_id: str) -> list[Experience]:
        return self.bank.retrieve(task, task_id, k=self.k, allow_self_retrieval=self.allow_self_retrieval)

    def __call__(self, task: str, task_id: str) -> list[str]:
        return [e.document for e in self.experiences(task, task_id)]


class ExperienceBank:
    """A training bank of successful experiences. Open it with `ExperienceBank.open`."""

    def __init__(
        self,
        backend: Backend,
        manifest: dict[str, Any],
        embedder: Embedder,
        location: str,
        name: str,
        bank_dir: Path | None = None,
        lock: IO[str] | None = None,
    ) -> None:
        self._backend = backend
        self.manifest = manifest
        self.embedder = embedder
        self.location = location
        self.name = name
        self.bank_dir = bank_dir
        self._lock = lock
        self.search = SearchSettings.from_dict(manifest["search"])
        self.min_reward = float(manifest["min_reward"])
        self._count = backend.count()
        # HNSW recall@3 measured on this bank (None: not measured at this size yet) and the count then.
        self._hnsw_recall: float | None = None
        self._probed_count = 0
        self._query_cache: dict[str, np.ndarray] = {}
        self._warned_self_retrieval = False

    # -- opening -------------------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        location: str | Path,
        name: str = "experience",
        embedder: Embedder | str | None = None,
        *,
        min_reward: float = DEFAULT_MIN_REWARD,
        search: SearchSettings | None = None,
        backend: str = "auto",
        api_key: str | None = None,
        create: bool = True,
    ) -> ExperienceBank:
        """Open or create a bank (`create=False`: a missing bank raises FileNotFoundError).

        location: ":memory:" (qdrant-client local mode, nothing persisted), a directory (embedded; the bank
        lives in `<location>/<name>/`), or an http(s) URL of a Qdrant server (collection `name`).
        embedder: an `Embedder`, a model name/path, or None (the bank's recorded embedder; MiniLM when new).
        backend: for a directory, "edge" (Qdrant Edge), "local" (qdrant-client local mode) or "auto"
        (edge when `qdrant-edge-py` is installed). An existing bank keeps the backend it was built with.
        min_reward / search: used when the bank is created; an existing bank keeps its own.
        """
        location = str(location)
        if isinstance(embedder, str):
            embedder = make_embedder(embedder)
        if location == ":memory:" or location.startswith(("http://", "https://")):
            return cls._open_client(location, name, embedder, min_reward, search, api_key, create)
        if not create and not (Path(location) / name / MANIFEST_FILE).exists():
            raise FileNotFoundError(f"no bank {name!r} in {location}")
        return cls._open_dir(Path(location), name, embedder, min_reward, search, backend)

    @staticmethod
    def _new_manifest(
        name: str, kind: str, embedder: Embedder, min_reward: float, search: SearchSettings | None
    ) -> dict[str, Any]:
        if not 0.0 <= min_reward <= 1.0:
            raise ValueError(f"min_reward must lie in [0, 1], got {min_reward}")
        return {
            "format": MANIFEST_FORMAT,
            "name": name,
            "backend": kind,
            "embedder": embedder.name,
            "dim": embedder.dim,
            "query_prompt": embedder.query_prompt,
            "min_reward": min_reward,
            "split": TRAIN_SPLIT,
            "search": (search or SearchSettings()).to_dict(),
            "created": _now(),
        }

    @staticmethod
    def _check_embedder(manifest: dict[str, Any], embedder: Embedder | None) -> Embedder:
        if embedder is None:
            return make_embedder(manifest["embedder"], manifest.get("query_prompt"))
        if embedder.name != manifest["embedder"]:
            raise BankMismatchError(
                f"bank {manifest['name']!r} was built with embedder {manifest['embedder']!r}; "
                f"reopening it with {embedder.name!r} would mix embedding spaces"
            )
        return embedder

    @classmethod
    def _open_client(
        cls,
        location: str,
        name: str,
        embedder: Embedder | None,
        min_reward: float,
        search: SearchSettings | None,
        api_key: str | None,
        create: bool = True,
    ) -> ExperienceBank:
        if location == ":memory:":
            embedder = embedder or SentenceTransformerEmbedder()
            manifest = cls._new_manifest(name, "memory", embedder, min_reward, search)
            backend = ClientBackend.connect(location, name, manifest["dim"], cls._settings(manifest))
            return cls(backend, manifest, embedder, location, name)
        # Server: the manifest lives in the collection's metadata.
        from qdrant_client import QdrantClient

        probe = QdrantClient(url=location, api_key=api_key, timeout=60)
        try:
            existing = (
                dict(probe.get_collection(name).config.metadata or {}).get(METADATA_KEY)
                if probe.collection_exists(name)
                else None
            )
        finally:
            probe.close()
        if not existing and not create:
            raise FileNotFoundError(f"no bank {name!r} on {location}")
        if existing:
            manifest = dict(existing)
            embedder = cls._check_embedder(manifest, embedder)
        else:
            embedder = embedder or SentenceTransformerEmbedder()
            manifest = cls._new_manifest(name, "server", embedder, min_reward, search)
        backend = ClientBackend.connect(location, name, manifest["dim"], cls._settings(manifest), api_key=api_key)
        if not existing:
            backend.set_metadata({METADATA_KEY: manifest})
        return cls(backend, manifest, embedder, location, name)

    @staticmethod
    def _settings(manifest: dict[str, Any]) -> SearchSettings:
        return SearchSettings.from_dict(manifest["search"])

    @staticmethod
    def _lock_dir(bank_dir: Path) -> IO[str]:
        bank_dir.mkdir(parents=True, exist_ok=True)
        fh = open(bank_dir / LOCK_FILE, "a")  # noqa: SIM115 - held for the bank's lifetime
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            raise RuntimeError(
                f"bank directory {bank_dir} is in use by another process; embedded banks have one writer "
                "(use a Qdrant server URL for several processes)"
            ) from None
        return fh

    @classmethod
    def _open_dir(
        cls,
        root: Path,
        name: str,
        embedder: Embedder | None,
        min_reward: float,
        search: SearchSettings | None,
        backend: str,
    ) -> ExperienceBank:
        if backend not in ("auto", "edge", "local"):
            raise ValueError(f"backend must be 'auto', 'edge' or 'local', got {backend!r}")
        bank_dir = root / name
        lock = cls._lock_dir(bank_dir)
        try:
            manifest_path = bank_dir / MANIFEST_FILE
            if manifest_path.exists():
                manifest = cls._read_manifest(root, name)
                embedder = cls._check_embedder(manifest, embedder)
                kind = manifest["backend"]
                engine_dir = bank_dir / ENGINE_DIRS.get(kind, kind)
                if kind in ENGINE_DIRS and not engine_dir.is_dir():
                    raise BankDamagedError(_damaged(root, name, f"{engine_dir} is missing"))
                if kind == "edge" and not edge_available():
                    raise RuntimeError(f"bank {bank_dir} uses Qdrant Edge: install qdrant-edge-py")
                try:
                    engine = cls._dir_backend(bank_dir, manifest, create=False)
                    return cls(engine, manifest, embedder, str(root), name, bank_dir=bank_dir, lock=lock)
                except Exception as exc:
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                    raise BankDamagedError(_damaged(root, name, f"{engine_dir} cannot be read ({first})")) from exc
            else:
                kind = backend if backend != "auto" else ("edge" if edge_available() else "local")
                embedder = embedder or SentenceTransformerEmbedder()
                manifest = cls._new_manifest(name, kind, embedder, min_reward, search)
                engine = cls._dir_backend(bank_dir, manifest, create=True)
                _write_json(manifest_path, manifest)
            return cls(engine, manifest, embedder, str(root), name, bank_dir=bank_dir, lock=lock)
        except BaseException:
            lock.close()
            raise

    @staticmethod
    def _read_manifest(root: Path, name: str) -> dict[str, Any]:
        path = root / name / MANIFEST_FILE
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise BankDamagedError(
                _damaged(root, name, f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})")
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise BankDamagedError(_damaged(root, name, f"{path} cannot be read ({exc})")) from None
        if not isinstance(manifest, dict):
            raise BankDamagedError(_damaged(root, name, f"{path} is not a JSON object"))
        missing = [k for k in ("name", "backend", "embedder", "dim", "min_reward", "search") if k not in manifest]
        if missing:
            raise BankDamagedError(_damaged(root, name, f"{path} lacks the field(s) {', '.join(missing)}"))
        return manifest

    @classmethod
    def _dir_backend(cls, bank_dir: Path, manifest: dict[str, Any], create: bool) -> Backend:
        kind = manifest["backend"]
        settings = cls._settings(manifest)
        if kind == "edge":
            if not edge_available():
                raise RuntimeError(f"bank {bank_dir} uses Qdrant Edge: install qdrant-edge-py")
            return EdgeBackend(bank_dir / ENGINE_DIRS["edge"], manifest["dim"], settings, create=create)
        if kind == "local":
            path = str(bank_dir / ENGINE_DIRS["local"])
            return ClientBackend.connect(path, LOCAL_COLLECTION, manifest["dim"], settings)
        raise ValueError(f"unknown embedded backend {kind!r} in {bank_dir / MANIFEST_FILE}")

    def close(self) -> None:
        self._backend.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> ExperienceBank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backend_kind(self) -> str:
        return self._backend.kind

    # -- ingestion -----------------------------------------------------------------------------------

    def add(self, experiences: Iterable[Experience | Mapping[str, Any]]) -> int:
        """Store new successes; returns how many were newly stored. See `ingest` for the full report."""
        return self.ingest(experiences).added

    def ingest(self, records: Iterable[Experience | Mapping[str, Any]]) -> IngestReport:
        """Validate, dedupe and store records. Bad records are rejected with a message naming them and the
        rest is stored. Any record with a split other than "train", or the task id of a held-out task of a
        built-in evaluation suite (`components.common.EVALUATION_SUITES`) whatever its split, raises
        `SplitLeakError` before anything is stored."""
        from components.common import held_out_task_ids

        held_out = held_out_task_ids()
        report = IngestReport()
        valid: list[Experience] = []
        leaks: list[str] = []
        for index, record in enumerate(records):
            report.received += 1
            what = _describe(index, record)
            try:
                exp = Experience.from_mapping(record) if isinstance(record, Mapping) else record
            except TypeError as exc:
                report.rejected.append(f"{what}: {exc}")
                continue
            if not isinstance(exp, Experience):
                report.rejected.append(f"{what}: expected an Experience or a dict, got {type(record).__name__}")
                continue
            if isinstance(exp.split, str) and exp.split != TRAIN_SPLIT:
                leaks.append(f"{exp.task_id!r} (split={exp.split!r})")
                continue
            if isinstance(exp.task_id, str) and exp.task_id in held_out:
                leaks.append(
                    f"{exp.task_id!r} (split={exp.split!r}, but a held-out task of suite {held_out[exp.task_id]!r})"
                )
                continue
            problems = exp.problems()
            if not problems and exp.reward < self.min_reward:
                problems = [f"reward {exp.reward} is below the bank's success threshold {self.min_reward}"]
            if problems:
                report.rejected.append(f"{what}: {'; '.join(problems)}")
                continue
            valid.append(exp)

        if leaks:
            raise SplitLeakError(
                f"only {TRAIN_SPLIT!r}-split successes may enter training bank {self.name!r}; "
                f"refusing the whole batch because of {len(leaks)} record(s): {', '.join(leaks[:10])}"
                + (" ..." if len(leaks) > 10 else "")
                + "; remove them from the input: evaluation tasks never enter a training bank"
            )
        for message in report.rejected:
            logger.warning("bank %s: rejected %s", self.name, message)

        unique: dict[str, Experience] = {}
        for exp in valid:
            unique.setdefault(exp.point_id, exp)
        existing = self._backend.existing_ids(list(unique))
        new = [e for pid, e in unique.items() if pid not in existing]
        report.duplicates = len(valid) - len(new)
        if new:
            version = self.version + 1
            created = _now()
            payloads = []
            for e in new:
                payload = e.to_payload()
                payload["bank_version"] = version
                payload["created"] = e.created or created
                payloads.append(payload)
            for lo in range(0, len(new), INSERT_BATCH):  # bounded requests (a server caps their size)
                chunk = new[lo : lo + INSERT_BATCH]
                vectors = self.embedder.embed_documents([e.document for e in chunk])
                self._backend.insert([e.point_id for e in chunk], vectors, payloads[lo : lo + INSERT_BATCH])
            self._backend.optimize()
            report.added = len(new)
        self._count = self._backend.count()
        report.version = self.version
        report.count = self._count
        logger.info(
            "bank %s: %d received, %d added, %d duplicates, %d rejected; version %d, %d entries",
            self.name,
            report.received,
            report.added,
            report.duplicates,
            len(report.rejected),
            report.version,
            report.count,
        )
        return report

    # -- retrieval -----------------------------------------------------------------------------------

    def _warn_self_retrieval(self) -> None:
        if not self._warned_self_retrieval:
            logger.warning(
                "bank %s: allow_self_retrieval=True lets a task retrieve its own successes (the reference "
                "code's setting); this leaks the answer to the teacher. Use it only to reproduce that code.",
                self.name,
            )
            self._warned_self_retrieval = True

    def _query_vector(self, task: str) -> np.ndarray:
        vector = self._query_cache.get(task)
        if vector is None:
            vector = self.embedder.embed_queries([task])[0]
            if len(self._query_cache) >= QUERY_CACHE_SIZE:
                self._query_cache.pop(next(iter(self._query_cache)))
            self._query_cache[task] = vector
        return vector

    def retrieve(self, task: str, task_id: str, k: int = 3, *, allow_self_retrieval: bool = False) -> list[Experience]:
        """Top-k entries by inner product, best first, never from `task_id` (unless self-retrieval is allowed)."""
        if not isinstance(task_id, str) or not task_id:
            raise ValueError("retrieve needs the query's task_id (a non-empty str) to exclude its own entries")
        if allow_self_retrieval:
            self._warn_self_retrieval()
        if k <= 0:
            return []
        hits = self._backend.search(
            self._query_vector(task),
            k + TIE_MARGIN,
            exclude_task_id=None if allow_self_retrieval else task_id,
            exact=self._exact(),
        )
        # Equal scores come back in storage order, which differs between engines and after a restore:
        # order ties by point id so the same bank content always gives the same top k.
        hits.sort(key=lambda h: (-round(h.score, 6), h.point_id))
        return [Experience.from_payload(h.payload, score=h.score) for h in hits[:k]]

    def _exact(self) -> bool:
        """Exact search, or HNSW where it was measured to keep recall (see `SearchSettings`)."""
        settings = self.search
        if self._count < settings.exact_below or not self._backend.approximate:
            return True
        if self._hnsw_recall is None or self._count >= settings.reprobe_growth * self._probed_count:
            self._hnsw_recall = probe_hnsw_recall(self._backend, settings)
            self._probed_count = self._count
            logger.info(
                "bank %s: HNSW recall@3 %.3f on %d of its %d entries (minimum %.2f): %s search",
                self.name,
                self._hnsw_recall,
                min(settings.recall_probes, self._count),
                self._count,
                settings.min_recall,
                "exact" if self._hnsw_recall < settings.min_recall else "HNSW",
            )
        return settings.use_exact(self._count, self._hnsw_recall)

    def retriever(self, k: int = 3, *, allow_self_retrieval: bool = False) -> Retriever:
        return Retriever(self, k=k, allow_self_retrieval=allow_self_retrieval)

    # -- size and versions ---------------------------------------------------------------------------

    def count(self) -> int:
        self._count = self._backend.count()
        return self._count

    def versions(self) -> list[BankVersion]:
        """Each version with the entries it added and the bank size at that version, oldest first."""
        out, total = [], 0
        for version, added in sorted(self._backend.version_counts().items()):
            total += added
            out.append(BankVersion(version=version, added=added, count=total))
        return out

    @property
    def version(self) -> int:
        """Current bank version: 0 when empty, +1 for every `add` that stored something new."""
        counts = self._backend.version_counts()
        return max(counts) if counts else 0

    def count_at(self, version: int) -> int:
        return sum(n for v, n in self._backend.version_counts().items() if v <= version)

    def grown_since(self, version: int) -> int:
        """Entries added after `version` (e.g. re-train when this reaches N)."""
        return sum(n for v, n in self._backend.version_counts().items() if v > version)

    def experiences(self) -> Iterator[Experience]:
        for _pid, payload, _vec in self._backend.scroll():
            yield Experience.from_payload(payload)

    def stats(self) -> dict[str, Any]:
        count = self.count()
        return {
            "name": self.name,
            "location": self.location,
            "backend": self.backend_kind,
            "count": count,
            "version": self.version,
            "versions": [asdict(v) for v in self.versions()],
            "embedder": self.manifest["embedder"],
            "dim": self.manifest["dim"],
            "min_reward": self.min_reward,
            "search": "exact" if self._exact() else "hnsw",
            "hnsw_recall": self._hnsw_recall,  # measured recall@3 of HNSW on this bank (None: not measured)
            "search_settings": self.search.to_dict(),
        }

    # -- audit ---------------------------------------------------------------------------------------

    def audit(self, eval_task_ids: Iterable[str] = (), eval_tasks: Iterable[str] = ()) -> AuditReport:
        """Scan every entry: non-training splits, evaluation task ids or texts, entries below the threshold."""
        eval_ids = set(eval_task_ids)
        eval_texts = {_normalise_text(t) for t in eval_tasks}
        report = AuditReport(count=self.count(), version=self.version)
        ids_found, texts_found, below = set(), set(), set()
        for _pid, payload, _vec in self._backend.scroll():
            task_id = str(payload.get("task_id"))
            split = str(payload.get("split"))
            if split != TRAIN_SPLIT:
                report.non_train_split.append({"task_id": task_id, "split": split})
            if task_id in eval_ids:
                ids_found.add(task_id)
            if eval_texts and _normalise_text(str(payload.get("task", ""))) in eval_texts:
                texts_found.add(task_id)
            if float(payload.get("reward", 0.0)) < self.min_reward:
                below.add(task_id)
        report.eval_task_ids_found = sorted(ids_found)
        report.eval_task_texts_found = sorted(texts_found)
        report.below_min_reward = sorted(below)
        if not report.ok:
            logger.error("bank %s audit found evaluation data: %s", self.name, report.to_dict())
        return report

    # -- snapshots -----------------------------------------------------------------------------------

    def snapshot(self, dest_dir: str | Path) -> ArtifactRef:
        """Write a restorable copy of the current version under `dest_dir`; returns its artifact reference.

        Embedded: a consistent copy of the bank directory (the engine is closed during the copy) in
        `<dest_dir>/<name>-v<version>-<digest>/`; a ":memory:" bank is written out as a directory bank.
        Server: the collection snapshot API; the snapshot file is downloaded into `dest_dir`.
        """
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        count, versions = self.count(), self.versions()
        version = versions[-1].version if versions else 0
        meta: dict[str, Any] = {
            "name": self.name,
            "backend": self.backend_kind,
            "version": version,
            "count": count,
            "versions": [asdict(v) for v in versions],
            "embedder": self.manifest["embedder"],
            "dim": self.manifest["dim"],
            "created": _now(),
        }
        if isinstance(self._backend, ClientBackend) and self._backend.kind == "server":
            path = self._backend.download_snapshot(dest_dir)
            meta.update(format="qdrant-collection-snapshot", manifest=self.manifest)
            uri = path.resolve().as_uri()
            return ArtifactRef(uri=uri, kind="bank_snapshot", sha256=sha256_path(path), metadata=meta)

        tmp = Path(tempfile.mkdtemp(prefix=f".{self.name}-v{version}-", dir=dest_dir))
        try:
            if self.bank_dir is not None:
                self._backend.close()  # flush and release the engine so the copy is consistent
                try:
                    shutil.copytree(self.bank_dir, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(LOCK_FILE))
                finally:
                    self._backend = self._dir_backend(self.bank_dir, self.manifest, create=False)
                kind = self.manifest["backend"]
            else:  # ":memory:" -> a directory bank with the default embedded engine
                kind = "edge" if edge_available() else "local"
                manifest = {**self.manifest, "backend": kind}
                target = self._dir_backend(tmp, manifest, create=True)
                try:
                    _copy_points(self._backend, target)
                finally:
                    target.close()
                _write_json(tmp / MANIFEST_FILE, manifest)
            digest = sha256_path(tmp)
            final = dest_dir / f"{self.name}-v{version}-{digest[:12]}"
            if final.exists():
                shutil.rmtree(tmp)  # same content already there (a retried snapshot)
            else:
                tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        meta.update(format=f"{kind}-dir", engine=kind)
        return ArtifactRef(uri=final.resolve().as_uri(), kind="bank_snapshot", sha256=digest, metadata=meta)

    @classmethod
    def restore(
        cls,
        ref: ArtifactRef,
        location: str | Path,
        name: str,
        embedder: Embedder | str | None = None,
        *,
        overwrite: bool = False,
        api_key: str | None = None,
    ) -> ExperienceBank:
        """Bring back a snapshot as bank `name` at `location` (":memory:", a directory, or a server URL).

        The snapshot's digest is checked against `ref.sha256` first. A directory snapshot restored into a
        directory is copied as is; into ":memory:" or a server its entries (vectors, payloads, versions)
        are copied. A server snapshot is uploaded to a server.
        """
        if ref.kind != "bank_snapshot":
            raise ValueError(f"not a bank snapshot: kind={ref.kind!r}")
        source = _path_from_uri(ref.uri)
        actual = sha256_path(source)
        if actual != ref.sha256:
            raise ValueError(f"bank snapshot {source} is corrupt or changed: sha256 {actual} != {ref.sha256}")
        location = str(location)
        is_server = location.startswith(("http://", "https://"))
        if ref.metadata.get("format") == "qdrant-collection-snapshot":
            if not is_server:
                raise ValueError("a Qdrant server snapshot can only be restored to a server URL")
            manifest = {**ref.metadata["manifest"], "name": name}
            if isinstance(embedder, str):
                embedder = make_embedder(embedder)
            embedder = cls._check_embedder(manifest, embedder)
            backend = ClientBackend.connect(location, name, manifest["dim"], cls._settings(manifest), api_key=api_key)
            backend.upload_snapshot(source)
            backend.set_metadata({METADATA_KEY: manifest})
            backend.close()
            return cls.open(location, name, embedder, api_key=api_key)

        manifest = json.loads((source / MANIFEST_FILE).read_text())
        if isinstance(embedder, str):
            embedder = make_embedder(embedder)
        embedder = cls._check_embedder(manifest, embedder)
        if location != ":memory:" and not is_server:
            target = Path(location) / name
            if target.exists() and any(target.iterdir()):
                if not overwrite:
                    raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
                shutil.rmtree(target)
            shutil.copytree(source, target, dirs_exist_ok=True)
            _write_json(target / MANIFEST_FILE, {**manifest, "name": name})
            return cls.open(location, name, embedder)

        # Into ":memory:" or a server: open a scratch copy (opening an engine writes to its directory).
        with tempfile.TemporaryDirectory(prefix="bank-restore-") as scratch:
            copy = Path(scratch) / "bank"
            shutil.copytree(source, copy)
            src_backend = cls._dir_backend(copy, manifest, create=False)
            try:
                bank = cls.open(
                    location,
                    name,
                    embedder,
                    min_reward=float(manifest["min_reward"]),
                    search=cls._settings(manifest),
                    api_key=api_key,
                )
                _copy_points(src_backend, bank._backend)
                bank._count = bank._backend.count()
            finally:
                src_backend.close()
        return bank


def _copy_points(source: Backend, target: Backend, batch: int = 512) -> None:
    ids: list[str] = []
    vectors: list[np.ndarray] = []
    payloads: list[dict[str, Any]] = []
    for pid, payload, vector in source.scroll(with_vectors=True):
        ids.append(pid)
        vectors.append(vector)
        payloads.append(payload)
        if len(ids) >= batch:
            target.insert(ids, np.stack(vectors), payloads)
            ids, vectors, payloads = [], [], []
    if ids:
        target.insert(ids, np.stack(vectors), payloads)
    target.optimize()


def _damaged(root: Path, name: str, problem: str) -> str:
    return (
        f"bank {name!r} in {root} is damaged: {problem}. Restore it from a snapshot: lopd bank restore SNAPSHOT.json "
        f"--location {root} --name {name} --overwrite"
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    tmp.replace(path)


def _path_from_uri(uri: str) -> Path:
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return Path(uri)


def experiences_from_jsonl(
    lines: Iterable[str], min_reward: float = DEFAULT_MIN_REWARD, source_run: str = "", origin: str = "input"
) -> tuple[list[Experience], list[str], int]:
    """Parse `lopd_core.conversation.Trajectory` JSON lines and keep the successes.

    Returns (records, errors, skipped): Experience records for `ExperienceBank.ingest` (which still
    validates them), one error per line that is not a valid Trajectory (naming the line and task id),
    and how many trajectories were skipped as failures (reward below `min_reward`, or an errored rollout).
    """
    records: list[Experience] = []
    errors: list[str] = []
    skipped = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            errors.append(f"{origin}:{number}: not JSON ({exc.msg})")
            continue
        if not isinstance(data, dict):
            errors.append(f"{origin}:{number}: expected a JSON object, got {type(data).__name__}")
            continue
        try:
            traj = Trajectory.from_dict(data)
        except (TypeError, ValueError) as exc:
            errors.append(f"{origin}:{number} (task_id={data.get('task_id')!r}): {exc}")
            continue
        if traj.failed or traj.reward < min_reward:
            skipped += 1
            continue
        exp = Experience.from_trajectory(traj, source_run=source_run)
        exp.metadata["origin"] = f"{origin}:{number}"
        records.append(exp)
    return records, errors, skipped


def open_snapshot(spec: StageSpec, ref: ArtifactRef, name: str) -> ExperienceBank:
    """Restore a bank snapshot into a stage's own directory (read by that stage only; cold-start and train)."""
    local = dataclasses.replace(ref, uri=str(spec.store().get(ref)))  # downloaded first on a remote store
    target = spec.stage_dir(name) / "bank"
    return ExperienceBank.restore(local, str(target), ref.metadata.get("name", "experience"), overwrite=True)
