"""End-to-end look at the method core on a real backbone: composer, latent teacher, joint steps, dual ascent.

    python -m lopd_core.demo --backbone smollm2-135m --steps 4
    python -m lopd_core.demo --backbone tiny

Builds the models (student LoRA, encoder LoRA, QFormer, frozen teacher on one backbone), makes a small batch
of tool-use trajectories with mixed rewards, retrieves other tasks' successes as the composer's input (never
the task's own), runs joint LOPD steps and prints the per-step metrics.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tqdm import tqdm

from lopd_core.backbone import load_backbone
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.step import LatentContext, LOPDObjective, TrainStep

SYSTEM = (
    'You are a banking assistant. Call tools with a JSON object {"name": ..., "arguments": {...}}.\n'
    "Tools: get_balance(account), transfer(source, target, amount)."
)
EPISODES = [  # (task id, task, actions and observations, reward)
    ("bank-1", "Move 20 from checking to savings.", ['{"name": "transfer", "arguments": {"source": "checking", '
     '"target": "savings", "amount": 20}}', "ok", "Transferred 20 to savings."], 1.0),
    ("bank-2", "What is the balance of savings?", ['{"name": "get_balance", "arguments": {"account": "savings"}}',
     "120", "Savings holds 120."], 1.0),
    ("bank-3", "Send 5 from savings to checking.", ['{"name": "transfer", "arguments": {"source": "checking", '
     '"target": "savings", "amount": 5}}', "ok", "Done."], 0.0),
    ("bank-4", "Check checking, then move 10 of it to savings.", ['{"name": "get_balance", "arguments": '
     '{"account": "checking"}}', "50", "Checking holds 50."], 0.5),
]  # fmt: skip


def trajectory(task_id: str, task: str, turns: list[str], reward: float) -> Trajectory:
    messages = [Message("system", SYSTEM), Message("user", task)]
    for i, text in enumerate(turns):
        messages.append(Message("assistant" if i % 2 == 0 else "tool", text))
    return Trajectory(task_id, "bank", task, messages, reward=reward, trace=" -> ".join(turns[:-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--config", help="a LOPDConfig YAML file (defaults: the paper's)")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    t0 = time.time()
    model, tok = load_backbone(args.backbone)
    cfg = LOPDConfig.from_yaml(args.config) if args.config else LOPDConfig(student_lr=1e-4, composer_lr=1e-4)
    models = build_models(model, tok, cfg)
    n_student = sum(p.numel() for p in models.student_parameters())
    n_composer = sum(p.numel() for p in models.composer_parameters())
    print(f"backbone {args.backbone}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
          f"(frozen), student LoRA {n_student / 1e6:.2f}M, composer {n_composer / 1e6:.2f}M "
          f"[loaded in {time.time() - t0:.1f} s]")  # fmt: skip

    batch = [trajectory(*e) for e in EPISODES]
    bank = [t for t in batch if t.reward >= 1.0]  # successes only

    def retrieve(task: str, task_id: str) -> list[str]:
        return [f"{t.task}\n{t.trace}" for t in bank if t.task_id != task_id][: cfg.n_retrieved]

    ser = ChatSerializer(tok, max_seq_len=cfg.max_seq_len)
    step = TrainStep(models, ser, LatentContext(models.composer, retrieve, cfg), LOPDObjective(cfg), cfg)
    print(f"teacher context: {cfg.n_retrieved} retrieved x {cfg.n_queries} queries = {cfg.n_latents} latent "
          f"positions; objective distill + beta (m - Delta) + lambda anchor with m={cfg.margin_target}, "
          f"lambda={cfg.anchor_weight}, eta_beta={cfg.dual_lr}")  # fmt: skip
    keys = ["distill_kl", "margin", "beta", "anchor", "privilege_mean", "teacher_topm_mass", "n_action_tokens",
            "step_seconds"]  # fmt: skip
    rows = []
    for _ in tqdm(range(args.steps), desc="LOPD steps", unit="step"):
        rows.append(step(batch))
    print("\nstep " + " ".join(f"{k:>17}" for k in keys))
    for i, row in enumerate(rows):
        print(f"{i:>4} " + " ".join(f"{row[k]:>17.5g}" for k in keys))
    print(json.dumps({"backbone": args.backbone, "steps": args.steps, "final": {k: rows[-1][k] for k in keys}}))


if __name__ == "__main__":
    main()
