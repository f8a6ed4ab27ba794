"""First run vs re-run of the pipeline: what the stage cache saves. Prints JSON (and writes it with --out).

    python bench/pipeline_rerun.py                                   # configs/tiny.yaml, fresh temporary run dir
    python bench/pipeline_rerun.py --config configs/demo.yaml --out runs/bench/rerun-demo.json
    python bench/pipeline_rerun.py --change train.schedule.steps=3   # the changed-parameter run to time

In one process on Prefect's ephemeral API (started before the clock runs): the pipeline on a fresh run
directory (first), the same config again (re-run: every stage from the cache; goal <= 5% of the first run),
then with one changed parameter (default: the training steps), which re-runs that stage and what depends on it.
Each time is the flow call's wall time; the stages that ran and the ones from the cache are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL = 0.05


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _stages(summary: dict[str, Any]) -> dict[str, list[str]]:
    return {
        "ran": [s["label"] for s in summary["stages"] if not s["cached"]],
        "cached": [s["label"] for s in summary["stages"] if s["cached"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="key=value config override")
    ap.add_argument("--change", default=None, help="the changed parameter (default: train.schedule.steps + 1)")
    ap.add_argument("--run-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from prefect import flow

    from flows.config import load_config
    from flows.pipeline import lopd_pipeline

    run_dir = args.run_dir or tempfile.mkdtemp(prefix="lopd-rerun-")
    cfg = load_config(args.config, [*args.overrides, f"run_dir={run_dir}"])
    change = args.change or f"train.schedule.steps={cfg.train.schedule.steps + 1}"
    changed = load_config(args.config, [*args.overrides, f"run_dir={run_dir}", change])

    warm_s, _ = _timed(flow(name="warm-up")(lambda: None))  # starts the ephemeral API outside the timings
    first_s, first = _timed(lopd_pipeline, cfg)
    rerun_s, rerun = _timed(lopd_pipeline, cfg)
    changed_s, after = _timed(lopd_pipeline, changed)
    result = {
        "config": args.config,
        "overrides": args.overrides,
        "backbone": cfg.backbone,
        "run_dir": str(run_dir),
        "api_start_s": round(warm_s, 2),
        "first_s": round(first_s, 2),
        "rerun_s": round(rerun_s, 2),
        "ratio": round(rerun_s / first_s, 4),
        "goal": GOAL,
        "meets_goal": rerun_s / first_s <= GOAL,
        "first": _stages(first),
        "rerun": _stages(rerun),
        "changed": {"parameter": change, "seconds": round(changed_s, 2), **_stages(after)},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
