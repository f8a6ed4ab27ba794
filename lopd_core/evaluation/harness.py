"""Running benchmarks: task selection, a policy over episodes, per-episode records, and per-benchmark aggregates.

A *policy* is anything that turns episodes into trajectories: `RolloutEngine.run` for a model,
`LatentRollout.run` for the latent teacher, `ScriptedPolicy` to replay fixed actions (ground truth, tests).

    tasks = select_tasks(suite.tasks("eval"), n=50, seed=0, key="toolworld")
    records, trajectories = run_tasks(engine.run, suite, tasks, benchmark="toolworld")
    metrics = aggregate("toolworld", "agent", records)

The aggregate of a benchmark is a JSON-able dict: `overall` (score block: n, mean reward and success rate in
percent with 95% intervals, behaviour statistics), groups (`by_subset`, `by_env`, `by_difficulty`) and the
`headline` estimate the paper's tables report: mean reward for EnvScaler-format suites, the mean of the
four subset accuracies for BFCL-v3, pass@1 (and pass@k) for code.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.base import Episode, Suite, Task
from lopd_core.evaluation.stats import (
    EpisodeRecord,
    group_by,
    pass_block,
    score_block,
    weighted_mean,
    wilson,
)

Policy = Callable[[Sequence[Episode]], list[Trajectory]]
KINDS = ("agent", "bfcl", "code")


def select_tasks(tasks: Sequence[Task], n: int | None, seed: int, key: str = "", by: str | None = None) -> list[Task]:
    """A deterministic sample of `n` tasks (all when `n` is None or >= len), in the original order.

    With `by` (a metadata key such as "subset"), `n` tasks are drawn from each group.
    """
    if by is not None:
        groups: dict[str, list[Task]] = {}
        for t in tasks:
            groups.setdefault(str(t.metadata.get(by, "")), []).append(t)
        chosen = {t.task_id for g, ts in groups.items() for t in select_tasks(ts, n, seed, f"{key}/{g}")}
        return [t for t in tasks if t.task_id in chosen]
    if n is None or n >= len(tasks):
        return list(tasks)
    if n < 0:
        raise ValueError(f"sample size must be >= 0, got {n}")
    picked = sorted(random.Random(f"{seed}:{key}").sample(range(len(tasks)), n))
    return [tasks[i] for i in picked]


def record(benchmark: str, trajectory: Trajectory, task: Task, sample: int = 0) -> EpisodeRecord:
    """The evaluation record of one trajectory (a failed rollout scores 0)."""
    failed = bool(trajectory.failed)
    reward = 0.0 if failed else float(trajectory.reward)
    return EpisodeRecord(
        benchmark=benchmark,
        task_id=task.task_id,
        reward=reward,
        success=reward >= 1.0,
        subset=str(task.metadata.get("subset", "")),
        env_id=task.env_id,
        difficulty=task.difficulty,
        sample=sample,
        n_steps=trajectory.n_turns,
        n_calls=trajectory.n_calls,
        n_errors=trajectory.n_errors,
        finish_reason=trajectory.finish_reason,
        failed=failed,
        error=trajectory.error,
        **_rule_fields(trajectory),
        extra={"detail": _failure_detail(trajectory)} if not failed and reward < 1.0 else {},
    )


def _rule_fields(trajectory: Trajectory) -> dict[str, Any]:
    """The house rule's check of an episode (lopd_core.envs.toolworld.rules), as the record's rule fields."""
    check = next((c for c in trajectory.checks if c.get("rule")), None)
    if check is None or trajectory.failed:
        return {}
    return {
        "rule_calls": int(check.get("calls", 0)),
        "rule_passed": bool(check.get("passed")),
        "reward_without_rule": check.get("reward_without_rule"),
    }


def _failure_detail(trajectory: Trajectory, limit: int = 300) -> str:
    """The first failed check's detail, short (why a code run or a check failed)."""
    for check in trajectory.checks:
        if not check.get("passed"):
            detail = check.get("detail")
            text = detail if isinstance(detail, str) else json.dumps(detail, default=str)
            return (f"{check.get('name', '')}: {text}" if text else str(check.get("name", "")))[:limit]
    return ""


def run_tasks(
    policy: Policy, suite: Suite, tasks: Sequence[Task], benchmark: str, samples: int = 1
) -> tuple[list[EpisodeRecord], list[Trajectory]]:
    """Roll out `samples` episodes per task (task-major order) and return their records and trajectories."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    plan = [(task, s) for task in tasks for s in range(samples)]
    trajectories = policy([suite.episode(task) for task, _ in plan]) if plan else []
    if len(trajectories) != len(plan):
        raise RuntimeError(f"the policy returned {len(trajectories)} trajectories for {len(plan)} episodes")
    records = [record(benchmark, traj, task, s) for (task, s), traj in zip(plan, trajectories, strict=True)]
    return records, trajectories


def _blocks(records: Sequence[EpisodeRecord], key: str) -> dict[str, Any]:
    return {name: score_block(group) for name, group in group_by(records, key).items()}


def aggregate(
    benchmark: str,
    kind: str,
    records: Sequence[EpisodeRecord],
    ks: Iterable[int] = (1,),
    subsets: Sequence[str] | None = None,
    family: str | None = None,
) -> dict[str, Any]:
    """The metrics of one benchmark (see the module docstring); `kind` is "agent", "bfcl" or "code"; `family` is the
    benchmark it is an instance of (e.g. "livecodebench" for a key "lcb_v6"; default: the key)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    records = list(records)
    out: dict[str, Any] = {
        "benchmark": benchmark,
        "family": family or benchmark,
        "kind": kind,
        "n_tasks": len({r.task_id for r in records}),
        "n_episodes": len(records),
        "overall": score_block(records),
    }
    if kind == "code":
        out["overall"].update(pass_block(records, ks))
        if any(r.subset for r in records):
            out["by_subset"] = _blocks(records, "subset")
        headline = out["overall"].get("pass@1")
        out["headline"] = {"metric": "pass@1", **(headline or score_block([])["success_rate"])}
        return out
    out["by_subset"] = _blocks(records, "subset") if any(r.subset for r in records) else {}
    if kind != "bfcl":  # a BFCL task's env id only repeats its subset
        out["by_env"] = _blocks(records, "env_id")
    out["by_difficulty"] = _blocks(records, "difficulty")
    if kind == "bfcl":
        groups = group_by(records, "subset")
        names = [s for s in (subsets or groups) if s in groups]
        parts = [wilson(sum(r.success and not r.failed for r in groups[s]), len(groups[s])) for s in names]
        out["subsets"] = names
        mean = weighted_mean(parts, weights=[1.0] * len(parts))
        out["headline"] = {"metric": "accuracy (mean over subsets)", **mean.to_dict()}
    else:
        out["headline"] = {"metric": "mean_reward", **out["overall"]["mean_reward"]}
    return out


def flat_metrics(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """MLflow-style flat numeric metrics of an evaluation's benchmark dicts: `<bench>/<group>/<metric>`."""
    out: dict[str, float] = {}

    def add_block(path: str, block: dict[str, Any]) -> None:
        for name in ("mean_reward", "success_rate"):
            if name in block:
                out[f"{path}/{name}"] = float(block[name]["value"])
        for name, value in block.items():
            if name.startswith("pass@") and isinstance(value, dict):
                out[f"{path}/{name.replace('@', '_at_')}"] = float(value["value"])
        for name in ("n", "steps_per_task", "calls_per_step", "errors_per_episode", "failed"):
            if name in block:
                out[f"{path}/{name}"] = float(block[name])

    for bench, data in metrics.items():
        base = f"{prefix}{bench}"
        out[f"{base}/headline"] = float(data["headline"]["value"])
        out[f"{base}/headline_lo"] = float(data["headline"]["lo"])
        out[f"{base}/headline_hi"] = float(data["headline"]["hi"])
        add_block(f"{base}/overall", data["overall"])
        for group in ("by_subset", "by_env", "by_difficulty"):
            for name, block in (data.get(group) or {}).items():
                add_block(f"{base}/{group.removeprefix('by_')}/{name}", block)
    return out


# ---------------------------------------------------------------------------------------------- replay policy


class ScriptedPolicy:
    """Plays a fixed list of actions per task (e.g. the ground truth) through the episodes, like a model would.

    `actions(task)` gives the assistant turns in order; the episode is stepped until it is done or the actions
    run out. Used to check that ground truth scores 100% through the harness and perturbed answers fail.
    """

    def __init__(self, actions: Callable[[Task], list[str]]) -> None:
        self.actions = actions

    def __call__(self, episodes: Sequence[Episode]) -> list[Trajectory]:
        return [self._play(e) for e in episodes]

    def _play(self, episode: Episode) -> Trajectory:
        task = episode.task
        messages: list[Message] = []
        n_turns = n_calls = 0
        finish, error = "actions_exhausted", None
        reward, checks, trace, n_errors = 0.0, [], "", 0
        try:
            messages = list(episode.initial_messages())
            for action in self.actions(task):
                messages.append(Message("assistant", action))
                step = episode.step(action)
                n_turns += 1
                n_calls += step.n_calls
                messages.extend(step.messages)
                if step.done:
                    finish = step.event if step.event not in ("call", "") else "finish"
                    break
            result = episode.result()
            reward, checks, trace, n_errors = float(result.reward), result.checks, result.trace, result.n_errors
            n_calls = result.n_calls or n_calls
        except Exception as exc:
            error, finish = f"{type(exc).__name__}: {exc}", "error"
        finally:
            try:
                episode.close()
            except Exception:
                pass
        if not any(m.role == "user" for m in messages):
            messages = [Message("user", task.instruction), *messages]
        return Trajectory(
            task_id=task.task_id,
            env_id=task.env_id,
            task=task.instruction,
            messages=messages,
            reward=reward if error is None else 0.0,
            split=task.split,
            checks=checks,
            trace=trace,
            failed=error is not None,
            error=error,
            finish_reason=finish,
            n_turns=n_turns,
            n_calls=n_calls,
            n_errors=n_errors,
            metadata={"suite": task.suite, "difficulty": task.difficulty, "scripted": True},
        )
