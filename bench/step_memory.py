"""Peak memory of one whole `TrainStep` at long sequence lengths, measured beside the memory model's prediction.

One trajectory of L tokens (many tool-call turns; a quarter or so of it is action tokens) goes through one
`TrainStep` of the chosen method: student pass, the method's teacher (LOPD: composer + latent teacher with a
gradient into the composer; OPSD: a frozen teacher reading a solution; GRPO: none), the fused loss head, backward,
AdamW (fused where the device has it) and the method's state update. Each (method, L, checkpointing, student)
runs in a fresh subprocess; peak = what the step adds at its peak (`lopd_core.memory_model.PeakMemory`: the
resident high-water mark, reset before the step, minus the resident set then; CUDA: max_memory_allocated minus
memory_allocated before the step). Beside each run the
bench prints what `lopd_core.memory_model.predict_step` predicts for the same shape, and the ratio.

    python bench/step_memory.py --backbone smollm2-135m --methods lopd opsd grpo --lengths 2048 4096
    python bench/step_memory.py --backbone tiny                      # the tiny backbone, L = 2k, 8k, 16k
    python bench/step_memory.py --from-json runs.jsonl               # the table again from saved rows
    python bench/step_memory.py --backbone smollm2-135m --device cuda --dtype bfloat16 --lengths 2048 8192 16384
    python bench/step_memory.py --backbone random:Qwen3-4B --device cuda --dtype bfloat16 --steps 3  # no weights
    python bench/step_memory.py --backbone random:SmolLM2-135M --student full --fsdp --device cuda --steps 3

`--steps N` runs N steps on the same trajectory: the peak is over all of them, `step_s` the median of the steps
after the first (the first pays for allocations and kernel choice: `first_step_s`), `tokens_per_s` the student
tokens over `step_s`. `--fsdp` (full fine-tuning) runs the step under a one-rank process group, so the data-parallel
code shards the student with FSDP2 (`lopd.data_parallel=fsdp`) as it does over many ranks; its `loss` and
`grad_norm_student` match the run without `--fsdp` when sharding is right.
Prints one JSON object per run (also appended to --out), then a Markdown table. A bench: nothing asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lopd_core.memory_model import measuring_env

FILLER = "The account ledger shows entries for groceries, rent, travel and utilities across the month. "


def trajectory(n_turns: int):  # type: ignore[no-untyped-def]
    from lopd_core.conversation import Message, Trajectory

    msgs = [Message("system", "You are a tool-using agent."), Message("user", "Reconcile the ledger. " + FILLER)]
    for k in range(n_turns):
        msgs.append(Message("assistant", json.dumps({"name": "get_balance", "arguments": {"account": f"a{k}"}})))
        msgs.append(Message("tool", FILLER * 2))
    msgs.append(Message("assistant", "Done. " + FILLER))
    return Trajectory("t0", "bank", "Reconcile the ledger.", msgs, reward=1.0)


def child(
    backbone: str, method: str, length: int, checkpointing: bool, student: str, device: str,
    chunk: int = 1024, dtype: str = "float32", steps: int = 1, fsdp: bool = False,
) -> None:  # fmt: skip
    from lopd_core.backbone import load_backbone
    from lopd_core.config import LOPDConfig
    from lopd_core.memory_model import PeakMemory, StepShape, predict_step, shape_of
    from lopd_core.methods import build_method
    from lopd_core.models import build_models
    from lopd_core.serialization import ChatSerializer
    from lopd_core.step import TrainStep

    if fsdp:  # a process group of one rank: the step's data-parallel path, FSDP2 included
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device) if backbone.startswith("random:") else contextlib.nullcontext():  # random: built there
        model, tok = load_backbone(backbone, getattr(torch, dtype))
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, 2 * length)
    model.to(device)
    cfg = LOPDConfig(method=method, n_queries=4, qformer_layers=2, encoder_max_tokens=128,
                     max_seq_len=2 * length + 2048,
                     gradient_checkpointing=checkpointing, student_mode=student, head_chunk_size=chunk,
                     data_parallel="fsdp" if fsdp else "auto")  # fmt: skip
    models = build_models(model, tok, cfg)
    ser = ChatSerializer(tok, cfg.max_seq_len)
    n10, n20 = (len(ser.student_view(trajectory(n)).input_ids) for n in (10, 20))
    turns = max(1, 10 + math.ceil((length - n10) / ((n20 - n10) / 10)))
    while len(ser.student_view(trajectory(turns)).input_ids) < length:  # the first L tokens or a few more
        turns += 1
    traj = trajectory(turns)
    view = ser.student_view(traj)
    experience = "Task: other {j}\nTrace: " + FILLER * 4
    retrieve = lambda task, task_id: [experience.format(j=j) for j in range(cfg.n_retrieved)]  # noqa: E731
    strategy, objective = build_method(
        models, cfg, retrieve=retrieve, solutions=lambda task_id: FILLER * 4, skills=lambda task: [FILLER]
    )
    framed = models.composer.frame([traj.task], [retrieve(traj.task, traj.task_id)])  # the encoder's padded batch
    encoder_tokens = len(framed) * min(cfg.encoder_max_tokens, max(len(tok(t)["input_ids"]) for t in framed))
    step = TrainStep(models, ser, strategy, objective, cfg)
    shape = StepShape(
        backbone=shape_of(model), method=method, tokens=len(view.input_ids), action_tokens=view.n_action_tokens,
        latent_tokens=cfg.n_latents, encoder_tokens=encoder_tokens,
        context_tokens=len(ser.view(traj.messages, strategy.contexts([traj])[0]).input_ids) - len(view.input_ids)
        if method != "grpo" else 0,
        student=student, trainable=sum(p.numel() for p in models.student_parameters()),
        composer=sum(p.numel() for p in models.composer_parameters()), checkpointing=checkpointing,
        dtype_bytes=next(model.parameters()).element_size(), chunk_size=cfg.head_chunk_size, device=device,
    )  # fmt: skip
    times = []
    with PeakMemory(device) as measured:
        for _ in range(steps):
            t0 = time.perf_counter()
            metrics = step([traj])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    if not metrics["updated"]:
        raise SystemExit(f"the step made no update (records {metrics.get('n_records')}, over-length "
                         f"{metrics.get('n_overlength')}): nothing was measured")  # fmt: skip
    seconds, peak = statistics.median(times[1:] or times), measured.peak
    predicted = predict_step(shape)
    sharded = type(next(models.student.parameters())).__name__ == "DTensor"
    print(json.dumps({"backbone": backbone, "method": method, "length": length, "student_tokens": len(view.input_ids),
                      "action_tokens": view.n_action_tokens, "gradient_checkpointing": checkpointing,
                      "student": student, "chunk": chunk, "dtype": dtype, "peak_mb": round(peak / 2**20, 1),
                      "predicted_mb": round(predicted.step_peak_excluding_weights / 2**20, 1),
                      "shape": shape.as_dict(), "step_s": round(seconds, 3), "first_step_s": round(times[0], 3),
                      "steps": steps, "tokens_per_s": round(len(view.input_ids) / seconds, 1),
                      "updated": metrics["updated"], "loss": metrics.get("loss"),
                      "grad_norm_student": metrics.get("grad_norm_student"), "fsdp": fsdp, "sharded": sharded,
                      "device": device}))  # fmt: skip


def predicted_mb(row: dict) -> float:
    """The current memory model's prediction for a saved row's shape (MiB, what the step adds)."""
    from lopd_core.memory_model import BackboneShape, StepShape, predict_step

    shape = dict(row["shape"], backbone=BackboneShape(**row["shape"]["backbone"]))
    return predict_step(StepShape(**shape)).step_peak_excluding_weights / 2**20


def table(rows: list[dict]) -> None:
    for r in rows:
        if "shape" in r:
            r["predicted_mb"] = round(predicted_mb(r), 1)
    print("\n| backbone | method | student | L (student tokens) | action tokens | checkpointing | measured peak | "
          "model | model / measured |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        if r.get("chunk", 1024) != 1024:
            r = dict(r, method=f"{r['method']} (head chunk {r['chunk']})")
        if r.get("fsdp"):
            r = dict(r, method=f"{r['method']} (FSDP2, one rank)")
        if "error" in r:
            print(f"| {r['backbone']} | {r['method']} | {r['student']} | {r['length']} | - | "
                  f"{'on' if r['gradient_checkpointing'] else 'off'} | {r['error']} | - | - |")  # fmt: skip
            continue
        print(f"| {r['backbone']} | {r['method']} | {r['student']} | {r['length']} ({r['student_tokens']}) | "
              f"{r['action_tokens']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['peak_mb']:.0f} MB | "
              f"{r['predicted_mb']:.0f} MB | {r['predicted_mb'] / r['peak_mb']:.2f} |")  # fmt: skip
    errors = [abs(r["predicted_mb"] / r["peak_mb"] - 1) for r in rows if "peak_mb" in r]
    if errors:
        print(f"\nthe model is within {100 * max(errors):.1f}% of every measured point ({len(errors)} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backbone", default="tiny")
    ap.add_argument("--methods", nargs="+", default=["lopd"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--student", default="lora", choices=["lora", "full"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the backbone's dtype (bfloat16 on a GPU)")
    ap.add_argument("--chunk", type=int, default=1024, help="lopd.head_chunk_size")
    ap.add_argument("--steps", type=int, default=1, help="steps per run (time: the median after the first)")
    ap.add_argument("--fsdp", action="store_true", help="a one-rank process group: FSDP2 (needs --student full)")
    ap.add_argument("--out", type=Path, help="append each run's JSON row to this file")
    ap.add_argument("--from-json", type=Path, help="print the table of saved rows (one JSON per line), run nothing")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        method, length, ckpt, student, backbone, *rest = args.child
        chunk, dtype = (int(rest[0]), rest[1]) if rest else (1024, "float32")
        child(backbone, method, int(length), ckpt == "on", student, args.device, chunk, dtype, args.steps, args.fsdp)
        return
    if args.fsdp and args.student != "full":
        ap.error("--fsdp shards a fully fine-tuned student: add --student full")
    if args.from_json:
        rows = [json.loads(line) for line in args.from_json.read_text().splitlines() if line.strip()]
        return table(rows)
    rows = []
    for method in args.methods:
        for length in args.lengths:
            for ckpt in args.checkpointing:
                cmd = [sys.executable, __file__, "--device", args.device, "--steps", str(args.steps),
                       *(["--fsdp"] if args.fsdp else []), "--child", method, str(length), ckpt,
                       args.student, args.backbone, str(args.chunk), args.dtype]  # fmt: skip
                proc = subprocess.run(cmd, capture_output=True, text=True, env=measuring_env())
                if proc.returncode == 0:
                    row = json.loads(proc.stdout.strip().splitlines()[-1])
                else:  # e.g. killed for memory: said, not skipped
                    tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
                    row = {
                        "backbone": args.backbone,
                        "method": method,
                        "length": length,
                        "student": args.student,
                        "gradient_checkpointing": ckpt == "on",
                        "chunk": args.chunk,
                        "error": tail[:100],
                    }
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                rows.append(row)
    table(rows)


if __name__ == "__main__":
    main()
