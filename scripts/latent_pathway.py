"""The latent pathway alone (issue 40, DESIGN.md §11): can the composer (and the teacher's reader) learn to make the
teacher reproduce a code that only the retrieved experiences hold?

Each setting is the cold-start stage (components.cold_start) on a finished run's warm start, collected successes and
bank, with `cold.relabel_codes` on (every record and its documents rewritten to one random code: the prompt no longer
predicts it), probed every `--probe-every` steps by the latent-dependence probe on validation tasks
(lopd_core.latent_probe). Prints one JSON line per setting (its curve: step, (a) own, (b) other, (c) none,
(d) rewritten, the latents' relative change, NLL) and a markdown table of the last probe.

    python scripts/latent_pathway.py --run-dir runs/pw                        # every setting of SETTINGS
    python scripts/latent_pathway.py --run-dir runs/pw --only study,no-reader --steps 600
    python scripts/latent_pathway.py --run-dir runs/pw --set lopd.n_queries=16 --set cold_start.lr=3e-3

The run directory needs the sft, collect and bank stages of configs/study-rules.yaml (e.g. `lopd study
configs/study-rules.yaml -s 'methods=[grpo]' -s 'seeds=[0]' -s budget=32 -s run_dir=runs/pw`); nothing here reads
held-out tasks. Each setting's stage runs in `<run-dir>/pathway/<name>`, logged to that run's MLflow store.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> pipeline overrides (lopd.*, cold_start.*) on top of configs/study-rules.yaml with environment-scoped
# retrieval and `cold_start.relabel_codes: alternatives`
SETTINGS: dict[str, list[str]] = {
    "study": [],  # the study's composer (K 4, 2 layers, 128 encoder tokens, latents = projected queries) and reader
    "no-relabel": ["cold_start.relabel_codes=none"],  # the memorisation trap: the code predictable from the prompt
    "pool": ["cold_start.relabel_codes=pool"],  # codes drawn from all 24
    "no-reader": ["lopd.teacher_reader=false"],
    "layer1": ["lopd.encoder_layer=1"],  # the QFormer reads the first decoder layer's output
    "tokens": ["lopd.latent_values=tokens"],  # latents: mixtures of the experience's own token embeddings
    "tokens-k16": ["lopd.latent_values=tokens", "lopd.n_queries=16"],
    "tokens-k16-surprising": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
    ],
    "tokens-k16-surprising-clip3": [  # the QFormer clipped at the LoRA's 3.0, not the reference config's 30
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "cold_start.grad_clip_qformer=3.0",
    ],
    "tokens-k16-rule": ["lopd.latent_values=tokens", "lopd.n_queries=16", "cold_start.token_selection=rule"],
    "tokens-k16-surprising-no-reader": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "lopd.teacher_reader=false",
    ],
    "tokens-k16-surprising-pool": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "cold_start.relabel_codes=pool",
    ],
    "tokens-k16-surprising-no-relabel": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "cold_start.relabel_codes=none",
    ],
    "surprising": ["cold_start.token_selection=surprising"],  # the study's composer with the surprising tokens
    # the study's reading setting with the left-out tokens weighted (the reader drifted there: privilege_other -0.31)
    "tokens-k16-surprising-clip3-w0.1": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "cold_start.grad_clip_qformer=3.0",
        "cold_start.unselected_weight=0.1",
    ],
    "tokens-k16-surprising-clip3-w0.03": [
        "lopd.latent_values=tokens",
        "lopd.n_queries=16",
        "cold_start.token_selection=surprising",
        "cold_start.grad_clip_qformer=3.0",
        "cold_start.unselected_weight=0.03",
    ],
}


def spec_for(run_dir: Path, name: str, overrides: list[str], steps: int, probe_every: int, seed: int = 0):
    """The cold-start stage of configs/study-rules.yaml (seed `seed`) with the setting's pipeline overrides."""
    from components.cold_start import ColdStartSpec
    from flows.config import load_config

    base = ["lopd.retrieval_scope=environment", "cold_start.relabel_codes=alternatives",
            f"cold_start.steps={steps}", f"cold_start.probe_every={probe_every}"]  # fmt: skip
    cfg = load_config(ROOT / "configs" / "study-rules.yaml", [f"run_dir={run_dir}", *base, *overrides])
    return ColdStartSpec(
        run_dir=str(run_dir / "pathway" / f"{name}-seed{seed}"), artifact_root=str(run_dir / "artifacts"),
        tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}", backbone=cfg.backbone, warm_start=str(run_dir),
        suite=cfg.suite, dataset=str(run_dir), bank_snapshot=str(run_dir), lopd=cfg.method_config("lopd", seed),
        cold=cfg.cold_start, success_threshold=cfg.success_threshold, validation_fraction=cfg.validation_fraction,
        difficulties=cfg.train.difficulties, threads=2, tags={"lopd.pathway": name},
    )  # fmt: skip


def curve(spec, run_id: str) -> list[dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(spec.tracking_uri)
    keys = (
        "probe_own",
        "probe_other",
        "probe_none",
        "probe_rewritten",
        "probe_change_other",
        "probe_change_none",
        "probe_drift",
        "probe_n",
        "probe_skipped",
    )
    rows: dict[int, dict[str, float]] = {}
    for key in keys:
        for m in client.get_metric_history(run_id, f"cold_start/{key}"):
            rows.setdefault(m.step, {"step": m.step})[key.removeprefix("probe_")] = round(m.value, 4)
    nll = {m.step: m.value for m in client.get_metric_history(run_id, "cold_start/nll")}
    for step, row in rows.items():
        row["nll"] = round(nll.get(step - 1, float("nan")), 4)
    return [rows[s] for s in sorted(rows)]


def main() -> int:
    from components.cold_start import cold_start

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--only", help="comma-separated names of SETTINGS (default: all)")
    ap.add_argument("--set", action="append", default=[], help="a setting of your own: dotted overrides")
    ap.add_argument("--name", default="custom", help="the name of the --set setting")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--probe-every", type=int, default=100)
    ap.add_argument("--seeds", default="0", help="comma-separated cold-start seeds (each setting runs on each)")
    args = ap.parse_args()
    todo = {args.name: args.set} if args.set else SETTINGS
    if args.only:
        todo = {k: SETTINGS[k] for k in args.only.split(",")}
    results = {}
    for name, overrides in todo.items():
        for seed in (int(x) for x in args.seeds.split(",")):
            spec = spec_for(args.run_dir.resolve(), name, overrides, args.steps, args.probe_every, seed)
            t0 = time.time()
            result = cold_start(spec)
            label = f"{name} seed {seed}"
            results[label] = {
                "overrides": overrides,
                "seconds": round(time.time() - t0),
                "curve": curve(spec, result.mlflow_run_id),
            }
            print(json.dumps({"setting": label, **results[label]}), flush=True)
    print("\n| setting | overrides | steps to the gate | last (a) | (b) | (c) | (d) | latent change |")
    print("|---|---|---|---|---|---|---|---|")  # the gate: (a) - (b) >= 0.3 and (d) >= 0.7
    for name, r in results.items():
        last = r["curve"][-1]
        hit = next((p["step"] for p in r["curve"] if p["own"] - p["other"] >= 0.3 and p["rewritten"] >= 0.7), None)
        cells = [name, " ".join(r["overrides"]) or "-", str(hit or "not reached")]
        cells += [f"{last[k]:.2f}" for k in ("own", "other", "none", "rewritten")] + [f"{last['change_other']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
