"""Peak memory of the fused, chunked loss head vs the naive full-logit computation.

Both compute the same quantities for T supervised positions (top-M reverse KL, log pT(a), log pS(a)) and
back-propagate into the hidden states and the latents' side; the naive way materialises [T, V] logits for
student and teacher. Each configuration runs in a fresh subprocess; peak = the process's resident-memory
high-water mark (ru_maxrss) minus its value once the inputs exist. Goal: fused / naive <= 0.25.

    python bench/loss_memory.py                      # T in 1k..16k, V = 49152, d = 576 (SmolLM2's sizes)
    python bench/loss_memory.py --lengths 1024 4096  # a quicker look
Prints one JSON object. A naive run that exceeds --naive-limit-gb is not attempted (it would not fit).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch


def child(kind: str, T: int, V: int, d: int, chunk: int, dtype: str, device: str) -> None:
    from lopd_core import losses as L
    from lopd_core.loss_head import distill_head

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h_s = torch.randn(T, d, dtype=dt, device=device, requires_grad=True)
    h_t = torch.randn(T, d, dtype=dt, device=device, requires_grad=True)
    w = torch.randn(V, d, dtype=dt, device=device) / d**0.5
    targets = torch.randint(0, V, (T,), device=device)
    adv = torch.ones(T, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "fused":
        out = distill_head(h_s, h_t, targets, w, w, top_m=20, chunk_size=chunk)
        loss = out.kl.mean() - (adv * out.privilege).mean()
    else:
        ls, lt = (h_s @ w.T).float()[None], (h_t @ w.T).float()[None]
        mask = torch.ones(1, T, device=device)
        loss = L.topm_tail_reverse_kl(ls, lt, mask, 20) - L.batch_margin(
            L.token_privilege(lt, ls, targets[None]), adv[:1], mask
        )
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    print(json.dumps({"peak_bytes": peak, "loss": float(loss)}))


def measure(kind: str, T: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(T), str(args.vocab), str(args.hidden), str(args.chunk),
           args.dtype, args.device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--naive-limit-gb", type=float, default=16.0, help="skip naive runs estimated above this")
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, T, V, d, chunk, dtype, device = args.child
        child(kind, int(T), int(V), int(d), int(chunk), dtype, device)
        return
    rows = []
    for T in args.lengths:
        fused = measure("fused", T, args)
        est_naive_gb = 10 * T * args.vocab * 4 / 1e9  # ~10 [T, V] fp32 buffers live at the peak
        fits = est_naive_gb <= args.naive_limit_gb
        naive = measure("naive", T, args) if fits else {"skipped": f"estimated ~{est_naive_gb:.0f} GB"}
        row = {"T": T, "fused_gb": round(fused.get("peak_bytes", float("nan")) / 1e9, 3)}
        if "peak_bytes" in naive:
            row["naive_gb"] = round(naive["peak_bytes"] / 1e9, 3)
            row["ratio"] = round(fused["peak_bytes"] / naive["peak_bytes"], 4)
            row["same_loss"] = abs(fused["loss"] - naive["loss"]) <= 1e-3 * max(1.0, abs(naive["loss"]))
        else:
            row["naive"] = naive
        rows.append(row)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(json.dumps({"bench": "loss_memory", "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk,
                      "dtype": args.dtype, "device": args.device, "rows": rows,
                      "max_ratio": max(ratios) if ratios else None, "goal_ratio": 0.25}))  # fmt: skip


if __name__ == "__main__":
    main()
