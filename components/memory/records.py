"""What a bank stores and reports: an `Experience` (a task and its compact action trace), the ingest, version
and audit reports, the errors, and the bank's constants."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from lopd_core.conversation import Message, Trajectory, experience_document
from lopd_core.envs.base import suite_era

if TYPE_CHECKING:
    pass


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
    era: int = (
        0  # the era of the suite it succeeded on (`<suite>-era<n>`); a later era's entry of its env supersedes it
    )
    score: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def document(self) -> str:
        """The text that is embedded and handed to the composer as a retrieved item."""
        return experience_document(self.task, self.trace)

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
        if isinstance(self.era, bool) or not isinstance(self.era, int) or self.era < 0:
            out.append(f"era must be an int >= 0, got {self.era!r}")
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
        """A bank entry from a rollout: its `trace`, or a compact trace built from its messages when empty; its era
        from its suite's name (`lopd_core.envs.base.suite_era`)."""
        return cls(
            task_id=traj.task_id,
            env_id=traj.env_id,
            split=traj.split,
            task=traj.task,
            trace=traj.trace or compact_trace(traj.messages),
            reward=traj.reward,
            source_run=source_run or str(traj.metadata.get("run_id", "")),
            era=suite_era(str(traj.metadata.get("suite") or ""))[1],
            metadata={
                "n_turns": traj.n_turns,
                "n_calls": traj.n_calls,
                "finish_reason": traj.finish_reason,
                **({"suite": traj.metadata["suite"]} if traj.metadata.get("suite") else {}),
            },
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
    moved_era: int = 0  # duplicates stored in an earlier era and verified again in a later one: moved to it
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
