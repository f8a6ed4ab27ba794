"""Ingestion into an `ExperienceBank`: validate, guard the split, dedupe and store records (`add`, `ingest`);
`experiences_from_jsonl` turns trajectory JSON lines into records to ingest."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from components.memory.backends import Backend
from components.memory.embedders import Embedder
from components.memory.records import (
    DEFAULT_MIN_REWARD,
    INSERT_BATCH,
    TRAIN_SPLIT,
    Experience,
    IngestReport,
    SplitLeakError,
    _describe,
    _now,
)
from lopd_core.conversation import Trajectory

logger = logging.getLogger(__name__)


class IngestMixin:
    """The ingestion methods of `ExperienceBank` (components.memory.bank), which provides these attributes."""

    _backend: Backend
    embedder: Embedder
    name: str
    min_reward: float
    _count: int
    _eras: Any

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
        existing = self._backend.existing_eras(list(unique))
        new = [e for pid, e in unique.items() if pid not in existing]
        report.duplicates = len(valid) - len(new)
        # A success stored in an earlier era and verified again in a later one holds in the later era too: it moves
        # there and counts as new at this version, since what retrieval returns changed (docs/memory.md, "Eras").
        later: dict[int, list[str]] = {}
        for pid, e in unique.items():
            if pid in existing and e.era > existing[pid]:
                later.setdefault(e.era, []).append(pid)
        version = self.version + 1
        for era, ids in later.items():
            self._backend.set_era(ids, era, version)
        report.moved_era = sum(len(ids) for ids in later.values())
        if new:
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
        self._eras = None  # entries per environment and era: read again
        report.version = self.version
        report.count = self._count
        logger.info(
            "bank %s: %d received, %d added, %d duplicates (%d moved to a later era), %d rejected; version %d, "
            "%d entries",
            self.name,
            report.received,
            report.added,
            report.duplicates,
            report.moved_era,
            len(report.rejected),
            report.version,
            report.count,
        )
        return report


def experiences_from_jsonl(
    lines: Iterable[str], min_reward: float = DEFAULT_MIN_REWARD, source_run: str = "", origin: str = "input"
) -> tuple[list[Experience], list[str], int]:
    """Parse `lopd_core.conversation.Trajectory` JSON lines and keep the successes.

    Returns (records, errors, skipped): Experience records for `ExperienceBank.ingest` (which still
    validates them), one error per line that is not a valid Trajectory (naming the line and task id),
    and how many trajectories were skipped as failures (reward below `min_reward`, or an errored rollout).
    Raises `SplitLeakError` on an evaluation episode (an evaluate stage's trajectories.jsonl): held-out data.
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
        if "benchmark" in data:  # the evaluate stage's trajectories.jsonl: held-out episodes, never bank entries
            raise SplitLeakError(
                f"{origin}:{number} is an evaluation episode (benchmark {data['benchmark']!r}, from an evaluate "
                "stage's trajectories.jsonl): held-out tasks must never enter the experience bank, where the "
                "teacher would read their solutions while training. Ingest the collect stage's trajectories.jsonl "
                "or a training run's instead"
            )
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
