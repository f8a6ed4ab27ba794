"""Peak memory of one LOPD step on the tiny backbone at the paper's sequence lengths, checkpointing on and off.

One trajectory of L tokens (many tool-call turns, so a quarter or so of it is supervised action tokens) goes
through one whole `TrainStep` (student pass, composer, teacher pass with the latents, fused loss head,
backward, AdamW, the dual step). Each (L, checkpointing) runs in a fresh subprocess; peak = the process's
resident-memory high-water mark (ru_maxrss) minus its value just before the step (on CUDA:
max_memory_allocated minus memory_allocated before the step). A bench, not a test: nothing asserts.

    python bench/step_memory.py                          # L = 2048, 8192, 16384; checkpointing off and on
    python bench/step_memory.py --lengths 2048 --device cuda
Prints one JSON object per run, then a Markdown table and the growth exponent of peak memory in L.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch

FILLER = "The account ledger shows entries for groceries, rent, travel and utilities across the month. "


def trajectory(n_turns: int):  # type: ignore[no-untyped-def]
    from lopd_core.conversation import Message, Trajectory

    msgs = [Message("system", "You are a tool-using agent."), Message("user", "Reconcile the ledger. " + FILLER)]
    for k in range(n_turns):
        msgs.append(Message("assistant", json.dumps({"name": "get_balance", "arguments": {"account": f"a{k}"}})))
        msgs.append(Message("tool", FILLER * 2))
    msgs.append(Message("assistant", "Done. " + FILLER))
    return Trajectory("t0", "bank", "Reconcile the ledger.", msgs, reward=1.0)


def child(length: int, checkpointing: bool, device: str) -> None:
    from lopd_core.backbone import load_backbone
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models
    from lopd_core.serialization import ChatSerializer
    from lopd_core.step import LatentContext, LOPDObjective, TrainStep

    torch.manual_seed(0)
    model, tok = load_backbone("tiny")
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 2 * length)
    model.to(device)
    cfg = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=128, max_seq_len=2 * length,
                     gradient_checkpointing=checkpointing)  # fmt: skip
    models = build_models(model, tok, cfg)
    ser = ChatSerializer(tok, cfg.max_seq_len)
    n10, n20 = (len(ser.student_view(trajectory(n)).input_ids) for n in (10, 20))
    turns = max(1, 10 + math.ceil((length - n10) / ((n20 - n10) / 10)))
    while len(ser.student_view(trajectory(turns)).input_ids) < length:  # the first L tokens or a few more
        turns += 1
    traj = trajectory(turns)
    view = ser.student_view(traj)
    retrieve = lambda task, task_id: [f"Task: other {j}\nTrace: " + FILLER * 4 for j in range(3)]  # noqa: E731
    step = TrainStep(models, ser, LatentContext(models.composer, retrieve, cfg), LOPDObjective(cfg), cfg)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    metrics = step([traj])
    seconds = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"length": length, "student_tokens": len(view.input_ids), "action_tokens": view.n_action_tokens,
                      "gradient_checkpointing": checkpointing, "peak_mb": round(peak / 2**20, 1),
                      "step_s": round(seconds, 2), "updated": metrics["updated"], "device": device}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        child(int(args.child[0]), args.child[1] == "on", args.device)
        return
    rows = []
    for length in args.lengths:
        for ckpt in ("off", "on"):
            cmd = [sys.executable, __file__, "--device", args.device, "--child", str(length), ckpt]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(out, flush=True)
            rows.append(json.loads(out))
    print("\n| L (student tokens) | action tokens | peak, checkpointing off | peak, on | on / off |")
    print("|---|---|---|---|---|")
    by = {(r["length"], r["gradient_checkpointing"]): r for r in rows}
    for length in args.lengths:
        off, on = by[(length, False)], by[(length, True)]
        print(f"| {length} ({off['student_tokens']}) | {off['action_tokens']} | {off['peak_mb']} MB | "
              f"{on['peak_mb']} MB | {on['peak_mb'] / off['peak_mb']:.2f} |")  # fmt: skip
    if len(args.lengths) > 1:
        first, last = args.lengths[0], args.lengths[-1]
        for ckpt in (False, True):
            a, b = by[(first, ckpt)]["peak_mb"], by[(last, ckpt)]["peak_mb"]
            slope = math.log(b / a) / math.log(last / first)
            print(f"checkpointing {'on' if ckpt else 'off'}: peak grows as L^{slope:.2f} from {first} to {last}")


if __name__ == "__main__":
    main()
