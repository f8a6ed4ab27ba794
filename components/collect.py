"""collect: roll out a policy on a suite's training tasks, verify every episode, write all trajectories.

The base model by default (the pipeline's first stage); a trained student when `checkpoint` is given (the bank
grows from later runs too). Every trajectory is kept, with its reward and check results; the bank stage keeps
the successes.

    python -m components.collect suite=toolworld backbone=smollm2-135m n_tasks=64 samples_per_task=2
"""

from __future__ import annotations

import contextlib
import random
import sys
import time

from pydantic import Field

from components.common import (
    StageResult,
    StageSpec,
    backbone_label,
    load_stage_backbone,
    open_suite,
    run_stage_cli,
    start_tracking,
    write_trajectories,
)
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import RolloutConfig


class CollectSpec(StageSpec):
    backbone: str = "smollm2-135m"
    warm_start: ArtifactRef | None = None  # the sft stage's model: rolls out instead of the plain backbone
    suite: str = "toolworld"
    validation_fraction: float = Field(0.0, ge=0, lt=1)  # a slice of the training split never collected on
    n_tasks: int | None = Field(None, ge=1)  # a seeded sample of the training split; None = all
    difficulties: list[int] | None = None  # keep only these difficulty levels
    samples_per_task: int = Field(1, ge=1)
    rollout: RolloutConfig = RolloutConfig()
    checkpoint: ArtifactRef | None = None  # roll out this trained student instead of the base model
    success_threshold: float = Field(1.0, ge=0, le=1)
    seed: int = 0
    threads: int = Field(1, ge=1)  # torch threads (one is faster than two on the 2-core CPU machines)


def collect(spec: CollectSpec) -> StageResult:
    # the stage's heavy imports load when it runs, so that `--help` stays fast
    import torch

    from lopd_core.engines import make_engine
    from lopd_core.rollout import summarize

    torch.set_num_threads(spec.threads)
    suite = open_suite(spec.suite, spec.validation_fraction)
    tasks = suite.tasks("train")
    if spec.difficulties is not None:
        tasks = [t for t in tasks if t.difficulty in set(spec.difficulties)]
    if spec.n_tasks is not None and spec.n_tasks < len(tasks):
        tasks = sorted(random.Random(spec.seed).sample(tasks, spec.n_tasks), key=lambda t: t.task_id)
    if not tasks:
        raise ValueError(f"no training tasks in suite {spec.suite!r} match difficulties={spec.difficulties}")
    store = spec.store()
    label = backbone_label(spec.backbone, spec.warm_start)
    with start_tracking(spec, "collect", spec.suite, spec, backbone=label, seed=spec.seed) as run:
        if spec.checkpoint is not None:
            from lopd_core.checkpoint import load_student

            source = str(store.get(spec.warm_start)) if spec.warm_start is not None else spec.backbone
            models = load_student(store.get(spec.checkpoint), source)
            model_cm = models.acting_student()
            tokenizer = models.tokenizer
        else:
            model, tokenizer, _ = load_stage_backbone(spec.backbone, spec.warm_start, store)
            model_cm = contextlib.nullcontext(model)
        episodes = [suite.episode(t) for t in tasks for _ in range(spec.samples_per_task)]
        t0 = time.time()
        with model_cm as model, make_engine(model, tokenizer, spec.rollout.seeded(spec.seed)) as engine:
            trajectories = engine.run(episodes, "collect")
        for t in trajectories:
            t.metadata["run_id"] = run.run_id
        summary = summarize(trajectories)
        path = write_trajectories(spec.stage_dir("collect") / "trajectories.jsonl", trajectories)
        n_success = sum(t.reward >= spec.success_threshold and not t.failed for t in trajectories)
        meta = {"suite": spec.suite, "backbone": label, "n": len(trajectories), "n_success": n_success,
                "success_threshold": spec.success_threshold, "source_run": run.run_id}  # fmt: skip
        ref = store.put(path, "dataset", meta)
        metrics = {
            "n_trajectories": float(len(trajectories)),
            "n_success": float(n_success),
            "reward_mean": float(sum(t.reward for t in trajectories) / len(trajectories)),
            "success_rate": n_success / len(trajectories),
            "failed_rollouts": float(sum(t.failed for t in trajectories)),
            "generations": float(len(trajectories)),
            "seconds": time.time() - t0,
        }
        run.log_metrics(metrics)
        run.log_json(summary, "collect_summary.json")
        run.log_artifact_ref(ref)
    text = (f"collected {len(trajectories)} trajectories on {len(tasks)} tasks: {n_success} successes "
            f"(reward mean {metrics['reward_mean']:.3f}) in {metrics['seconds']:.0f} s")  # fmt: skip
    return StageResult(stage="collect", artifacts={"dataset": ref}, metrics=metrics, mlflow_run_id=run.run_id,
                       summary=text)  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_stage_cli(CollectSpec, collect))
