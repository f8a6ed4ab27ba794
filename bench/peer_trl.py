"""Our train step beside TRL's, on the same model and batch: time per step and peak memory, as ratios in one run.

    python bench/peer_trl.py                                   # SmolLM2-135M, 4 trajectories of ~512 tokens, CPU
    python bench/peer_trl.py --backbone tiny --steps 2         # a smoke run (tests/core/test_peer_trl.py)

Two pairs, each side in a fresh subprocess, generation excluded on both sides (the same fixed trajectories):
- distillation: our OPSD step (`lopd_core.step.TrainStep`, method opsd: a frozen teacher that reads a solution,
  top-M reverse KL through the fused head) against TRL's `DistillationTrainer` step (its on-policy distillation:
  a frozen teacher model on the same sequence, its weights a perturbed copy of the student's, the generalised
  JSD at beta = 1, reverse KL, over the whole
  vocabulary, chunked);
- GRPO: our GRPO step against TRL's `GRPOTrainer` step (its default loss, no KL term: beta = 0 on both sides).

Alike on both sides: the backbone, its dtype, full fine-tuning (every weight trains; the distillation teacher is a
frozen copy), the token sequences (one group of trajectories; the loss on the assistant's tokens only: TRL's
`tool_mask` leaves the tool outputs out as our action mask does), the rewards, one optimizer update per step,
AdamW, one thread. Not alike, by design of each library: our OPSD teacher reads ~100 more tokens (the solution), our
loss is top-M (M = 20) plus a tail bucket where TRL's is the full vocabulary; the TRL step runs through
`Trainer.training_step` (its `_prepare_inputs` returns the fixed batch instead of generating) and then its
optimizer. Time per step is the median after the first; peak memory is what the steps add
(`lopd_core.memory_model.PeakMemory`). TRL is in the `bench` extra (`pip install -e .[bench]`). Prints one JSON
object, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lopd_core.memory_model import measuring_env

SIDES = ("ours-distill", "trl-distill", "ours-grpo", "trl-grpo")
REWARDS = (1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0)


def batch(tok, records: int, length: int):  # type: ignore[no-untyped-def]
    """`records` trajectories of one task, about `length` tokens each (a few turns apart), with alternating rewards."""
    from bench.step_memory import trajectory
    from lopd_core.serialization import ChatSerializer

    ser = ChatSerializer(tok, 1 << 16)
    turns = 1
    while len(ser.student_view(trajectory(turns)).input_ids) < length:
        turns += 1
    trajs = []
    for i in range(records):
        t = trajectory(max(1, turns - i))
        t.reward = REWARDS[i % len(REWARDS)]
        trajs.append(t)
    return trajs, ser


def trl_inputs(trajs, ser, tok, with_advantages: bool) -> dict:  # type: ignore[no-untyped-def]
    """The trajectories as TRL's trainers take a generated batch: left-padded prompts (up to the first assistant
    token), right-padded completions, `tool_mask` 1 on the assistant's tokens (the loss's tokens, as our action
    mask), GRPO's group-normalised advantages."""
    views = [ser.student_view(t) for t in trajs]
    firsts = [int(torch.as_tensor(v.action_mask).nonzero()[0]) for v in views]
    prompts = [list(v.input_ids[:f]) for v, f in zip(views, firsts, strict=True)]
    completions = [list(v.input_ids[f:]) for v, f in zip(views, firsts, strict=True)]
    masks = [list(torch.as_tensor(v.action_mask)[f:].tolist()) for v, f in zip(views, firsts, strict=True)]
    pad = tok.pad_token_id
    p_len, c_len = max(map(len, prompts)), max(map(len, completions))
    out = {
        "prompt_ids": torch.tensor([[pad] * (p_len - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (p_len - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [pad] * (c_len - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (c_len - len(c)) for c in completions]),
        "tool_mask": torch.tensor([[int(x) for x in m] + [0] * (c_len - len(m)) for m in masks]),
    }
    out["num_items_in_batch"] = (out["completion_mask"] * out["tool_mask"]).sum()
    if with_advantages:
        r = torch.tensor([t.reward for t in trajs])
        out["advantages"] = (r - r.mean()) / (r.std() + 1e-4)  # TRL's default: scale_rewards="group"
    return out


def run_ours(method: str, backbone: str, trajs, ser, model, tok, steps: int):  # type: ignore[no-untyped-def]
    from bench.step_memory import FILLER
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models
    from lopd_core.step import TrainStep, build_method

    cfg = LOPDConfig(method=method, student_mode="full", max_seq_len=1 << 16, gradient_checkpointing=False,
                     student_lr=1e-6)  # fmt: skip
    models = build_models(model, tok, cfg)
    strategy, objective = build_method(models, cfg, solutions=lambda task_id: FILLER * 4)
    step = TrainStep(models, ser, strategy, objective, cfg)
    return lambda: step(trajs)


def run_trl(kind: str, trajs, ser, model, tok, steps: int):  # type: ignore[no-untyped-def]
    import copy

    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer, GRPOConfig, GRPOTrainer

    inputs = trl_inputs(trajs, ser, tok, with_advantages=kind == "grpo")
    common = {"output_dir": tempfile.mkdtemp(prefix="peer-trl-"), "use_cpu": True, "report_to": [], "bf16": False,
              "learning_rate": 1e-6, "per_device_train_batch_size": len(trajs), "save_strategy": "no",
              "logging_strategy": "no", "gradient_checkpointing": False}  # fmt: skip
    data = Dataset.from_dict({"prompt": ["x"] * len(trajs)})
    tok.padding_side = "left"

    class Fixed:  # the trainer's step on our batch: no generation
        def _prepare_inputs(self, generation_batch):  # type: ignore[no-untyped-def]
            return inputs

    if kind == "grpo":
        trainer_cls = type("FixedGRPO", (Fixed, GRPOTrainer), {})
        args = GRPOConfig(**common, num_generations=len(trajs), beta=0.0)
        trainer = trainer_cls(model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=args, train_dataset=data, processing_class=tok)  # fmt: skip
    else:
        trainer_cls = type("FixedDistillation", (Fixed, DistillationTrainer), {})
        args = DistillationConfig(**common, beta=1.0)
        teacher = copy.deepcopy(model).eval()
        with torch.no_grad():  # a teacher that differs from the student (ours differs by what it reads)
            for p in teacher.parameters():
                p.add_(0.01 * torch.randn_like(p))
        trainer = trainer_cls(model=model, teacher_model=teacher, args=args, train_dataset=data, processing_class=tok)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train sets before its first step
    trainer.model.train()

    def one_step() -> dict:
        loss = trainer.training_step(trainer.model, {}, None)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return {"loss": float(loss)}

    return one_step


def child(side: str, backbone: str, records: int, length: int, steps: int) -> None:
    from lopd_core.backbone import load_backbone
    from lopd_core.memory_model import PeakMemory

    torch.manual_seed(0)
    model, tok = load_backbone(backbone)
    trajs, ser = batch(tok, records, length)
    who, kind = side.split("-")
    if who == "ours":
        one_step = run_ours("opsd" if kind == "distill" else "grpo", backbone, trajs, ser, model, tok, steps)
    else:
        one_step = run_trl(kind, trajs, ser, model, tok, steps)
    times = []
    with PeakMemory("cpu") as measured:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = one_step()
            times.append(time.perf_counter() - t0)
    tokens = sum(len(ser.student_view(t).input_ids) for t in trajs)
    print(json.dumps({"side": side, "backbone": backbone, "records": records, "tokens": tokens,
                      "step_s": round(statistics.median(times[1:] or times), 3), "first_step_s": round(times[0], 3),
                      "peak_mb": round(measured.peak / 2**20, 1), "steps": steps,
                      "last_loss": float(out["loss"])}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--records", type=int, default=4)
    ap.add_argument("--length", type=int, default=512, help="tokens per trajectory (about)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        return child(args.child, args.backbone, args.records, args.length, args.steps)
    rows = {}
    for side in args.sides:
        cmd = [sys.executable, __file__, "--child", side, "--backbone", args.backbone, "--records", str(args.records),
               "--length", str(args.length), "--steps", str(args.steps)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=measuring_env())
        if proc.returncode != 0:
            raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
        rows[side] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(json.dumps(rows[side]), file=sys.stderr, flush=True)
    ratios = {}
    for kind in ("distill", "grpo"):
        ours, theirs = rows.get(f"ours-{kind}"), rows.get(f"trl-{kind}")
        if ours and theirs:
            ratios[kind] = {"time_ours_over_trl": round(ours["step_s"] / theirs["step_s"], 3),
                            "memory_ours_over_trl": round(ours["peak_mb"] / theirs["peak_mb"], 3)}  # fmt: skip
    import trl

    print(json.dumps({"bench": "peer_trl", "trl": trl.__version__, "backbone": args.backbone, "rows": rows,
                      "ratios": ratios}))  # fmt: skip
    print("\n| step | ours: s / step | TRL: s / step | time ours / TRL | ours: peak | TRL: peak | memory ours / TRL |")
    print("|---|---|---|---|---|---|---|")
    for kind, r in ratios.items():
        o, t = rows[f"ours-{kind}"], rows[f"trl-{kind}"]
        print(f"| {kind} | {o['step_s']} | {t['step_s']} | {r['time_ours_over_trl']} | {o['peak_mb']:.0f} MB | "
              f"{t['peak_mb']:.0f} MB | {r['memory_ours_over_trl']} |")  # fmt: skip


if __name__ == "__main__":
    main()
