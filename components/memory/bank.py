"""`ExperienceBank`: ingest, retrieve (never a task's own entries), versions, audit, snapshot and restore."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from components.memory.backends import (
    Backend,
    ClientBackend,
    SearchSettings,
    edge_available,
    probe_hnsw_recall,
)
from components.memory.embedders import Embedder, make_embedder
from components.memory.records import (
    DEFAULT_MIN_REWARD,
    INSERT_BATCH,
    LOCK_FILE,
    MANIFEST_FILE,
    METADATA_KEY,
    QUERY_CACHE_SIZE,
    TIE_MARGIN,
    TRAIN_SPLIT,
    AuditReport,
    BankVersion,
    Experience,
    IngestReport,
    SplitLeakError,
    _describe,
    _normalise_text,
    _now,
)
from components.memory.storage import (
    check_embedder,
    copy_points,
    dir_backend,
    open_client,
    open_dir,
    path_from_uri,
    search_settings,
    write_json,
)
from lopd_core.artifacts import ArtifactRef, sha256_path
from lopd_core.conversation import Trajectory

if TYPE_CHECKING:
    from components.common import StageSpec


logger = logging.getLogger(__name__)


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
                    self._backend = dir_backend(self.bank_dir, self.manifest, create=False)
                kind = self.manifest["backend"]
            else:  # ":memory:" -> a directory bank with the default embedded engine
                kind = "edge" if edge_available() else "local"
                manifest = {**self.manifest, "backend": kind}
                target = dir_backend(tmp, manifest, create=True)
                try:
                    copy_points(self._backend, target)
                finally:
                    target.close()
                write_json(tmp / MANIFEST_FILE, manifest)
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
        source = path_from_uri(ref.uri)
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
            embedder = check_embedder(manifest, embedder)
            backend = ClientBackend.connect(location, name, manifest["dim"], search_settings(manifest), api_key=api_key)
            backend.upload_snapshot(source)
            backend.set_metadata({METADATA_KEY: manifest})
            backend.close()
            return cls.open(location, name, embedder, api_key=api_key)

        manifest = json.loads((source / MANIFEST_FILE).read_text())
        if isinstance(embedder, str):
            embedder = make_embedder(embedder)
        embedder = check_embedder(manifest, embedder)
        if location != ":memory:" and not is_server:
            target = Path(location) / name
            if target.exists() and any(target.iterdir()):
                if not overwrite:
                    raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
                shutil.rmtree(target)
            shutil.copytree(source, target, dirs_exist_ok=True)
            write_json(target / MANIFEST_FILE, {**manifest, "name": name})
            return cls.open(location, name, embedder)

        # Into ":memory:" or a server: open a scratch copy (opening an engine writes to its directory).
        with tempfile.TemporaryDirectory(prefix="bank-restore-") as scratch:
            copy = Path(scratch) / "bank"
            shutil.copytree(source, copy)
            src_backend = dir_backend(copy, manifest, create=False)
            try:
                bank = cls.open(
                    location,
                    name,
                    embedder,
                    min_reward=float(manifest["min_reward"]),
                    search=search_settings(manifest),
                    api_key=api_key,
                )
                copy_points(src_backend, bank._backend)
                bank._count = bank._backend.count()
            finally:
                src_backend.close()
        return bank


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
