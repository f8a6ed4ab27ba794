"""`ExperienceBank`: opening and closing a bank, its size, versions, stats and audit; `open_snapshot` restores
a snapshot into a stage's directory. Its ingest, retrieve and snapshot/restore methods are mixed in from the
modules `ingest`, `retrieval` and `snapshots`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from components.memory.backends import Backend, SearchSettings
from components.memory.embedders import Embedder, make_embedder
from components.memory.ingest import IngestMixin
from components.memory.records import (
    DEFAULT_MIN_REWARD,
    MANIFEST_FILE,
    TRAIN_SPLIT,
    AuditReport,
    BankVersion,
    Experience,
    _normalise_text,
)
from components.memory.retrieval import RetrievalMixin
from components.memory.snapshots import SnapshotMixin
from components.memory.storage import open_client, open_dir
from lopd_core.artifacts import ArtifactRef

if TYPE_CHECKING:
    from components.common import StageSpec


logger = logging.getLogger(__name__)


class ExperienceBank(IngestMixin, RetrievalMixin, SnapshotMixin):
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
            engine, manifest, embedder = open_client(location, name, embedder, min_reward, search, api_key, create)
            return cls(engine, manifest, embedder, location, name)
        if not create and not (Path(location) / name / MANIFEST_FILE).exists():
            raise FileNotFoundError(f"no bank {name!r} in {location}")
        opened = open_dir(Path(location), name, embedder, min_reward, search, backend)
        engine, manifest, embedder, bank_dir, lock = opened
        return cls(engine, manifest, embedder, str(Path(location)), name, bank_dir=bank_dir, lock=lock)

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
            # what the teacher retrieves from: per environment, its entries per era and the era retrieval reads
            # (its latest; the earlier eras' entries are superseded there, docs/memory.md "Eras")
            "environments": {
                env: {
                    "entries_per_era": {str(e): n for e, n in eras.items()},
                    "retrieved_era": max(eras),
                    "retrievable": eras[max(eras)],
                }
                for env, eras in sorted(self.era_counts().items())
            },
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


def open_snapshot(spec: StageSpec, ref: ArtifactRef, name: str) -> ExperienceBank:
    """Restore a bank snapshot into a stage's own directory (read by that stage only; cold-start and train)."""
    local = dataclasses.replace(ref, uri=str(spec.store().get(ref)))  # downloaded first on a remote store
    target = spec.stage_dir(name) / "bank"
    return ExperienceBank.restore(local, str(target), ref.metadata.get("name", "experience"), overwrite=True)
