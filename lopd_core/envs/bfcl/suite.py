"""`BFCLSuite`: the BFCL-v3 multi-turn tasks of the four subsets (all split "eval"), their episodes with the held-out
functions set aside, and the ground truth as tool calls."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

from lopd_core.envs.actions import ToolCall
from lopd_core.envs.base import SPLITS, Task
from lopd_core.envs.bfcl.calls import _parse_call_source
from lopd_core.envs.bfcl.data import _func_docs, _load_subset, _turn_text
from lopd_core.envs.bfcl.episode import MAX_STEPS_PER_TURN, BFCLEpisode
from lopd_core.envs.bfcl.package import SUITE_NAME, _is_long_context, _package

SUBSETS: tuple[str, ...] = ("base", "miss_func", "miss_param", "long_context")


class BFCLSuite:
    """BFCL-v3 multi-turn tasks (all split "eval"); `subsets` picks which of the four to list."""

    name = SUITE_NAME

    def __init__(
        self,
        subsets: tuple[str, ...] | list[str] = SUBSETS,
        data_dir: str | Path | None = None,
        max_steps_per_turn: int = MAX_STEPS_PER_TURN,
        check_irrelevance: bool = False,
    ) -> None:
        for subset in subsets:
            _check_subset(subset)
        if max_steps_per_turn < 1:
            raise ValueError("max_steps_per_turn must be at least 1")
        self._pkg = _package()
        self.subsets = tuple(subsets)
        self.data_dir = str(Path(data_dir) if data_dir is not None else self._pkg.data_dir)
        self.max_steps_per_turn = max_steps_per_turn
        self.check_irrelevance = check_irrelevance
        self._tasks: dict[str, list[Task]] = {}

    def tasks(self, split: str, subset: str | None = None) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if subset is not None:
            _check_subset(subset)
        if split != "eval":  # BFCL is an evaluation benchmark: nothing may enter a training bank
            return []
        subsets = (subset,) if subset is not None else self.subsets
        return [task for s in subsets for task in self._subset_tasks(s)]

    def episode(self, task: Task) -> BFCLEpisode:
        entry, truth = self._lookup(task)
        tools = {schema["name"]: schema for schema in self._functions(entry)}
        held_out = {}
        for turn, names in entry.get("missed_function", {}).items():
            held_out[int(turn)] = [tools.pop(n) for n in names]
        return BFCLEpisode(
            task,
            entry,
            truth,
            tools,
            held_out,
            max_steps_per_turn=self.max_steps_per_turn,
            check_irrelevance=self.check_irrelevance,
        )

    def reference_calls(self, task: Task) -> list[list[ToolCall]]:
        """BFCL's ground truth for `task` as tool calls with keyword arguments, per user turn."""
        entry, truth = self._lookup(task)
        signatures: dict[str, inspect.Signature] = {}
        for class_name in entry["involved_classes"]:
            cls = self._pkg.backend_class(class_name)
            for method, fn in inspect.getmembers(cls, inspect.isfunction):
                if not method.startswith("_"):
                    signatures[method] = inspect.signature(fn)
        return [[_parse_call_source(src, signatures) for src in turn] for turn in truth]

    # -- internals ---------------------------------------------------------------------------------------------

    def _subset_tasks(self, subset: str) -> list[Task]:
        if subset not in self._tasks:
            loaded = _load_subset(self.data_dir, subset).values()
            self._tasks[subset] = [self._task(subset, entry, truth) for entry, truth in loaded]
        return self._tasks[subset]

    def _functions(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        docs: list[dict[str, Any]] = []
        for class_name in entry["involved_classes"]:
            docs.extend(copy.deepcopy(_func_docs(self.data_dir, self._pkg.func_doc_files[class_name])))
        return docs

    def _lookup(self, task: Task) -> tuple[dict[str, Any], list[list[str]]]:
        subset = task.metadata.get("subset") or _subset_of(task.task_id)
        try:
            return _load_subset(self.data_dir, subset)[task.task_id]
        except KeyError:
            raise KeyError(f"no BFCL-v3 task {task.task_id!r} in subset {subset!r}") from None

    def _task(self, subset: str, entry: dict[str, Any], truth: list[list[str]]) -> Task:
        missed = entry.get("missed_function", {})
        held_names = {n for names in missed.values() for n in names}
        tools = tuple(s for s in self._functions(entry) if s["name"] not in held_names)
        return Task(
            task_id=entry["id"],
            env_id=f"{SUITE_NAME}/{subset}",
            split="eval",
            instruction=_turn_text(entry["question"][0]),
            tools=tools,
            suite=SUITE_NAME,
            difficulty=sum(len(turn) for turn in truth),
            metadata={
                "subset": subset,
                "involved_classes": list(entry["involved_classes"]),
                "n_turns": len(entry["question"]),
                "user_turns": [_turn_text(turn) for turn in entry["question"]],
                "missed_function": {int(k): list(v) for k, v in missed.items()},
                "long_context": _is_long_context(entry["id"]),
            },
        )


def _check_subset(subset: str) -> None:
    if subset not in SUBSETS:
        raise ValueError(f"BFCL-v3 subset must be one of {SUBSETS}, got {subset!r}")


def _subset_of(task_id: str) -> str:
    return task_id.removeprefix("multi_turn_").rsplit("_", 1)[0]
