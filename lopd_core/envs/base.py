"""The one environment protocol every task suite implements (built-in toolworld, EnvScaler files, BFCL-v3).

A `Task` names what to do; a `Suite` lists tasks per split and opens an `Episode` for a task. An episode
starts from `initial_messages()` (system prompt with the tool schemas and the action format, then the user
task), takes the assistant's action text through `step()`, answers with messages to append (tool
observations, or the next user turn in multi-turn benchmarks) and says when it is done. `result()` gives the
verifier's verdict: a reward in [0, 1], the per-check results and the compact action-result trace that the
experience bank stores. Parse errors, unknown tools, bad arguments and tool exceptions are observations the
model sees, never exceptions in the trainer; they are counted in `EpisodeResult`.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from lopd_core.conversation import Message

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Task:
    task_id: str
    env_id: str
    split: str
    instruction: str
    tools: tuple[dict[str, Any], ...] = ()  # JSON schemas: {"name", "description", "parameters"}
    suite: str = ""
    difficulty: int | None = None  # number of calls the reference solution needs, where known
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass
class StepResult:
    messages: list[Message]  # to append after the assistant's action (tool observations / next user turn)
    done: bool
    event: str = "call"  # "call" | "finish" | "parse_error" | "unknown_tool" | "bad_args" | "tool_error" | "no_call"
    n_calls: int = 0  # tool calls executed by this step


@dataclass
class EpisodeResult:
    reward: float  # in [0, 1]
    checks: list[dict[str, Any]] = field(default_factory=list)  # [{"name", "passed", "detail"}]
    trace: str = ""  # compact action-result trace, observations omitted
    n_calls: int = 0
    n_errors: int = 0  # parse errors + unknown tools + bad arguments + tool exceptions
    error_counts: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Episode(Protocol):
    task: Task

    def initial_messages(self) -> list[Message]: ...

    def step(self, action: str) -> StepResult: ...

    def result(self) -> EpisodeResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Suite(Protocol):
    name: str

    def tasks(self, split: str) -> list[Task]: ...

    def episode(self, task: Task) -> Episode: ...


# A suite's era: `<name>-era<n>` is the same suite after n changes of its rules (a user's environment versions). Its
# successes share the bank with the earlier eras' and supersede them, environment by environment.
_ERA = re.compile(r"-era(?P<era>[1-9]\d*)$")


def suite_era(name: str) -> tuple[str, int]:
    """(the suite's family, its era): `toolworld-rules-s1-digits-era2` -> (`toolworld-rules-s1-digits`, 2); a name
    without `-era<n>` is era 0 of itself. Experiences of one family share a bank; a later era supersedes an earlier
    one's experiences of the same environment (docs/memory.md, "Eras")."""
    match = _ERA.search(name)
    return (name, 0) if match is None else (name[: match.start()], int(match["era"]))


VALIDATION = "validation"


class WithValidation:
    """A suite whose training split lends a stratified slice to a `validation` split, for choosing
    hyperparameters without touching the held-out `eval` split.

        suite = WithValidation(load_toolworld(), fraction=0.1)
        suite.tasks("train")        # the training split minus the slice (what training, SFT and the bank see)
        suite.tasks("validation")   # the slice: split="validation", never enters a training bank

    The slice takes round(fraction * n) tasks of every (environment, difficulty) group, chosen by a seeded hash
    of the task id, so it does not depend on the order or the sampling of tasks elsewhere. Everything else
    (episodes, scenarios) is the wrapped suite's.
    """

    def __init__(self, suite: Suite, fraction: float, seed: int = 0) -> None:
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"validation fraction must lie in (0, 1), got {fraction}")
        self.suite = suite
        self.name = suite.name
        self.fraction = fraction
        self.seed = seed
        groups: dict[tuple[str, int | None], list[Task]] = {}
        for task in suite.tasks("train"):
            groups.setdefault((task.env_id, task.difficulty), []).append(task)
        held: set[str] = set()
        for group in groups.values():
            ranked = sorted(group, key=lambda t: hashlib.sha256(f"{seed}:{t.task_id}".encode()).hexdigest())
            held.update(t.task_id for t in ranked[: round(fraction * len(group))])
        self.validation_ids = frozenset(held)

    def tasks(self, split: str) -> list[Task]:
        if split == VALIDATION:
            return [replace(t, split=VALIDATION) for t in self.suite.tasks("train") if t.task_id in self.validation_ids]
        if split == "train":
            return [t for t in self.suite.tasks("train") if t.task_id not in self.validation_ids]
        return self.suite.tasks(split)

    def episode(self, task: Task) -> Episode:
        return self.suite.episode(task)

    def __getattr__(self, name: str) -> Any:  # scenario(), close(), ... of the wrapped suite
        return getattr(self.suite, name)
