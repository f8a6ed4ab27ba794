"""Reading runs back: metric histories, tidy comparison rows, aggregates over seeds, a run's series."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlflow import MlflowClient
from mlflow.entities import Run, ViewType

from components.tracking.names import CUM_GENERATIONS, ROW_COLUMNS, CurveX, Tag
from components.tracking.store import RetryPolicy, connect, redact

if TYPE_CHECKING:
    from components.tracking.tracker import Tracker


logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- reading: histories, comparison, curves


def _history(
    client: MlflowClient, run_id: str, keys: Iterable[str], retry: RetryPolicy, uri: str
) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for key in dict.fromkeys(keys):
        metrics = retry.run(lambda k=key: client.get_metric_history(run_id, k), f"reading {key} of run {run_id}", uri)
        by_step: dict[int, float] = {}
        for m in sorted(metrics, key=lambda m: (m.step, m.timestamp)):
            by_step[m.step] = m.value  # the later timestamp wins
        out[key] = sorted(by_step.items())
    return out


def _tag_clause(key: str, value: Any) -> str:
    text = str(value)
    if "'" in text or "`" in key:
        raise ValueError(f"tag filter {key}={text!r}: quotes are not supported in filter keys or values")
    return f"tags.`{key}` = '{text}'"


def _filter_string(tags: Mapping[str, Any]) -> str:
    return " and ".join(_tag_clause(k, v) for k, v in tags.items())


def _search(
    client: MlflowClient, experiment_ids: list[str], filter_string: str, retry: RetryPolicy, uri: str
) -> list[Run]:
    runs: list[Run] = []
    token: str | None = None
    while True:
        page = retry.run(
            lambda t=token: client.search_runs(experiment_ids, filter_string, ViewType.ACTIVE_ONLY, 1000, None, t),
            "searching runs",
            uri,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _seed(value: str | None) -> int | str | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _compare(
    client: MlflowClient,
    experiment_id: str,
    pipeline_run_id: str | None,
    stage: str | None,
    tags: Mapping[str, str] | None,
    metrics: Sequence[str] | None,
    budget: float | None,
    retry: RetryPolicy,
    uri: str,
) -> list[dict[str, Any]]:
    filters: dict[str, Any] = {Tag.ROLE: "stage"}
    if pipeline_run_id:
        filters[Tag.PIPELINE_RUN] = pipeline_run_id
    if stage:
        filters[Tag.STAGE] = stage
    filters.update(tags or {})
    rows = []
    for run in _search(client, [experiment_id], _filter_string(filters), retry, uri):
        t = run.data.tags
        # The row's `generations` is the cumulative count: the per-step metric of that name is no column.
        names = metrics if metrics is not None else sorted(run.data.metrics)
        keys = [k for k in names if k not in ROW_COLUMNS and k != CUM_GENERATIONS]
        row: dict[str, Any] = {
            "run_id": run.info.run_id,
            "run_name": run.info.run_name,
            "stage": t.get(Tag.STAGE),
            "method": t.get(Tag.METHOD),
            "seed": _seed(t.get(Tag.SEED)),
            "backbone": t.get(Tag.BACKBONE),
            "benchmark": t.get(Tag.BENCHMARK),
            "bank_snapshot_id": t.get(Tag.BANK_SNAPSHOT),
            "config_hash": t.get(Tag.CONFIG_HASH),
            "pipeline_run_id": t.get(Tag.PIPELINE_RUN),
            "status": run.info.status,
        }
        cum = _history(client, run.info.run_id, [CUM_GENERATIONS], retry, uri)[CUM_GENERATIONS]
        if budget is None:
            row["step"], row["generations"] = cum[-1] if cum else (None, None)
            row.update({k: run.data.metrics.get(k) for k in keys})
        else:
            within = [(g, s) for s, g in cum if g <= budget]
            generations, step = max(within) if within else (None, None)  # the most generations within the budget
            row.update(step=step, generations=generations, budget=budget)
            hist = _history(client, run.info.run_id, keys, retry, uri)
            for k in keys:  # the value as it stood at that step
                before = [v for s, v in hist[k] if step is not None and s <= step]
                row[k] = before[-1] if before else None
        rows.append(row)

    def order(row: dict[str, Any]) -> tuple[Any, ...]:
        seed = row["seed"]
        seed_key = (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed or ""))
        return (*(str(row.get(c) or "") for c in ("benchmark", "method", "stage")), seed_key, row["run_name"] or "")

    return sorted(rows, key=order)


def compare_runs(
    tracking_uri: str,
    experiment: str,
    *,
    pipeline_run_id: str | None = None,
    stage: str | None = None,
    tags: Mapping[str, str] | None = None,
    metrics: Sequence[str] | None = None,
    budget: float | None = None,
    retry: RetryPolicy | None = None,
) -> list[dict[str, Any]]:
    """One row per stage run of `experiment` (a suite): ROW_COLUMNS then one column per metric.

    Filters: the pipeline run (`pipeline_run_id`), the stage, and tag equalities (`{"method": "lopd"}`).
    `metrics` picks the metric columns (default: every metric the run has); `generations` is always the cumulative
    count (`generations_cum`), not the per-step metric of that name. Without `budget` the values are the
    final ones; with it (the equal-budget view) every run is read at its step with the most cumulative
    generations <= budget (`step`, `generations` say which), each metric as it stood at that step (its last value
    at or before it); a run whose first step already exceeds the budget gets None.
    """
    retry = retry or RetryPolicy()
    client = connect(tracking_uri, retry)
    exp = retry.run(lambda: client.get_experiment_by_name(experiment), "looking up the experiment", tracking_uri)
    if exp is None:
        names = [e.name for e in client.search_experiments()]
        raise ValueError(f"no experiment {experiment!r} at {redact(tracking_uri)}; there are: {names}")
    return _compare(client, exp.experiment_id, pipeline_run_id, stage, tags, metrics, budget, retry, tracking_uri)


def aggregate(
    rows: Sequence[Mapping[str, Any]],
    by: Sequence[str] = ("method", "benchmark"),
    metrics: Sequence[str] = ("success_rate", "reward_mean"),
) -> list[dict[str, Any]]:
    """Group comparison rows (e.g. over seeds): n_runs, seeds, mean generations, <metric>_mean and _std
    (sample std; 0 for one run) over the rows that have the metric."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in by), []).append(row)
    out = []
    for key, members in groups.items():
        entry: dict[str, Any] = dict(zip(by, key, strict=True))
        entry["n_runs"] = len(members)
        entry["seeds"] = sorted((m.get("seed") for m in members), key=str)
        gens = [float(m["generations"]) for m in members if m.get("generations") is not None]
        entry["generations_mean"] = statistics.fmean(gens) if gens else None
        for name in metrics:
            values = [float(m[name]) for m in members if m.get(name) is not None]
            entry[f"{name}_mean"] = statistics.fmean(values) if values else None
            entry[f"{name}_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
        out.append(entry)
    return sorted(out, key=lambda e: tuple(str(e[k]) for k in by))


@dataclass
class RunSeries:
    """Per-step histories of one run, for plotting."""

    run_id: str
    label: str
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def xy(self, key: str, x: CurveX) -> tuple[list[float], list[float]]:
        points = self.history.get(key, [])
        if x == "step":
            return [float(s) for s, _ in points], [v for _, v in points]
        cum = dict(self.history.get(CUM_GENERATIONS, []))
        pairs = [(cum[s], v) for s, v in points if s in cum]
        return [g for g, _ in pairs], [v for _, v in pairs]


def _load_series(
    client: MlflowClient,
    run_id: str,
    panels: Sequence[Sequence[str]],
    retry: RetryPolicy,
    uri: str,
    label: str | None = None,
    flush: Callable[[], None] | None = None,
) -> RunSeries:
    if flush is not None:
        flush()
    if label is None:
        run = retry.run(lambda: client.get_run(run_id), f"reading run {run_id}", uri)
        t = run.data.tags
        parts = [t.get(Tag.METHOD), f"seed={t[Tag.SEED]}" if Tag.SEED in t else None, t.get(Tag.BENCHMARK)]
        label = " ".join(p for p in parts if p) or run.info.run_name or run_id
    keys = [k for panel in panels for k in panel] + [CUM_GENERATIONS]
    return RunSeries(run_id, label, _history(client, run_id, keys, retry, uri))


def run_series(tracker: Tracker, run_id: str, keys: Sequence[str]) -> RunSeries:
    """The per-step histories of `keys` (and cumulative generations) of one run."""
    return _load_series(tracker.client, run_id, [list(keys)], tracker.retry, tracker.uri, label=run_id)
