"""The outer loop of Algorithm 1: sample tasks -> student rollouts -> verify -> one train step -> checkpoint.

    summary = train_loop(step, tasks, rollout, schedule, checkpoint_dir)   # resumes from checkpoint_dir/last

The rollout is a callable `(tasks) -> trajectories` (the engine with the student adapter live, verification
included), so this loop knows nothing about environments or services. The task order comes from a seeded,
resumable sampler; checkpoints hold everything needed to continue exactly (`lopd_core.checkpoint`): a run
killed after step k and resumed ends with the same metrics as one that never stopped.

Under torchrun (`lopd_core.distributed`) every rank runs this loop: the sampler is the same everywhere, rank r
rolls out every world_size-th task of the step, the step reduces over ranks, and rank 0 alone writes the
checkpoint (with every rank's RNG state). A checkpoint resumes at any world size (weights, optimizer, beta,
sampler and counters are the same on every rank, and a checkpoint holds whole tensors even when FSDP shards them);
at the world size that wrote it, exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lopd_core.checkpoint import checkpoint_tensors, gather_rng_states, load_checkpoint, save_checkpoint
from lopd_core.config import ScheduleConfig
from lopd_core.conversation import Trajectory
from lopd_core.envs.base import Task
from lopd_core.step import TrainStep
from lopd_core.timing import section

RolloutFn = Callable[[Sequence[Task]], list[Trajectory]]


class TaskSampler:
    """Seeded epoch-wise permutations over the tasks; its state is (epoch, position)."""

    def __init__(self, task_ids: Sequence[str], batch_size: int, seed: int = 0) -> None:
        if not task_ids:
            raise ValueError("no training tasks")
        self.task_ids = sorted(task_ids)
        self.batch_size = min(batch_size, len(self.task_ids))
        self.seed = seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[str]:
        order = list(self.task_ids)
        random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[str]:
        batch: list[str] = []
        while len(batch) < self.batch_size:
            order = self._order()
            take = order[self.position : self.position + self.batch_size - len(batch)]
            batch.extend(take)
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler seed {self.seed} differs from the checkpoint's {state['seed']}")
        self.epoch, self.position = state["epoch"], state["position"]


BAR_FIELDS = {"reward": "reward_mean", "margin": "margin", "β": "beta"}  # what the step bar shows, if logged


def progress_fields(metrics: dict[str, float], generations: int) -> dict[str, str]:
    """The step bar's postfix: reward, the verdict margin and β where the method has them, generations so far."""
    shown = {name: f"{metrics[key]:.3f}" for name, key in BAR_FIELDS.items() if key in metrics}
    return shown | {"gen": str(generations)}


def train_loop(
    step: TrainStep,
    tasks: Sequence[Task],
    rollout: RolloutFn,
    schedule: ScheduleConfig,
    checkpoint_dir: str | Path | None = None,
    stop_after: int | None = None,
    extra_state: dict[str, Any] | None = None,
    on_checkpoint: Callable[[Path, int], None] | None = None,
    before_checkpoint: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) the loop to `schedule.steps`; `stop_after` ends early after that many steps (tests).

    `before_checkpoint(done)` runs before a checkpoint covering steps [0, done) is written (flush the metrics
    there: if it raises, no checkpoint is written and a resume replays the steps); `on_checkpoint(path, done)`
    after it is written."""
    by_id = {t.task_id: t for t in tasks}
    if len(by_id) != len(tasks):
        raise ValueError("duplicate task ids in the training tasks")
    bad = [t.task_id for t in tasks if t.split != "train"]
    if bad:
        raise ValueError(f"{len(bad)} tasks are not from the training split (e.g. {bad[:3]}); refusing to train")
    sampler = TaskSampler(list(by_id), schedule.tasks_per_step, step.cfg.seed)
    world = step.world  # data-parallel: each rank rolls out its share of the step's tasks (lopd_core.distributed)
    if sampler.batch_size < world.world_size:
        raise ValueError(f"schedule.tasks_per_step={sampler.batch_size} (of {len(by_id)} tasks) is below the world "
                         f"size {world.world_size}: every rank needs at least one task per step")  # fmt: skip
    generations, history = 0, []
    # per step: the reward sum and count of each environment's rollouts, over every rank (env_rewards: the era shift
    # reads how fast the environments whose rules changed recover; flows/era.py)
    envs, env_rewards = sorted({t.env_id for t in tasks}), []
    last = Path(checkpoint_dir) / "last" if checkpoint_dir else None
    if last is not None and (last / "state.json").exists():
        state = load_checkpoint(last, step.models, step.optimizer, world.rank, world.world_size)
        step.step_index = state["step"]
        step.objective.load_state_dict(state["objective"])
        sampler.load_state_dict(state["sampler"])
        generations, history = state["generations"], state["history"]
        env_rewards = state.get("env_rewards", [])  # a checkpoint from before they were kept: from here on

    start = step.step_index
    end = schedule.steps if stop_after is None else min(schedule.steps, start + stop_after)
    steps = tqdm(range(start, end), desc=f"{step.cfg.method} steps", initial=start, total=schedule.steps,
                 disable=not world.is_main)  # fmt: skip
    for index in steps:
        local_ids = world.shard(sampler.next_batch())  # one rank: every task of the step
        batch_tasks = [by_id[i] for i in local_ids for _ in range(schedule.samples_per_task)]
        with step.gathered(), step.models.acting_student():  # FSDP: the student whole while it generates
            trajectories = rollout(batch_tasks)
        metrics = step(trajectories)  # global metrics: generations summed over ranks
        generations += int(metrics["generations"])
        metrics["generations_total"] = float(generations)
        history.append({k: float(v) for k, v in metrics.items()} | {"step": index})
        env_rewards.append(
            {"step": index, "generations_total": generations, "envs": per_env(trajectories, envs, world)}
        )
        steps.set_postfix(progress_fields(metrics, generations), refresh=False)
        done = index + 1
        if last is not None and (done % schedule.checkpoint_every == 0 or done == schedule.steps):
            if before_checkpoint is not None:
                before_checkpoint(done)
            state = {
                "step": done,
                "objective": step.objective.state_dict(),
                "sampler": sampler.state_dict(),
                "generations": generations,
                "history": history,
                "env_rewards": env_rewards,
                "method": step.cfg.method,
                "config": step.cfg.model_dump(mode="json"),
                **(extra_state or {}),
            }
            if world.active:  # written once, by rank 0 (the weights and the optimizer are the same on every rank)
                state["world_size"] = world.world_size
                ranks_rng = gather_rng_states(world)
                whole = checkpoint_tensors(step.models, step.optimizer)  # FSDP: gathered from the shards, every rank
                if world.is_main:
                    save_checkpoint(last, step.models, step.optimizer, state, ranks_rng, whole)
                    if on_checkpoint is not None:
                        on_checkpoint(last, done)
                world.barrier()
                continue
            with section("train/checkpoint"):
                save_checkpoint(last, step.models, step.optimizer, state)
            if on_checkpoint is not None:
                on_checkpoint(last, done)
    return {"steps_done": step.step_index, "generations": generations, "history": history, "env_rewards": env_rewards}


def per_env(trajectories: Sequence[Trajectory], envs: Sequence[str], world: Any) -> dict[str, list[float]]:
    """env -> [reward sum, rollouts] of one step's usable rollouts, summed over ranks (every rank sends every env)."""
    sums = {f"{e}\t{k}": 0.0 for e in envs for k in ("sum", "n")}
    for t in trajectories:
        if not t.failed and f"{t.env_id}\tn" in sums:
            sums[f"{t.env_id}\tsum"] += t.reward
            sums[f"{t.env_id}\tn"] += 1.0
    sums = world.sum_floats(sums)
    return {e: [sums[f"{e}\tsum"], sums[f"{e}\tn"]] for e in envs if sums[f"{e}\tn"]}
