"""report: a comparison across runs from MLflow's search API (methods x seeds x benchmarks), as tables and plots.

    build_report(ReportSpec(evaluate_run_ids=[...], ...))   # the pipeline's report stage
    compare(tracking_uri, "lopd", pipeline_run_id=None)      # `lopd compare`: every evaluation in an experiment

Tables: the evaluation (headline score per benchmark with its 95% interval and n, one row per model, with the
training generations it cost), the mean over seeds per method, and the equal-budget view of training (each
train run read at the same number of generations, default the smallest final count). Figures: margin, beta and
reward against generations and against steps (components.tracking.plot_runs). Evaluation runs name their
training run in the `lopd.train_run_id` tag; rows and labels come from the runs' tags.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from pydantic import Field

from components.common import StageResult, StageSpec
from components.tracking import Tag, Tracker, plot_runs, redact, train_metric
from lopd_core.artifacts import ArtifactRef
from lopd_core.evaluation.stats import Estimate, mean_interval, wilson

LABEL_TAG = "lopd.label"
ORACLE_LABEL = "oracle warm start (rule-following demonstrations)"  # the positive control's ceiling (oracle: true)
CALIBRATION = ("base", "oracle")  # evaluation rows that are not trained arms
ARM_TAG = "lopd.arm"  # the sweep arm: a method, or a named variant of one (ablations)
BUDGET_METRICS = ("reward_mean", "success_rate", "margin", "beta")  # bare; logged as train/<name>
BUDGET_KEYS = [train_metric(k) for k in BUDGET_METRICS]
REPORT_FILES = (
    "report.md",
    "comparison.json",
    "curves_generations.png",
    "curves_step.png",
    "study.json",
    "study_curves.png",
)


class ReportSpec(StageSpec):
    """The report stage: tables and curves over the pipeline's evaluate and train runs (`parent_run_id`: the
    pipeline run the report is logged on)."""

    suite: str = "toolworld"
    title: str = "LOPD pipeline report"
    evaluate_run_ids: list[str] = Field(default_factory=list)  # one row each, in this order
    evaluations: list[ArtifactRef] = Field(default_factory=list)  # their metrics.json (the cache key's inputs)
    budget: float | None = None  # equal-budget view; None = the smallest final generation count
    episodes: list[ArtifactRef] = Field(default_factory=list)  # per evaluation (same order): records.jsonl
    study: bool = True  # with episodes: the study section too (a comparison at an equal budget)
    train_seconds: dict[str, float] = Field(default_factory=dict)  # train run id -> wall seconds (study table)
    reference_arm: str = "grpo"  # the study's sample-efficiency reference


def _tracker(spec: ReportSpec) -> Tracker:
    return Tracker.open(spec.suite, run_dir=spec.run_dir, tracking_uri=spec.tracking_uri, experiment=spec.experiment)


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def evaluation_rows(tracker: Tracker, run_ids: list[str]) -> list[dict[str, Any]]:
    """One row per evaluation run: label, method, seed, train run, and per benchmark {value, lo, hi, n}."""
    if not run_ids:
        return []
    quoted = ", ".join(f"'{r}'" for r in run_ids)
    runs = tracker.call(
        "searching evaluation runs",
        lambda: tracker.client.search_runs(
            [tracker.experiment_id], f"attributes.run_id IN ({quoted})", max_results=len(run_ids)
        ),
    )
    by_id = {r.info.run_id: r for r in runs}
    rows = []
    for run_id in run_ids:
        run = by_id.get(run_id)
        if run is None:
            raise ValueError(f"evaluation run {run_id} is not in experiment {tracker.experiment_name!r}")
        tags, metrics = run.data.tags, run.data.metrics
        names = [b for b in (tags.get("benchmark") or "").split(",") if b]
        benchmarks = {
            b: {
                "value": _num(metrics.get(f"eval/{b}/headline")),
                "lo": _num(metrics.get(f"eval/{b}/headline_lo")),
                "hi": _num(metrics.get(f"eval/{b}/headline_hi")),
                "n": _num(metrics.get(f"eval/{b}/overall/n")),
            }
            for b in names
        }
        seed = tags.get("seed") if tags.get("method") != "base" else None  # the base model has no training seed
        rows.append(
            {
                "label": tags.get(LABEL_TAG) or run.info.run_name,
                "method": tags.get("method"),
                "arm": tags.get(ARM_TAG) or tags.get("method"),
                "seed": int(seed) if seed and seed.lstrip("-").isdigit() else None,
                "run_id": run_id,
                "train_run_id": tags.get(Tag.TRAIN_RUN) or None,
                "pipeline_run_id": tags.get("pipeline_run_id"),
                "benchmarks": benchmarks,
            }
        )
    return rows


def training_rows(tracker: Tracker, train_run_ids: list[str], budget: float | None) -> tuple[list[dict], float | None]:
    """Train runs at their end and at an equal budget (default: the smallest final generation count)."""
    if not train_run_ids:
        return [], budget
    wanted = set(train_run_ids)
    pipelines: set[str | None] = set()
    for run_id in train_run_ids:
        run = tracker.call(f"reading run {run_id}", lambda r=run_id: tracker.client.get_run(r))
        pipelines.add(run.data.tags.get("pipeline_run_id"))
    final: dict[str, dict[str, Any]] = {}
    for pid in pipelines:
        for row in tracker.compare(pipeline_run_id=pid, stage="train", metrics=BUDGET_KEYS):
            if row["run_id"] in wanted:
                final[row["run_id"]] = row
    if budget is None:
        counts = [row["generations"] for row in final.values() if row.get("generations") is not None]
        budget = min(counts) if counts else None
    at_budget: dict[str, dict[str, Any]] = {}
    if budget is not None:
        for pid in pipelines:
            for row in tracker.compare(pipeline_run_id=pid, stage="train", metrics=BUDGET_KEYS, budget=budget):
                if row["run_id"] in wanted:
                    at_budget[row["run_id"]] = row
    rows = []
    for run_id in train_run_ids:
        end = final.get(run_id, {})
        row = {
            "run_id": run_id,
            "method": end.get("method"),
            "seed": end.get("seed"),
            "final_step": end.get("step"),
            "final_generations": end.get("generations"),
        }
        mid = at_budget.get(run_id, {})
        row.update({f"final_{k}": end.get(train_metric(k)) for k in BUDGET_METRICS})
        row.update({"step": mid.get("step"), "generations": mid.get("generations")})
        row.update({k: mid.get(train_metric(k)) for k in BUDGET_METRICS})
        rows.append(row)
    return rows, budget


# ------------------------------------------------------------------------------------------------ rendering


def _score(cell: dict[str, Any] | None) -> str:
    if not cell or cell.get("value") is None:
        return "-"
    text = f"{cell['value']:.1f}"
    if cell.get("lo") is not None and cell.get("hi") is not None:
        text += f" [{cell['lo']:.1f}, {cell['hi']:.1f}]"
    return text


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def benchmarks_of(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(b for row in rows for b in row["benchmarks"]))


def add_task_stats(rows: list[dict[str, Any]], episodes: dict[str, Path]) -> None:
    """Per row and benchmark, from the evaluation's per-task records: the success rate with its Wilson interval
    (`success`) and the paired per-task difference of the reward to the base model with its t interval over the
    tasks both scored (`delta`; 0-100 scale). In place; a benchmark without records is left as it is."""
    from flows.study import read_records

    base = next((r for r in rows if r["method"] == "base" and r["run_id"] in episodes), None)
    reference: dict[str, dict[str, float]] = {}  # benchmark -> the base model's per-task rewards
    for row in rows:
        if row["run_id"] not in episodes:
            continue
        for bench, cell in row["benchmarks"].items():
            rewards = read_records(episodes[row["run_id"]], bench)
            if not rewards:
                continue
            cell["success"] = wilson(sum(v >= 1.0 for v in rewards.values()), len(rewards)).to_dict()
            if base is not None and row is not base:
                if bench not in reference:
                    reference[bench] = read_records(episodes[base["run_id"]], bench)
                ref = reference[bench]
                common = sorted(set(rewards) & set(ref))
                if common:
                    diffs = [rewards[t] - ref[t] for t in common]
                    cell["delta"] = mean_interval(diffs, bounds=(-1.0, 1.0)).to_dict()


def evaluation_table(rows: list[dict[str, Any]], generations: dict[str, float | None]) -> str:
    """Models x benchmarks: headline scores (0-100) with 95% intervals and n; where the per-task records are
    there, the success rate with its Wilson interval and the paired difference to the base model."""
    benches = benchmarks_of(rows)
    detailed = {b for b in benches for r in rows if "success" in (r["benchmarks"].get(b) or {})}
    header = ["Model", "Method", "Seed", "Train generations"]
    for b in benches:
        header.append(f"{b} (n)")
        if b in detailed:
            header += [f"{b} success % [Wilson]", f"{b} Δ reward vs base [paired]"]
    body = []
    for row in rows:
        gens = generations.get(row["train_run_id"] or "", 0.0 if row["method"] == "base" else None)
        cells = []
        for b in benches:
            cell = row["benchmarks"].get(b) or {}
            n = cell.get("n")
            cells.append(f"{_score(cell)} ({int(n) if n is not None else '-'})")
            if b in detailed:
                cells.append(Estimate.from_dict(cell["success"]).format() if cell.get("success") else "-")
                delta = "0 (reference)" if row["method"] == "base" else "-"
                cells.append(_signed(Estimate.from_dict(cell["delta"])) if cell.get("delta") else delta)
        body.append([row["label"], row["method"] or "-", _fmt(row["seed"]), _fmt(gens), *cells])
    return _table(header, body)


def _signed(est: Estimate) -> str:
    return f"{est.value:+.1f} [{est.lo:+.1f}, {est.hi:+.1f}]"


def arms_table(comparison: dict[str, Any]) -> dict[str, list[Any]]:
    """A row per arm (the base model and the oracle included), means over its seeds: headline score, paired Δ
    to the base model and success rate per benchmark, and the training generations. MLflow's table format
    (`columns`, `data`), logged on the pipeline run as arms.json."""
    rows = comparison.get("evaluations", [])
    benches = benchmarks_of(rows)
    gens = {t["run_id"]: t.get("final_generations") for t in comparison.get("training", [])}
    columns = ["arm", "method", "seeds"]
    for b in benches:
        columns += [f"{b} score", f"{b} Δ vs base", f"{b} success %"]
    columns.append("train generations")
    data = []
    for arm in dict.fromkeys(r.get("arm") or r.get("method") or "-" for r in rows):
        members = [r for r in rows if (r.get("arm") or r.get("method") or "-") == arm]
        line: list[Any] = [arm, members[0].get("method"), len(members)]
        for b in benches:
            cells = [r["benchmarks"].get(b) or {} for r in members]
            for pick in (lambda c: c.get("value"), lambda c: (c.get("delta") or {}).get("value"),
                         lambda c: (c.get("success") or {}).get("value")):  # fmt: skip
                values = [v for v in map(pick, cells) if _num(v) is not None]
                line.append(round(statistics.fmean(values), 2) if values else None)
        spent = [g for g in (gens.get(r.get("train_run_id") or "") for r in members) if _num(g) is not None]
        line.append(statistics.fmean(spent) if spent else (0.0 if members[0].get("method") == "base" else None))
        data.append(line)
    return {"columns": columns, "data": data}


def seed_means(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm (a method, or a variant such as `grpo shuffled`): number of seeds and mean / sample std of each
    benchmark's headline. Grouping by method would pool a variant with its method's arm."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        arm = row.get("arm") or row["method"] or "-"
        entry = out.setdefault(arm, {"method": arm, "seeds": [], "scores": {}})
        entry["seeds"].append(row["seed"])
        for b, cell in row["benchmarks"].items():
            if cell.get("value") is not None:
                entry["scores"].setdefault(b, []).append(cell["value"])
    for entry in out.values():
        entry["mean"] = {b: statistics.fmean(v) for b, v in entry["scores"].items()}
        entry["std"] = {b: statistics.stdev(v) if len(v) > 1 else 0.0 for b, v in entry["scores"].items()}
    return list(out.values())


def section(markdown: str, heading: str) -> str:
    """The `## heading` section of a report (the heading line included, up to the next `## `), or ""."""
    if f"## {heading}" not in markdown:
        return ""
    return f"## {heading}" + markdown.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]


def study_tables(markdown: str) -> str:
    """A study report's tables against the warm start (one per agent benchmark, with the paired Δ and its interval),
    without the curves and diagnostics that follow them; "" for a report without a study."""
    study = section(markdown, "Study: arms x seeds at an equal budget")
    return study.split("\n### Teacher diagnostics", 1)[0].split("\n### Training reward", 1)[0].strip()


def render_markdown(
    title: str,
    rows: list[dict[str, Any]],
    train: list[dict[str, Any]],
    budget: float | None,
    links: dict[str, str] | None = None,
    figures: dict[str, str] | None = None,
) -> str:
    """The report as markdown: evaluation, seed means, equal-budget training view, figures, MLflow runs."""
    generations = {t["run_id"]: t["final_generations"] for t in train}
    parts = [f"# {title}\n"]
    parts += [
        "## Evaluation\n",
        "Headline score per benchmark (0-100) with its 95% interval and the number of "
        "tasks; the student acts alone (no retrieved context). Success %: tasks solved, with the Wilson interval "
        "(which, unlike a t interval over tasks that all scored the same, is never 0 wide). Δ reward vs base: the "
        "per-task difference to the base model, paired, with its t interval over the tasks (an improvement when "
        "its lower end is above 0). Train generations: rollouts spent in training (the equal-budget axis).\n",
        evaluation_table(rows, generations),
    ]
    means = seed_means(rows)
    if any(len(m["seeds"]) > 1 for m in means):
        benches = benchmarks_of(rows)
        body = [
            [
                m["method"],
                str(len(m["seeds"])),
                *[f"{m['mean'][b]:.1f} ± {m['std'][b]:.1f}" if b in m["mean"] else "-" for b in benches],
            ]
            for m in means
        ]
        parts += ["## Mean over seeds\n", _table(["Arm", "Seeds", *benches], body)]
    if train:
        parts.append(f"## Training at an equal budget ({_fmt(budget)} generations)\n")
        header = ["Method", "Seed", "Step", "Generations", *BUDGET_METRICS, "Final step", "Final generations"]
        body = [
            [
                _fmt(t["method"]),
                _fmt(t["seed"]),
                _fmt(t["step"]),
                _fmt(t["generations"]),
                *[_fmt(t[k]) for k in BUDGET_METRICS],
                _fmt(t["final_step"]),
                _fmt(t["final_generations"]),
            ]
            for t in train
        ]
        parts.append(_table(header, body))
    if figures:
        parts.append("## Curves (margin with its target m, beta, privilege, reward)\n")
        parts += [f"![{name}]({target})\n" for name, target in figures.items()]
    if links:
        parts.append("## MLflow runs\n")
        parts += [f"- {name}: {target}" for name, target in links.items()]
        parts.append("")
    return "\n".join(parts)


def run_links(tracker: Tracker, rows: list[dict[str, Any]]) -> dict[str, str]:
    """Markdown links to the runs (a server's UI), else the run ids."""
    out = {}
    for row in rows:
        items = [("evaluate", row["run_id"])] + ([("train", row["train_run_id"])] if row["train_run_id"] else [])
        texts = []
        for what, run_id in items:
            url = tracker.run_url(run_id)
            texts.append(f"[{what} {run_id[:8]}]({url})" if url else f"{what} `{run_id}`")
        out[row["label"]] = ", ".join(texts)
    return out


def write_report(
    tracker: Tracker, rows: list[dict], train: list[dict], budget: float | None, out_dir: Path, title: str
) -> Path:
    """report.md, comparison.json and the curves under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {}
    train_ids = [t["run_id"] for t in train]
    if train_ids:
        for x in ("generations", "step"):
            path = out_dir / f"curves_{x}.png"
            plot_runs(
                tracker.uri,
                train_ids,
                path,
                x=x,
                budget=budget if x == "generations" else None,
                title=f"training curves vs {x}",
            )
            figures[f"margin and target m, beta, privilege, reward vs {x}"] = path.name
    text = render_markdown(title, rows, train, budget, run_links(tracker, rows), figures)
    (out_dir / "report.md").write_text(text)
    data = {
        "tracking_uri": redact(tracker.uri),
        "experiment": tracker.experiment_name,
        "budget": budget,
        "evaluations": rows,
        "training": train,
    }
    (out_dir / "comparison.json").write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    return out_dir


def build_report(spec: ReportSpec) -> StageResult:
    """The pipeline's report stage: the tables and curves of its evaluation runs, logged on the pipeline run."""
    tracker = _tracker(spec)
    rows = evaluation_rows(tracker, spec.evaluate_run_ids)
    train_ids = [r["train_run_id"] for r in rows if r["train_run_id"]]
    train, budget = training_rows(tracker, train_ids, spec.budget)
    store = spec.store()
    episodes: dict[str, Path] = {}
    if spec.episodes:
        if len(spec.episodes) != len(spec.evaluate_run_ids):
            raise ValueError("ReportSpec.episodes must list one records artifact per evaluation run")
        episodes = {rid: store.get(ref) for rid, ref in zip(spec.evaluate_run_ids, spec.episodes, strict=True)}
        add_task_stats(rows, episodes)
    out_dir = write_report(tracker, rows, train, budget, Path(spec.run_dir) / "report", spec.title)
    if episodes and spec.study:
        from flows.study import study_section

        text, _ = study_section(tracker, rows, episodes, train, spec.train_seconds, out_dir, spec.reference_arm)
        report = out_dir / "report.md"
        head, _, rest = report.read_text().partition("\n")
        report.write_text(f"{head}\n\n{text}\n{rest}")
    ref = store.put(out_dir, "report", {"title": spec.title, "n_models": len(rows)})
    if spec.parent_run_id:
        log_report(tracker, spec.parent_run_id, out_dir)
    metrics = {
        f"{row['label']}/{b}": cell["value"]
        for row in rows
        for b, cell in row["benchmarks"].items()
        if cell.get("value") is not None
    }
    return StageResult(
        stage="report",
        artifacts={"report": ref},
        metrics=metrics,
        mlflow_run_id=spec.parent_run_id,
        summary=f"report of {len(rows)} evaluations, {len(train)} training runs",
    )


def pipeline_metrics(comparison: dict[str, Any]) -> dict[str, float]:
    """What a researcher compares across pipeline runs (the runs MLflow's default view lists), from
    comparison.json: per arm (mean over seeds) the held-out headline score per benchmark, `ARM/eval/BENCH`, its
    paired difference to the base model, `ARM/eval/BENCH/delta_vs_base`, and the final training generations,
    margin, beta, reward and success rate, `ARM/train/NAME`. (MLflow's charts then show a section per arm.)"""
    cells: dict[str, list[float]] = {}
    for row in comparison.get("evaluations", []):
        arm = row.get("arm") or row.get("method") or "base"
        for bench, cell in row.get("benchmarks", {}).items():
            if cell.get("value") is not None:
                cells.setdefault(f"{arm}/eval/{bench}", []).append(float(cell["value"]))
            if (cell.get("delta") or {}).get("value") is not None:
                cells.setdefault(f"{arm}/eval/{bench}/delta_vs_base", []).append(float(cell["delta"]["value"]))
    arms = {r.get("train_run_id"): r.get("arm") or r.get("method") for r in comparison.get("evaluations", [])}
    for row in comparison.get("training", []):
        arm = arms.get(row["run_id"]) or row.get("method")
        values = {"generations": row.get("final_generations")}
        values.update({k: row.get(f"final_{k}") for k in BUDGET_METRICS})
        for name, value in values.items():
            if _num(value) is not None:
                cells.setdefault(f"{arm}/train/{name}", []).append(float(value))
    return {key: statistics.fmean(values) for key, values in cells.items()}


def log_report(tracker: Tracker, run_id: str, out_dir: Path) -> None:
    for name in REPORT_FILES:
        if (out_dir / name).exists():
            path = str(out_dir / name)
            tracker.call(f"logging {name}", lambda p=path: tracker.client.log_artifact(run_id, p, "report"))


def compare(
    tracking_uri: str,
    experiment: str,
    *,
    pipeline_run_id: str | None = None,
    method: str | None = None,
    budget: float | None = None,
    out_dir: str | Path | None = None,
) -> tuple[str, dict[str, Any]]:
    """`lopd compare`: the report over every evaluation run of an experiment (optionally of one pipeline run or
    one method). Returns the markdown and the data; writes report.md, comparison.json and curves to `out_dir`."""
    tracker = Tracker.open(experiment, tracking_uri=tracking_uri, experiment=experiment)
    filters = {
        "stage": "evaluate",
        **({"pipeline_run_id": pipeline_run_id} if pipeline_run_id else {}),
        **({"method": method} if method else {}),
    }
    run_ids = list(reversed(tracker.find_runs(tags=filters)))  # oldest first
    rows = evaluation_rows(tracker, run_ids)
    train_ids = list(dict.fromkeys(r["train_run_id"] for r in rows if r["train_run_id"]))
    train, budget = training_rows(tracker, train_ids, budget)
    title = f"Comparison of {len(rows)} evaluations in experiment {experiment!r}"
    if out_dir is not None:
        write_report(tracker, rows, train, budget, Path(out_dir), title)
        text = (Path(out_dir) / "report.md").read_text()
    else:
        text = render_markdown(title, rows, train, budget, run_links(tracker, rows))
    return text, {"evaluations": rows, "training": train, "budget": budget}
