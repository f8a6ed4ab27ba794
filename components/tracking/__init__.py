"""MLflow tracking for the stages: an experiment per suite, a pipeline run with one child run per stage.

Modules, one job each: `names` (tag keys, metric names, errors), `store` (URIs, reachability, retries, the
client), `values` (params, metric keys), `tracker` (`Tracker`: the experiment; starting, resuming, finding
runs), `run` (`TrackedRun`: one run's params, tags, metrics, artifacts), `sink` (per-step metrics), `query`
(reading runs back), `plots` (curves). Import from the package: `from components.tracking import Tracker`.

    tracker = Tracker.open("bfcl", run_dir="runs/r1")    # sqlite:///runs/r1/mlflow.db, artifacts in runs/r1/mlartifacts
    tracker = Tracker.open("bfcl", tracking_uri="http://127.0.0.1:5000")    # or $MLFLOW_TRACKING_URI
    pipe = tracker.start_pipeline(method="lopd", seed=0, backbone="smollm2-135m",
                                  prefect_flow_run_id=flow_run_id, prefect_flow_run_url=flow_run_url)
    with tracker.start_stage("train", parent_run_id=pipe.run_id, config=cfg, bank_snapshot_id=ref.sha256) as run:
        step = TrainStep(..., sink=run.metrics_sink())       # lopd_core.step.MetricsSink, batched log_batch
        step.step_index = run.next_step                      # 0 for a new run, last logged step + 1 on resume
        ...; run.log_checkpoint(ckpt_ref, step=i)            # ArtifactRef JSON; run.latest_checkpoint() reads it back
        run.log_curves()                                     # curves/curves_step.png, curves/curves_generations.png
    pipe.end()
    run = Tracker.open(...).resume(run_id, config=cfg)      # a restarted stage continues the same run and step count

    rows = compare_runs(uri, "bfcl", pipeline_run_id=None, budget=50_000)   # tidy rows, one per run
    aggregate(rows, by=("method", "benchmark"), metrics=("success_rate",))  # mean / std over seeds
    plot_runs(uri, [r["run_id"] for r in rows], "compare.png", x="generations")

Per-step metrics: the sink logs every finite numeric value it is given under its own name in the run's stage
namespace (`train/margin`; `names.namespaced`), plus `train/generations_cum` (the running sum of `generations`:
the rollout budget spent, the x axis of the equal-budget view). Non-finite values (NaN, +-inf) are not logged as
points: the step gets a `nonfinite_metrics` point counting them, the run's `lopd.nonfinite_keys` tag lists their
names, and a warning is logged once per name. Values that are not numbers and names MLflow rejects are skipped with a
warning. Training never stops because of a metric value.

Robustness: opening checks the store first (`/health` of a server, a connection to a SQL database, a
writable directory for sqlite) and fails within `connect_timeout` seconds with `TrackingUnavailableError`
naming the URI (credentials masked) and what to check. Calls that fail with a transient error (connection
errors, a locked or unavailable database, HTTP 5xx/429) are retried with exponential back-off
(`RetryPolicy`), then raised as `TrackingError`. MLflow's own HTTP client retries first
(MLFLOW_HTTP_REQUEST_MAX_RETRIES, default 7 with back-off): set it lower where failing fast matters.
"""

from components.tracking.names import (
    CUM_GENERATIONS,
    DEFAULT_PANELS,
    MARGIN_TARGET,
    NONFINITE_METRICS,
    ROW_COLUMNS,
    STEP_METRICS,
    Tag,
    TrackingError,
    TrackingUnavailableError,
    namespaced,
    train_metric,
)
from components.tracking.plots import plot_runs
from components.tracking.query import aggregate, compare_runs, run_series
from components.tracking.run import TrackedRun
from components.tracking.sink import MlflowMetricsSink
from components.tracking.store import RetryPolicy, check_reachable, git_sha, redact, resolve_tracking_uri
from components.tracking.tracker import Tracker
from components.tracking.values import curated_params, format_params, param_text, valid_metric_key

__all__ = [
    "CUM_GENERATIONS",
    "DEFAULT_PANELS",
    "MARGIN_TARGET",
    "NONFINITE_METRICS",
    "ROW_COLUMNS",
    "STEP_METRICS",
    "MlflowMetricsSink",
    "RetryPolicy",
    "Tag",
    "TrackedRun",
    "Tracker",
    "TrackingError",
    "TrackingUnavailableError",
    "aggregate",
    "check_reachable",
    "compare_runs",
    "curated_params",
    "format_params",
    "git_sha",
    "namespaced",
    "param_text",
    "plot_runs",
    "redact",
    "resolve_tracking_uri",
    "run_series",
    "train_metric",
    "valid_metric_key",
]
