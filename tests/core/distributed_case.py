"""One training run on the tiny backbone, the same code for one process and for every rank under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.core.distributed_case OUT_DIR [full]

runs the cases of `tests/core/test_distributed.py` on every rank and writes `OUT_DIR/rank<r>.pt`. The rollout is
deterministic in the task and its sample index (not sampled), so a one-rank run and a two-rank run see the
same trajectories and differ only in how the step's work is split: what the equivalence test isolates. `full`:
full fine-tuning, which several ranks shard with FSDP2.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lopd_core.backbone import load_backbone
from lopd_core.config import LOPDConfig, ScheduleConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.distributed import full_tensor
from lopd_core.envs.base import Task
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.step import TrainStep, build_method
from lopd_core.training import train_loop

TASKS = [Task(f"t{i}", "files", "train", f"List the folder /f{i}") for i in range(4)]
CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64, student_lr=1e-3, composer_lr=1e-3)
SCHEDULE = ScheduleConfig(steps=3, tasks_per_step=4, samples_per_task=2, checkpoint_every=1)
FILES = ("a.txt", "b.txt", "c.txt")


def rollout(tasks: list[Task]) -> list[Trajectory]:
    """The k-th sample of task i answers with FILES[k % 3] and earns reward [1, 0, 0.5][(i + k) % 3]."""
    out, seen = [], {}
    for task in tasks:
        k = seen[task.task_id] = seen.get(task.task_id, -1) + 1
        i = int(task.task_id[1:])
        messages = [
            Message("system", "You are an agent. Tools: ls(path)."),
            Message("user", task.instruction),
            Message("assistant", '{"name": "ls", "arguments": {"path": "/f' + str(i) + '"}}'),
            Message("tool", f'["{FILES[(i + k) % 3]}", "{FILES[k % 3]}"]'),
            Message("assistant", f"It holds {FILES[k % 3]}" + " and more" * (3 * i * i)),  # unequal per rank
        ]
        reward = (1.0, 0.0, 0.5)[(i + k) % 3]
        out.append(Trajectory(task.task_id, task.env_id, task.instruction, messages, reward=reward,
                              trace=f"ls -> {FILES[k % 3]}", metadata={"generations": 1}))  # fmt: skip
    return out


def retrieve(task: str, task_id: str) -> list[str]:
    return [f"Task: list /z\nTrace: ls(/z) -> ok ({task_id} excluded)", "Task: read q\nTrace: read(q) -> ok"]


def solution(task_id: str) -> str:
    """A verified solution per task, for the text teachers (SDFT's)."""
    return f"ls(/f{task_id[1:]}) -> a.txt"


def run_case(method: str, ckpt: Path | None = None, stop_after: int | None = None, **overrides: Any) -> dict:
    """A run of SCHEDULE for `method`; returns its history and its trainable weights after the last step."""
    torch.manual_seed(0)
    random.seed(0)
    cfg = CFG.model_copy(update={"method": method, **overrides})
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a student that differs from the teacher, so there is something to distil
        for n, p in models.backbone.named_parameters():
            if ".student." in n and "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        if models.student is not models.backbone:  # full fine-tuning: the student is a copy of the backbone
            for p in models.student.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    strategy, objective = build_method(models, cfg, retrieve=retrieve, solutions=solution)
    step = TrainStep(models, ChatSerializer(tok, cfg.max_seq_len), strategy, objective, cfg)
    out = train_loop(step, TASKS, rollout, SCHEDULE, ckpt, stop_after=stop_after)
    # whole tensors (FSDP: gathered from every rank's shard), and how much of the student this rank holds
    weights = {n: full_tensor(p).detach().clone() for n, p in models.backbone.named_parameters() if p.requires_grad}
    weights.update({f"qformer.{n}": full_tensor(p).detach().clone()
                    for n, p in models.composer.qformer.named_parameters()})  # fmt: skip
    student = models.student_parameters()
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in student)
    if models.student is not models.backbone:
        weights.update({f"student.{n}": full_tensor(p).detach().clone() for n, p in models.student.named_parameters()})
    if models.ema_teacher:  # SDFT's EMA teacher of a fully fine-tuned student: the backbone's weights moved
        weights.update({f"teacher.{n}": full_tensor(t).detach().clone() for n, t, _ in models.teacher_student_pairs()})
    return {"history": out["history"], "generations": out["generations"], "weights": weights,
            "student_share": held / sum(p.numel() for p in student)}  # fmt: skip


FULL = {"student_mode": "full", "gradient_checkpointing": True}  # FSDP2 under several ranks (data_parallel=auto), with
# activation checkpointing of the FSDP units (the recompute runs inside their backward)


def main(out_dir: str, mode: str = "lora") -> None:
    from lopd_core.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    world = init_distributed()
    out = Path(out_dir)
    over = FULL if mode == "full" else {}
    results = {
        "world_size": world.world_size,
        "lopd": run_case("lopd", **over),
        "grpo": run_case("grpo", **over),
        **({"sdft": run_case("sdft", **over)} if mode == "full" else {}),  # its EMA teacher follows a sharded student
        # resume from a one-rank checkpoint written after step 2 (the test writes it before launching us)
        "lopd_resumed": run_case("lopd", ckpt=out / "from-one-rank", **over),
    }
    run_case("lopd", ckpt=out / "from-two-ranks", stop_after=2, **over)  # the test resumes it on one rank
    torch.save(results, out / f"rank{world.rank}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
