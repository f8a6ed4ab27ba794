"""Step cost: one joint LOPD step vs the sum of its essential passes, each timed alone.

Essential passes: student forward+backward, teacher forward+backward (gradient into the latents), and the J
encoder passes of the composer forward+backward. The step adds the loss head, the anchor, clipping, one AdamW
update and the dual step. Goal: step / sum(passes) <= 1.15.

    python bench/step_cost.py --backbone tiny
    python bench/step_cost.py --backbone smollm2-135m --batch 2 --reps 3
Prints one JSON object per backbone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lopd_core.backbone import load_backbone
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.loss_head import distill_head
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer, aligned_action_positions
from lopd_core.step import LatentContext, LOPDObjective, TrainStep

FILLER = "The account ledger shows entries for groceries, rent, travel and utilities across the month. "


def make_trajectories(n: int, turns: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        msgs = [Message("system", "You are a tool-using agent. " + FILLER * 3), Message("user", f"Task {i}: " + FILLER)]
        for k in range(turns):
            msgs.append(Message("assistant", json.dumps({"name": "get_balance", "arguments": {"account": f"a{i}{k}"}})))
            msgs.append(Message("tool", FILLER * 2))
        msgs.append(Message("assistant", "Done. " + FILLER))
        out.append(Trajectory(f"t{i}", "bank", f"Task {i}", msgs, reward=float(i % 2)))
    return out


def retrieve(task: str, task_id: str) -> list[str]:
    return [f"Task: other {j}\nTrace: " + FILLER * 4 for j in range(3)]


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(backbone: str, batch: int, turns: int, reps: int, checkpointing: bool) -> dict:
    model, tok = load_backbone(backbone)
    cfg = LOPDConfig(gradient_checkpointing=checkpointing)
    models = build_models(model, tok, cfg)
    ser = ChatSerializer(tok)
    trajs = make_trajectories(batch, turns)
    step = TrainStep(models, ser, LatentContext(models.composer, retrieve, cfg), LOPDObjective(cfg), cfg)
    models.train()

    sb = ser.collate([ser.student_view(t) for t in trajs])
    tb = ser.collate([ser.teacher_view(t, c) for t, c in zip(trajs, step.strategy.contexts(trajs), strict=True)])
    rows, s_pos, t_pos, targets = aligned_action_positions(sb, tb)
    w_s, w_t = models.head_weights()
    tasks, retrieved = [t.task for t in trajs], [retrieve(t.task, t.task_id) for t in trajs]
    with torch.no_grad():
        h_s_const = models.student_hidden(sb)[rows, s_pos]
        lat_const = models.composer(tasks, retrieved)
        h_t_const = models.teacher_hidden(tb, lat_const)[rows, t_pos]

    def student_pass() -> None:
        h = models.student_hidden(sb)[rows, s_pos]
        distill_head(h, h_t_const, targets, w_s, w_t, cfg.top_m).kl.sum().backward()

    def teacher_pass() -> None:
        lat = lat_const.clone().requires_grad_(True)
        h = models.teacher_hidden(tb, lat)[rows, t_pos]
        out = distill_head(h_s_const, h, targets, w_s, w_t, cfg.top_m)
        (out.kl.sum() + out.teacher_logp.sum()).backward()

    def encoder_pass() -> None:
        models.composer(tasks, retrieved).sum().backward()

    passes = {"student_fwd_bwd": student_pass, "teacher_fwd_bwd": teacher_pass, "encoder_fwd_bwd": encoder_pass}
    parts = {name: timed(fn, reps) for name, fn in passes.items()}
    step_s = timed(lambda: step(trajs), reps)
    total = sum(parts.values())
    return {
        "bench": "step_cost",
        "backbone": backbone,
        "dtype": str(model.dtype),
        "device": str(model.device),
        "threads": torch.get_num_threads(),
        "batch": batch,
        "student_tokens": int(sb.attention_mask.sum()),
        "teacher_tokens": int(tb.attention_mask.sum()),
        "action_tokens": int(targets.numel()),
        "encoder_items": batch * cfg.n_retrieved,
        "gradient_checkpointing": checkpointing,
        "parts_s": {k: round(v, 4) for k, v in parts.items()},
        "sum_parts_s": round(total, 4),
        "step_s": round(step_s, 4),
        "ratio": round(step_s / total, 3),
        "goal_ratio": 1.15,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", action="append", help="tiny | smollm2-135m (repeatable)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for name in args.backbone or ["tiny"]:
        print(json.dumps(run(name, args.batch, args.turns, args.reps, args.checkpointing)), flush=True)


if __name__ == "__main__":
    main()
