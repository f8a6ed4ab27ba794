"""Where a study's wall time goes: one study cell (GRPO and LOPD, one seed, the study testbed) run as the study
runs it, with its time split into rollout generation, environments, the teacher and student passes, the composer,
evaluation, stage start-up, the stage cache and tracking, and the shared stages (warm start, collect, bank, cold
start).

    python bench/study_profile.py                                    # configs/study-cpu.yaml, grpo + lopd, seed 0
    python bench/study_profile.py --config configs/study-rules.yaml --methods grpo lopd opsd
    python bench/study_profile.py --from-run-dir runs/profile        # the table again from a finished run

Every stage writes `timing.json` beside its log (`flows.stages.timed_run`: the stage's wall time and its
`lopd_core.timing` sections, each exclusive of the sections inside it); in subprocess mode the parent adds the
child's whole wall time, so start-up (interpreter, imports) is what the process took beyond the stage's function.
Stages run one at a time here (`execution.max_parallel=1`), so the categories add up to the study's wall time and
the rest is orchestration (Prefect, the flow, the report). A stage served from the stage cache did not run and has
no part in the split. Prints one JSON object, then a Markdown table. A bench: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (stage, section) -> category; a section not listed counts as the stage's own work ("<stage> other")
TRAIN = {
    "rollout/generate": "rollout generate (train)",
    "rollout/environment": "environment and sandbox (train)",
    "rollout": "rollout bookkeeping (train)",
    "step/student": "student forward",
    "step/teacher": "teacher forward",
    "step/composer": "composer forward",
    "step/loss_head": "loss head and objective",
    "step/backward": "backward",
    "step/optimizer": "optimizer",
    "step": "step bookkeeping",
    "step/sync": "step bookkeeping",
    "train/checkpoint": "checkpoints",
}
SHARED = {"stage/load": "stage start-up", "stage/cache": "stage cache and tracking",
          "stage/tracking": "stage cache and tracking"}  # fmt: skip
STAGE_NAMES = {"sft": "warm start (sft)", "collect": "collect", "bank": "bank", "cold_start": "cold start",
               "evaluate": "evaluation", "report": "report", "train": "train other"}  # fmt: skip


def timing_docs(run_dir: Path) -> list[dict]:
    docs = []
    for path in sorted(run_dir.glob("stages/*/*/timing.json")):
        doc = json.loads(path.read_text())
        doc["folder"] = str(path.parent.relative_to(run_dir))
        docs.append(doc)
    return docs


def categories(docs: list[dict]) -> dict[str, float]:
    """Seconds per category, summed over the stages that ran."""
    out: defaultdict[str, float] = defaultdict(float)
    for doc in docs:
        stage, sections = doc["stage"], doc["sections"]
        own = STAGE_NAMES.get(stage, stage)
        for name, seconds in sections.items():
            if name in SHARED:
                out[SHARED[name]] += seconds
            elif stage == "train" and name in TRAIN:
                out[TRAIN[name]] += seconds
            else:
                out[own] += seconds
        out[own] += doc["stage_s"] - sum(sections.values())  # the stage's time outside any section
        if "process_s" in doc:  # subprocess mode: the interpreter, imports and exit around the stage's function
            out["stage start-up"] += doc["process_s"] - doc["stage_s"]
    return dict(out)


def profile(run_dir: Path, wall_s: float | None) -> dict:
    docs = timing_docs(run_dir)
    if not docs:
        raise SystemExit(f"no stage timing under {run_dir}/stages/*/*/timing.json: did the study run there?")
    cats = categories(docs)
    busy = sum(d.get("process_s", d["stage_s"]) for d in docs)
    overlapped = wall_s is not None and busy > wall_s  # stages ran side by side (max_parallel > 1)
    if wall_s is not None and not overlapped:
        cats["orchestration (Prefect, the flow)"] = wall_s - busy
    total = wall_s if wall_s is not None and not overlapped else sum(cats.values())
    stages = [{"stage": d["folder"], "seconds": round(d.get("process_s", d["stage_s"]), 2)} for d in docs]
    return {
        "run_dir": str(run_dir),
        "wall_s": None if wall_s is None else round(wall_s, 2),
        "stage_seconds_summed": round(busy, 2),
        "stages_overlapped": overlapped,
        "categories_s": {k: round(v, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "share": {k: round(v / total, 4) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "stages": stages,
    }


def table(result: dict) -> str:
    summed = sum(result["categories_s"].values())
    lines = ["| where the time goes | seconds | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.1f} | {100 * v / summed:.1f}% |" for k, v in result["categories_s"].items()]
    if result["stages_overlapped"]:  # the shares are of the stages' summed time, not of the wall time
        lines.append(f"| **stages' time, summed** | **{summed:.1f}** | 100% |")
        lines.append(f"| study wall time (stages side by side) | {result['wall_s']:.1f} | |")
    else:
        lines.append(f"| **study wall time** | **{summed:.1f}** | 100% |")
    lines += ["", "| stage run | seconds |", "|---|---|"]
    lines += [f"| {s['stage']} | {s['seconds']:.1f} |" for s in result["stages"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "study-cpu.yaml")
    ap.add_argument("--methods", nargs="+", default=["grpo", "lopd"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "profile")
    ap.add_argument("--from-run-dir", type=Path, help="only read the timing of a study that ran there")
    ap.add_argument("--wall-s", type=float, help="with --from-run-dir: the study's wall time, if known")
    ap.add_argument("--set", "-s", action="append", default=[], help="more study overrides (key=value)")
    args = ap.parse_args()
    if args.from_run_dir is not None:
        result = profile(args.from_run_dir, args.wall_s)
    else:
        if args.run_dir.exists() and any(args.run_dir.glob("stages/*/*/timing.json")):
            raise SystemExit(f"{args.run_dir} holds an earlier run (its cached stages would not run again): "
                             "give another --run-dir, or --from-run-dir to read it")  # fmt: skip
        overrides = [f"run_dir={args.run_dir}", f"methods=[{','.join(args.methods)}]", f"seeds=[{args.seed}]",
                     "execution.mode=subprocess", "execution.max_parallel=1", *args.set]  # fmt: skip
        command = [sys.executable, "-m", "flows.cli", "study", str(args.config)]
        for o in overrides:
            command += ["-s", o]
        print("running:", " ".join(command), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        subprocess.run(command, check=True, cwd=ROOT)
        result = profile(args.run_dir, time.perf_counter() - t0)
    print(json.dumps(result))
    print(table(result))


if __name__ == "__main__":
    main()
