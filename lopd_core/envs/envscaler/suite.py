"""`EnvScalerSuite`: tasks per split from EnvScaler-format environment and scenario items; its episodes run
sandboxed (`lopd_core.envs.envscaler.episode`) on workers shared through two pools (environments, checks)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lopd_core.envs.base import SPLITS, Task
from lopd_core.envs.envscaler.config import EnvScalerConfig
from lopd_core.envs.envscaler.episode import EnvScalerEpisode
from lopd_core.envs.envscaler.loading import load_env_items, load_scenarios
from lopd_core.envs.envscaler.workers import WorkerPool


class EnvScalerSuite:
    """Tasks per split from EnvScaler-format environment and scenario items; episodes run sandboxed."""

    def __init__(
        self,
        env_items: dict[str, dict[str, Any]],
        scenarios: dict[str, Iterable[dict[str, Any]]],
        name: str = "envscaler",
        config: EnvScalerConfig | None = None,
    ) -> None:
        self.name = name
        self.config = config or EnvScalerConfig()
        self.env_items = env_items
        self._scenarios: dict[str, dict[str, Any]] = {}
        self._tasks: dict[str, list[Task]] = {s: [] for s in SPLITS}
        self.skipped: list[str] = []  # scenarios left out (unknown environment or no checks), with the reason
        check_limits = replace(self.config.limits, timeout_s=self.config.check_timeout_s)
        per_worker = self.config.episodes_per_worker
        self._pools = (WorkerPool(self.config.limits, per_worker), WorkerPool(check_limits, per_worker))
        for split, items in scenarios.items():
            if split not in SPLITS:
                raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
            for index, item in enumerate(items):
                self._add(split, index, item)

    def _add(self, split: str, index: int, item: dict[str, Any]) -> None:
        env_id = str(item["env_id"])
        task_id = str(item.get("task_id") or f"{env_id}-{index}")
        if env_id not in self.env_items:
            self.skipped.append(f"{task_id}: unknown environment {env_id!r}")
            return
        if not item.get("checklist_with_func"):
            self.skipped.append(f"{task_id}: no checks")
            return
        if task_id in self._scenarios:
            raise ValueError(f"duplicate task_id {task_id!r} (task ids must be unique across splits)")
        self._scenarios[task_id] = item
        difficulty = item.get("difficulty")
        self._tasks[split].append(
            Task(
                task_id=task_id,
                env_id=env_id,
                split=split,
                instruction=str(item["task"]),
                tools=tuple(self.env_items[env_id]["tools"]),
                suite=self.name,
                difficulty=int(difficulty) if difficulty is not None else None,
                metadata={"n_checks": len(item["checklist_with_func"])},
            )
        )

    @classmethod
    def from_files(
        cls,
        env_metadata: str | Path,
        scenarios: dict[str, str | Path | Sequence[str | Path]],
        name: str = "envscaler",
        config: EnvScalerConfig | None = None,
    ) -> EnvScalerSuite:
        """`scenarios` maps a split to one scenario file or several."""
        loaded: dict[str, list[dict[str, Any]]] = {}
        for split, paths in scenarios.items():
            paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
            loaded[split] = [item for p in paths for item in load_scenarios(p)]
        return cls(load_env_items(env_metadata), loaded, name=name, config=config)

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return list(self._tasks[split])

    def task(self, task_id: str) -> Task:
        for tasks in self._tasks.values():
            for task in tasks:
                if task.task_id == task_id:
                    return task
        raise KeyError(task_id)

    def scenario(self, task_id: str) -> dict[str, Any]:
        """The raw scenario item (it may hold a reference solution: never show it to the policy)."""
        return self._scenarios[task_id]

    def episode(self, task: Task) -> EnvScalerEpisode:
        scenario = self._scenarios[task.task_id]
        return EnvScalerEpisode(task, scenario, self.env_items[task.env_id], self.config, self._pools)

    def close(self) -> None:
        """Stop the shared workers (episodes still open get fresh ones)."""
        for pool in self._pools:
            pool.close()
