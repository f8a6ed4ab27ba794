"""Runs: `Tracker` (an experiment per suite, pipeline and stage runs, resume) and `TrackedRun` (params, tags,
checkpoints, curves of one run)."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from components.tracking.names import (
    CONFIG_ARTIFACT,
    CUM_GENERATIONS,
    DEFAULT_ARTIFACTS,
    DEFAULT_PANELS,
    INHERITED_TAGS,
    NONFINITE_METRICS,
    CurveX,
    T,
    Tag,
    TrackingError,
)
from components.tracking.plots import render_curves
from components.tracking.query import _compare, _filter_string, _history, _load_series, _search
from components.tracking.sink import MlflowMetricsSink, _metric_points
from components.tracking.store import (
    RetryPolicy,
    _scheme,
    _short,
    _sqlite_path,
    connect,
    git_sha,
    redact,
    resolve_tracking_uri,
)
from components.tracking.values import (
    _chunks,
    _clip_tag,
    _config_data,
    _now_ms,
    config_hash,
    curated_params,
    flatten,
    format_params,
)
from lopd_core.artifacts import ArtifactRef, sha256_json

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- runs


class Tracker:
    """An MLflow store plus one experiment (per suite). Open with `Tracker.open`."""

    def __init__(
        self, client: MlflowClient, uri: str, experiment_id: str, experiment_name: str, retry: RetryPolicy
    ) -> None:
        self.client = client
        self.uri = uri
        self.experiment_id = experiment_id
        self.experiment_name = experiment_name
        self.retry = retry

    @classmethod
    def open(
        cls,
        suite: str,
        *,
        run_dir: str | Path | None = None,
        tracking_uri: str | None = None,
        artifact_root: str | Path | None = None,
        experiment: str | None = None,
        retry: RetryPolicy | None = None,
        connect_timeout: float = 5.0,
    ) -> Tracker:
        """Connect (tracking_uri, else $MLFLOW_TRACKING_URI, else sqlite in run_dir); get or create the experiment.

        The experiment is named after the suite unless `experiment` is given. A new experiment on a local store
        keeps its artifacts in `artifact_root`, else <run_dir>/mlartifacts, else next to the sqlite file; on a
        server the server decides (its --artifacts-destination) unless `artifact_root` is given.
        """
        retry = retry or RetryPolicy()
        uri = resolve_tracking_uri(tracking_uri, run_dir)
        client = connect(uri, retry, connect_timeout)
        name = experiment or suite
        exp = retry.run(lambda: client.get_experiment_by_name(name), "looking up the experiment", uri)
        if exp is None:
            location = _artifact_location(uri, run_dir, artifact_root)
            try:
                exp_id = retry.run(
                    lambda: client.create_experiment(name, artifact_location=location), "creating the experiment", uri
                )
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = client.get_experiment_by_name(name)  # created meanwhile by another stage
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            if exp.lifecycle_stage == "deleted":
                raise TrackingError(
                    f"experiment {name!r} at {redact(uri)} is deleted: restore it (`mlflow experiments restore "
                    f"--experiment-id {exp.experiment_id}`) or use another experiment name"
                )
            exp_id = exp.experiment_id
        return cls(client, uri, exp_id, name, retry)

    def call(self, what: str, fn: Callable[[], T]) -> T:
        return self.retry.run(fn, what, self.uri)

    @property
    def is_server(self) -> bool:
        return _scheme(self.uri) in ("http", "https")

    def run_url(self, run_id: str, experiment_id: str | None = None) -> str | None:
        """The run's page in the MLflow UI (None for a local store)."""
        if not self.is_server:
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{experiment_id or self.experiment_id}/runs/{run_id}"

    # -- starting and re-opening runs

    def start_pipeline(
        self,
        name: str = "pipeline",
        *,
        config: Any = None,
        params: Mapping[str, Any] | None = None,
        method: str | None = None,
        seed: int | None = None,
        backbone: str | None = None,
        benchmark: str | None = None,
        bank_snapshot_id: str | None = None,
        prefect_flow_run_id: str | None = None,
        prefect_flow_run_url: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> TrackedRun:
        """The parent run of one pipeline (flow run). Its stage runs inherit method, seed, backbone, ... tags."""
        labels = _labels(method, seed, backbone, benchmark, bank_snapshot_id, prefect_flow_run_id, prefect_flow_run_url)
        return self._start(name, "pipeline", None, None, config, params, {**labels, **(tags or {})})

    def start_stage(
        self,
        stage: str,
        *,
        parent_run_id: str | None = None,
        name: str | None = None,
        config: Any = None,
        params: Mapping[str, Any] | None = None,
        method: str | None = None,
        seed: int | None = None,
        backbone: str | None = None,
        benchmark: str | None = None,
        bank_snapshot_id: str | None = None,
        prefect_flow_run_id: str | None = None,
        prefect_flow_run_url: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> TrackedRun:
        """A stage run, nested under the pipeline run `parent_run_id` when given.

        `config` becomes the curated params (`curated_params`: the method's hyperparameters, backbone, seed,
        budget, suite, schedule), the `config_hash` tag and the full `config.yaml` artifact; `params` adds more.
        Unset labels are inherited from the parent run.
        """
        labels = _labels(method, seed, backbone, benchmark, bank_snapshot_id, prefect_flow_run_id, prefect_flow_run_url)
        if name is None:  # "lopd s1 · train": a compare view tells a sweep's runs apart
            who = (tags or {}).get("lopd.arm") or method
            name = " ".join([*([who] if who else []), *([f"s{seed}"] if seed is not None else [])])
            name = f"{name} · {stage}" if name else stage
        return self._start(name, "stage", stage, parent_run_id, config, params, {**labels, **(tags or {})})

    def _start(
        self,
        name: str,
        role: str,
        stage: str | None,
        parent_run_id: str | None,
        config: Any,
        params: Mapping[str, Any] | None,
        labels: Mapping[str, Any],
    ) -> TrackedRun:
        sha = git_sha()
        tags: dict[str, Any] = {Tag.SUITE: self.experiment_name, Tag.ROLE: role, Tag.GIT_SHA: sha, Tag.GIT_COMMIT: sha}
        if parent_run_id:
            parent = self.call("reading the parent run", lambda: self.client.get_run(parent_run_id))
            inherited = {k: v for k, v in parent.data.tags.items() if k in INHERITED_TAGS}
            tags.update(inherited)
            tags[Tag.PARENT_RUN] = parent_run_id
            tags[Tag.PIPELINE_RUN] = parent.data.tags.get(Tag.PIPELINE_RUN, parent_run_id)
        if stage:
            tags[Tag.STAGE] = stage
        tags.update(labels)
        flow_id, flow_url = labels.get(Tag.PREFECT_FLOW_RUN_ID), labels.get(Tag.PREFECT_FLOW_RUN_URL)
        if flow_id or flow_url:
            tags[Tag.NOTE] = (
                f"Prefect flow run [{flow_id or flow_url}]({flow_url})" if flow_url else f"Prefect flow run {flow_id}"
            )
        all_params: dict[str, Any] = {}
        if config is not None:
            data = _config_data(config)
            all_params.update(curated_params(config.flat() if hasattr(config, "flat") else flatten(data)))
            tags[Tag.CONFIG_HASH] = sha256_json(data)
        all_params.update(params or {})
        tag_map = {k: _clip_tag(v) for k, v in tags.items() if v is not None}
        run = self.call(
            f"creating run {name!r}",
            lambda: self.client.create_run(self.experiment_id, run_name=name, tags=tag_map),
        )
        tracked = TrackedRun(self, run.info.run_id, run.info.experiment_id, name, load_history=False)
        if all_params:
            tracked.log_params(all_params)
        if config is not None:
            tracked.log_config(config)
        return tracked

    def resume(self, run_id: str, *, config: Any = None) -> TrackedRun:
        """Re-open a run (e.g. a restarted train stage): status back to RUNNING, step count and budget restored.

        With `config`, its hash must equal the run's `config_hash` tag (a different config is a different run).
        """
        run = self.call(f"reading run {run_id}", lambda: self.client.get_run(run_id))
        if run.info.lifecycle_stage == "deleted":
            raise TrackingError(f"run {run_id} at {redact(self.uri)} is deleted and cannot be resumed")
        if config is not None:
            logged, given = run.data.tags.get(Tag.CONFIG_HASH), config_hash(config)
            if logged != given:
                raise ValueError(f"run {run_id} was logged with config hash {logged}, but resumed with {given}")
        self.call(f"marking run {run_id} running", lambda: self.client.update_run(run_id, status="RUNNING"))
        name = run.data.tags.get("mlflow.runName") or run.info.run_name or run_id
        return TrackedRun(self, run_id, run.info.experiment_id, name, load_history=True)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        self.call(f"ending run {run_id}", lambda: self.client.set_terminated(run_id, status))

    def find_runs(
        self, *, parent_run_id: str | None = None, stage: str | None = None, tags: Mapping[str, str] | None = None
    ) -> list[str]:
        """Ids of active runs of this experiment matching the filters, newest first (e.g. a stage to resume)."""
        filters = dict(tags or {})
        if parent_run_id:
            filters[Tag.PARENT_RUN] = parent_run_id
        if stage:
            filters[Tag.STAGE] = stage
        runs = _search(self.client, [self.experiment_id], _filter_string(filters), self.retry, self.uri)
        return [r.info.run_id for r in sorted(runs, key=lambda r: r.info.start_time or 0, reverse=True)]

    # -- reading across runs

    def compare(
        self,
        *,
        pipeline_run_id: str | None = None,
        stage: str | None = None,
        tags: Mapping[str, str] | None = None,
        metrics: Sequence[str] | None = None,
        budget: float | None = None,
    ) -> list[dict[str, Any]]:
        """`compare_runs` on this tracker's experiment."""
        return _compare(
            self.client, self.experiment_id, pipeline_run_id, stage, tags, metrics, budget, self.retry, self.uri
        )

    def plot_runs(
        self,
        run_ids: Sequence[str],
        out: str | Path,
        *,
        panels: Sequence[Sequence[str]] = DEFAULT_PANELS,
        x: CurveX = "generations",
        labels: Mapping[str, str] | None = None,
        budget: float | None = None,
        title: str | None = None,
    ) -> Path:
        """`plot_runs` with this tracker's client."""
        series = [
            _load_series(self.client, rid, panels, self.retry, self.uri, (labels or {}).get(rid)) for rid in run_ids
        ]
        return render_curves(series, panels, x, Path(out), title=title, budget=budget)


def _labels(
    method: str | None,
    seed: int | None,
    backbone: str | None,
    benchmark: str | None,
    bank_snapshot_id: str | None,
    prefect_flow_run_id: str | None,
    prefect_flow_run_url: str | None,
) -> dict[str, Any]:
    values = {
        Tag.METHOD: method, Tag.SEED: seed, Tag.BACKBONE: backbone, Tag.BENCHMARK: benchmark,
        Tag.BANK_SNAPSHOT: bank_snapshot_id, Tag.PREFECT_FLOW_RUN_ID: prefect_flow_run_id,
        Tag.PREFECT_FLOW_RUN_URL: prefect_flow_run_url,
    }  # fmt: skip
    return {k: str(v) for k, v in values.items() if v is not None}


def _artifact_location(uri: str, run_dir: str | Path | None, artifact_root: str | Path | None) -> str | None:
    if artifact_root is not None:
        root = str(artifact_root)
        return root if "://" in root else Path(root).resolve().as_uri()
    scheme = _scheme(uri)
    if scheme in ("http", "https", "databricks"):
        return None  # the server's --artifacts-destination / --default-artifact-root
    if run_dir is not None:
        return (Path(run_dir).resolve() / DEFAULT_ARTIFACTS).as_uri()
    if scheme == "sqlite" and (path := _sqlite_path(uri)) is not None:
        return (path.resolve().parent / DEFAULT_ARTIFACTS).as_uri()
    return None


class TrackedRun:
    """One MLflow run (a pipeline or a stage): params, tags, metrics, artifacts, curves. A context manager:
    leaving it flushes the metrics and ends the run (FAILED on an exception, KILLED on KeyboardInterrupt)."""

    def __init__(self, tracker: Tracker, run_id: str, experiment_id: str, name: str, load_history: bool) -> None:
        self.tracker = tracker
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.name = name
        self._sink: MlflowMetricsSink | None = None
        self._cum_by_step: dict[int, float] = {}
        self._logged: dict[str, set[int]] = {}  # metric -> steps the store holds (a resumed run's history)
        if load_history:
            run = self._call("reading the run", lambda: self.client.get_run(self.run_id))
            history = self.history([CUM_GENERATIONS, *sorted(run.data.metrics)])
            self._cum_by_step = dict(history[CUM_GENERATIONS])
            self._logged = {key: {step for step, _ in points} for key, points in history.items() if points}
        self._first_step = max(self._cum_by_step, default=-1) + 1

    def __repr__(self) -> str:
        return f"TrackedRun({self.name!r}, run_id={self.run_id!r}, uri={redact(self.tracker.uri)!r})"

    @property
    def client(self) -> MlflowClient:
        return self.tracker.client

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.tracker.call(f"{what} (run {self.run_id})", fn)

    @property
    def url(self) -> str | None:
        """The run's page in the MLflow UI (None for a local store)."""
        return self.tracker.run_url(self.run_id, self.experiment_id)

    @property
    def next_step(self) -> int:
        """The step the next metrics should carry: 0 for a new run, last logged step + 1 after a resume."""
        return self._sink.last_step + 1 if self._sink is not None else self._first_step

    def get(self) -> Run:
        """The run as MLflow has it now (metrics flushed first)."""
        self.flush()
        return self._call("reading the run", lambda: self.client.get_run(self.run_id))

    # -- params, tags, metrics

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Params (stringified; cut to MLflow's value limit, the cut names in the lopd.params_truncated tag)."""
        formatted, truncated = format_params(params)
        for chunk in _chunks(formatted, MAX_PARAMS_TAGS_PER_BATCH):
            self._call("logging params", lambda c=chunk: self.client.log_batch(self.run_id, params=list(c)))
        if truncated:
            self.set_tags({Tag.PARAMS_TRUNCATED: ",".join(truncated)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        entries = [RunTag(k, _clip_tag(v)) for k, v in tags.items() if v is not None]
        for chunk in _chunks(entries, MAX_PARAMS_TAGS_PER_BATCH):
            self._call("setting tags", lambda c=chunk: self.client.log_batch(self.run_id, tags=list(c)))

    def metrics_sink(self, flush_every: int = 10, flush_seconds: float = 30.0) -> MlflowMetricsSink:
        """The run's `MetricsSink` (one per run): buffered, sent with log_batch every `flush_every` steps or
        `flush_seconds`, whichever comes first, and on flush()/end(). Flush before writing a checkpoint."""
        if self._sink is None:
            self._sink = MlflowMetricsSink(self, self._cum_by_step, flush_every, flush_seconds, self._logged)
        return self._sink

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0) -> None:
        """Summary metrics (e.g. evaluation results) at one step, sanitised like the sink's."""
        points, nonfinite = _metric_points(metrics, step, _now_ms(), warned=set())
        if nonfinite:
            points.append(
                Metric(NONFINITE_METRICS, float(len(nonfinite)), points[0].timestamp if points else _now_ms(), step)
            )
            self._add_nonfinite_keys(nonfinite)
        self._log_points(points)

    def _log_points(self, points: Sequence[Metric]) -> None:
        for chunk in _chunks(points, MAX_METRICS_PER_BATCH):
            self._call("logging metrics", lambda c=chunk: self.client.log_batch(self.run_id, metrics=list(c)))

    def _add_nonfinite_keys(self, keys: Iterable[str]) -> None:
        run = self._call("reading tags", lambda: self.client.get_run(self.run_id))
        known = set(filter(None, run.data.tags.get(Tag.NONFINITE_KEYS, "").split(",")))
        if not set(keys) <= known:
            self.set_tags({Tag.NONFINITE_KEYS: ",".join(sorted(known | set(keys)))})

    def flush(self) -> None:
        if self._sink is not None:
            self._sink.flush()

    def history(self, keys: Iterable[str]) -> dict[str, list[tuple[int, float]]]:
        """Per-step values of each metric, sorted by step (a step logged twice keeps the later value)."""
        self.flush()
        return _history(self.client, self.run_id, keys, self.tracker.retry, self.tracker.uri)

    # -- artifacts

    def log_text(self, text: str, artifact_file: str) -> str:
        self._call(f"logging {artifact_file}", lambda: self.client.log_text(self.run_id, text, artifact_file))
        return artifact_file

    def log_config(self, config: Any, artifact_file: str = CONFIG_ARTIFACT) -> str:
        """The config as YAML (its own to_yaml() when it has one)."""
        text = config.to_yaml() if hasattr(config, "to_yaml") else yaml.safe_dump(_config_data(config), sort_keys=False)
        return self.log_text(text, artifact_file)

    def log_json(self, obj: Any, artifact_file: str) -> str:
        """A JSON file (e.g. metrics.json of an evaluation)."""
        return self.log_text(json.dumps(obj, indent=2, sort_keys=True, default=str), artifact_file)

    def log_file(self, path: str | Path, artifact_path: str | None = None) -> str:
        path = Path(path)
        self._call(f"logging {path.name}", lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))
        return f"{artifact_path}/{path.name}" if artifact_path else path.name

    def log_artifact_ref(self, ref: ArtifactRef, name: str | None = None) -> str:
        """An ArtifactRef as JSON under refs/<kind>/<name>.json (the bytes stay in the artifact store)."""
        return self.log_text(ref.to_json(), f"refs/{ref.kind}/{name or ref.sha256[:16]}.json")

    def log_checkpoint(self, ref: ArtifactRef, step: int | None = None) -> str:
        """A checkpoint reference under checkpoints/; it becomes `latest_checkpoint()`. Flushes metrics first,
        so that a resume from this checkpoint finds every step up to it logged."""
        self.flush()
        path = self.log_text(
            ref.to_json(), f"checkpoints/{f'step-{step:08d}' if step is not None else ref.sha256[:16]}.json"
        )
        self.set_tags({Tag.LAST_CHECKPOINT: path})
        return path

    def latest_checkpoint(self) -> ArtifactRef | None:
        run = self._call("reading the run", lambda: self.client.get_run(self.run_id))
        path = run.data.tags.get(Tag.LAST_CHECKPOINT)
        if not path:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            local = self._call(f"downloading {path}", lambda: self.client.download_artifacts(self.run_id, path, tmp))
            return ArtifactRef.from_json(Path(local).read_text())

    def log_curves(self, panels: Sequence[Sequence[str]] = DEFAULT_PANELS, artifact_dir: str = "curves") -> list[str]:
        """PNG curves of the run's metrics vs step and vs cumulative generations, logged under `artifact_dir`.
        The margin panel shows the margin target m as a dashed line (`curve_references`)."""
        series = _load_series(
            self.client, self.run_id, panels, self.tracker.retry, self.tracker.uri, self.name, flush=self.flush
        )
        reference = self.curve_references()
        paths = []
        with tempfile.TemporaryDirectory() as tmp:
            for x in ("step", "generations"):
                out = render_curves(
                    [series], panels, x, Path(tmp) / f"curves_{x}.png", title=self.name, reference=reference
                )
                paths.append(self.log_file(out, artifact_dir))
        return paths

    def curve_references(self) -> dict[str, float]:
        """Dashed target lines of the curve panels: {"margin": m} from the run's `lopd.margin_target` param (a
        train stage's spec) or `margin_target` (an LOPDConfig logged on its own); {} when it has neither."""
        run = self._call("reading params", lambda: self.client.get_run(self.run_id))
        params = run.data.params
        for key in ("lopd.margin_target", "margin_target"):
            try:
                return {"margin": float(params[key])}
            except (KeyError, ValueError):
                continue
        return {}

    # -- lifecycle

    def end(self, status: str = "FINISHED") -> None:
        """Flush the metrics and end the run (FINISHED, FAILED or KILLED)."""
        try:
            self.flush()
        finally:
            self.tracker.end_run(self.run_id, status)

    def __enter__(self) -> TrackedRun:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is None:
            self.end("FINISHED")
            return
        status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        try:
            self.end(status)
        except Exception as end_exc:  # do not hide the stage's own error
            logger.warning("could not end run %s as %s: %s", self.run_id, status, _short(end_exc))
