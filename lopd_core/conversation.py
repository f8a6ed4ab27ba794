"""The conversation record every stage exchanges: messages of a multi-turn tool-use episode and its verdict.

A `Trajectory` is what the rollout engine writes, the verifier scores, the bank stores (as a compact trace)
and the train step turns into student and teacher token views (`lopd_core.serialization`).

Message roles: "system" (instructions and tool schemas), "user" (the task; later user turns in multi-turn
benchmarks), "assistant" (the policy's actions, the only supervised tokens) and "tool" (observations).
An assistant message produced by the rollout engine keeps the exact token ids it sampled (`token_ids`,
content only, without the end-of-turn token), so training scores precisely the tokens that were sampled.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


@dataclass
class Message:
    role: Role
    content: str
    # Assistant messages from a rollout: the sampled content token ids (no end-of-turn token).
    token_ids: list[int] | None = None
    # True when generation stopped at the turn's token limit instead of sampling the end-of-turn token;
    # the end-of-turn token is then not supervised (it was never sampled).
    truncated: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message.role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Message.content must be a str, got {type(self.content).__name__}")
        if self.token_ids is not None and self.role != "assistant":
            raise ValueError("Message.token_ids is only meaningful for assistant messages")


# (field, type, how an error names it): the fields a JSON line may get wrong (e.g. "reward": "1.0")
_FIELD_TYPES: tuple[tuple[str, Any, str], ...] = (
    ("task_id", str, "a str"), ("env_id", str, "a str"), ("task", str, "a str"), ("split", str, "a str"),
    ("trace", str, "a str"), ("reward", numbers.Real, "a number in [0, 1]"), ("failed", bool, "true or false"),
    ("messages", list, "a list of messages"), ("metadata", dict, "an object"),
)  # fmt: skip


def experience_document(task: str, trace: str) -> str:
    """A successful trajectory as the experience bank embeds it and returns it to the composer (an m_j)."""
    return f"Task: {task}\nTrace:\n{trace}"


@dataclass
class Trajectory:
    """One episode: the conversation, the outcome reward r in [0, 1] and bookkeeping for metrics."""

    task_id: str
    env_id: str
    task: str  # the instruction text, as the bank and the composer see it
    messages: list[Message]
    reward: float = 0.0
    split: str = "train"
    checks: list[dict[str, Any]] = field(default_factory=list)  # per-check results from the verifier
    trace: str = ""  # compact action-result trace (observations omitted) for the experience bank
    failed: bool = False  # the rollout itself errored: excluded from the losses, counted in metrics
    error: str | None = None
    finish_reason: str = ""  # "finish" | "max_turns" | "max_tokens" | "error" | ...
    n_turns: int = 0
    n_calls: int = 0
    n_errors: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, kind, what in _FIELD_TYPES:
            value = getattr(self, name)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is numbers.Real):
                raise TypeError(
                    f"Trajectory {self.task_id!r}: field {name!r} must be {what}, got {type(value).__name__} {value!r}"
                )
        self.messages = [m if isinstance(m, Message) else Message(**m) for m in self.messages]
        if not 0.0 <= float(self.reward) <= 1.0:
            raise ValueError(f"Trajectory {self.task_id!r}: reward must lie in [0, 1], got {self.reward}")
        if not any(m.role == "user" for m in self.messages):
            raise ValueError(f"Trajectory {self.task_id!r}: needs a user message (the task)")

    @property
    def n_actions(self) -> int:
        return sum(m.role == "assistant" for m in self.messages)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> Trajectory:
        return cls.from_dict(json.loads(line))
