"""Peak memory of the fused, chunked loss head vs the naive full-logit computation, per objective.

Each case computes one objective's per-token quantities for T supervised positions and back-propagates the loss
it uses into whatever takes a gradient there:
- lopd:    top-M reverse KL + the privilege term (eq. 10-11); the teacher's hidden states take a gradient (the
           latent teacher, whose gradient reaches the composer);
- opsd:    top-M reverse KL with a frozen teacher (OPSD, SDFT, SDPO, Skill-SD);
- grpo:    the student's log-probabilities only (GRPO without its KL term);
- grpo_kl: log pS(a) with a gradient and the frozen reference's log pT(a) as a value (GRPO's k3 KL term).
The naive way materialises [T, V] logits for each side. Each configuration runs in a fresh subprocess; peak = the
block's peak above what was live once the inputs exist (`lopd_core.memory_model.PeakMemory`; CUDA: max allocated).
Where the naive head would not fit (--naive-limit-gb), its peak is printed as an estimate from the slope of its
measured peaks (labelled `naive_estimated`), never skipped silently. Goal: fused / naive <= 0.1 at 16k.

    python bench/loss_memory.py                                  # T in 1k..16k, lopd, SmolLM2's V and d
    python bench/loss_memory.py --cases lopd opsd grpo grpo_kl --lengths 4096 16384
Prints one JSON object, then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from lopd_core.memory_model import measuring_env

CASES = ("lopd", "opsd", "grpo", "grpo_kl")


def loss_of(kind: str, case: str, h_s, h_t, w, targets, adv, chunk: int):  # type: ignore[no-untyped-def]
    """The case's loss, by the fused head or the naive full-logit way."""
    from lopd_core import losses as L
    from lopd_core.loss_head import distill_head, token_logprobs

    if kind == "fused":
        if case == "grpo":
            return -(adv * token_logprobs(h_s, targets, w, chunk)).mean()
        out = distill_head(h_s, h_t, targets, w, w, top_m=20, chunk_size=chunk)
        if case == "grpo_kl":
            return -(adv * out.student_logp).mean() + (out.teacher_logp - out.student_logp).mean()
        return out.kl.mean() - (out.privilege.mean() if case == "lopd" else 0)  # lopd: one record, advantage 1
    ls = (h_s @ w.T).float()[None]
    s = L.token_logprob(ls, targets[None])[0]
    if case == "grpo":
        return -(adv * s).mean()
    lt = (h_t @ w.T).float()[None]
    if case == "grpo_kl":
        return -(adv * s).mean() + (L.token_logprob(lt, targets[None])[0] - s).mean()
    mask = torch.ones(1, targets.numel(), device=h_s.device)
    kl = L.topm_tail_reverse_kl(ls, lt, mask, 20)
    if case == "opsd":
        return kl
    return kl - L.batch_margin(L.token_privilege(lt, ls, targets[None]), torch.ones(1, device=h_s.device), mask)


def child(kind: str, case: str, T: int, V: int, d: int, chunk: int, dtype: str, device: str) -> None:
    from lopd_core.memory_model import PeakMemory

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h_s = torch.randn(T, d, dtype=dt, device=device, requires_grad=True)
    h_t = torch.randn(T, d, dtype=dt, device=device, requires_grad=case == "lopd")
    w = torch.randn(V, d, dtype=dt, device=device) / d**0.5
    targets = torch.randint(0, V, (T,), device=device)
    adv = torch.linspace(-1, 1, T, device=device)
    with PeakMemory(device) as measured:
        loss = loss_of(kind, case, h_s, h_t, w, targets, adv, chunk)
        loss.backward()
    print(json.dumps({"peak_bytes": measured.peak, "loss": float(loss)}))


def measure(kind: str, case: str, T: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, case, str(T), str(args.vocab), str(args.hidden), str(args.chunk),
           args.dtype, args.device]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=measuring_env())
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["killed"])[-1], "returncode": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope_estimate(points: list[tuple[int, float]], T: int) -> float | None:
    """The naive peak at T from a least-squares line through its measured (T, bytes), or None with < 2 points."""
    if len(points) < 2:
        return None
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my + b * (T - mx)


def run_case(case: str, args: argparse.Namespace) -> list[dict]:
    rows, naive_points = [], []
    for T in sorted(args.lengths):
        fused = measure("fused", case, T, args)
        sides = 1 if case == "grpo" else 2
        by_formula = 5 * sides * T * args.vocab * 4  # ~5 [T, V] fp32 buffers per side live at the naive peak
        estimate = slope_estimate(naive_points, T) or by_formula
        row: dict = {"case": case, "T": T, "fused_gb": round(fused.get("peak_bytes", float("nan")) / 1e9, 3)}
        if "error" in fused:
            row["fused_error"] = fused["error"]
        naive = measure("naive", case, T, args) if estimate / 1e9 <= args.naive_limit_gb else None
        if naive is not None and "peak_bytes" in naive:
            naive_points.append((T, naive["peak_bytes"]))
            same = abs(fused.get("loss", float("nan")) - naive["loss"]) <= 1e-3 * max(1.0, abs(naive["loss"]))
            row.update(naive_gb=round(naive["peak_bytes"] / 1e9, 3), naive_estimated=False, same_loss=same)
            naive_bytes = naive["peak_bytes"]
        else:
            naive_bytes = slope_estimate(naive_points, T)
            how = "slope of the measured naive peaks" if naive_bytes else "5 [T, V] fp32 buffers per side"
            naive_bytes = naive_bytes or by_formula
            why = naive["error"] if naive is not None else f"estimated over --naive-limit-gb {args.naive_limit_gb}"
            row.update(naive_gb=round(naive_bytes / 1e9, 3), naive_estimated=how, naive_not_run=why)
        if naive_bytes and "peak_bytes" in fused:
            row["ratio"] = round(fused["peak_bytes"] / naive_bytes, 4)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--cases", nargs="+", default=["lopd"], choices=CASES)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--naive-limit-gb",
        type=float,
        default=16.0,
        help="naive runs estimated above this are not run: their peak is estimated from the slope",
    )
    ap.add_argument("--child", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, case, T, V, d, chunk, dtype, device = args.child
        child(kind, case, int(T), int(V), int(d), int(chunk), dtype, device)
        return
    rows = [row for case in args.cases for row in run_case(case, args)]
    flat = {}
    for case in args.cases:  # the fused peak at the longest T over its peak at 4k (or the shortest): flat in T?
        mine = {r["T"]: r["fused_gb"] for r in rows if r["case"] == case}
        ref = 4096 if 4096 in mine else min(mine)
        flat[case] = round(mine[max(mine)] / mine[ref], 3) if mine[ref] else None
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    print(json.dumps({"bench": "loss_memory", "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk,
                      "dtype": args.dtype, "device": args.device, "rows": rows,
                      "fused_longest_over_4k": flat, "max_ratio": max(ratios) if ratios else None,
                      "goal_ratio_16k": 0.1, "goal_flat": 1.1}))  # fmt: skip
    print("\n| case | T | fused peak | naive peak | fused / naive |\n|---|---|---|---|---|")
    for r in rows:
        naive = f"{r['naive_gb']} GB" + (f" (estimated: {r['naive_estimated']})" if r["naive_estimated"] else "")
        print(f"| {r['case']} | {r['T']} | {r['fused_gb']} GB | {naive} | {r.get('ratio', '-')} |")


if __name__ == "__main__":
    main()
