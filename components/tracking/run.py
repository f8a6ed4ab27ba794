"""`TrackedRun`: one MLflow run (a pipeline or a stage) -- params, tags, metrics, checkpoints and other
artifacts, curves, and ending the run. A resumed run reloads its step count and logged history."""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Run, RunTag
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
)

from components.tracking.names import (
    CONFIG_ARTIFACT,
    CUM,
    DEFAULT_PANELS,
    NONFINITE_METRICS,
    T,
    Tag,
    namespaced,
)
from components.tracking.plots import render_curves
from components.tracking.query import _history, _load_series
from components.tracking.sink import MlflowMetricsSink, _metric_points
from components.tracking.store import _short, redact
from components.tracking.values import _chunks, _clip_tag, _config_data, _now_ms, format_params
from lopd_core.artifacts import ArtifactRef

if TYPE_CHECKING:
    from components.tracking.tracker import Tracker

logger = logging.getLogger(__name__)


class TrackedRun:
    """One MLflow run (a pipeline or a stage): params, tags, metrics, artifacts, curves. A context manager:
    leaving it flushes the metrics and ends the run
    (FAILED on an exception, KILLED when stopped: KeyboardInterrupt or another BaseException)."""

    def __init__(
        self,
        tracker: Tracker,
        run_id: str,
        experiment_id: str,
        name: str,
        load_history: bool,
        namespace: str | None = None,
    ) -> None:
        self.tracker = tracker
        self.namespace = namespace  # metric names get it as a prefix: "train" -> train/margin (names.namespaced)
        self.cum_key = namespaced(namespace, CUM)  # train/generations_cum on a train run
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.name = name
        self._sink: MlflowMetricsSink | None = None
        self._cum_by_step: dict[int, float] = {}
        self._logged: dict[str, set[int]] = {}  # metric -> steps the store holds (a resumed run's history)
        if load_history:
            run = self._call("reading the run", lambda: self.client.get_run(self.run_id))
            history = self.history([self.cum_key, *sorted(run.data.metrics)])
            self._cum_by_step = dict(history[self.cum_key])
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
        """Summary metrics (e.g. evaluation results) at one step, sanitised like the sink's, in the run's namespace."""
        points, nonfinite = _metric_points(metrics, step, _now_ms(), warned=set(), namespace=self.namespace)
        if nonfinite:
            ts = points[0].timestamp if points else _now_ms()
            points.append(Metric(namespaced(self.namespace, NONFINITE_METRICS), float(len(nonfinite)), ts, step))
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
        The margin panel shows the margin target m (the metric `train/margin_target`) dashed."""
        series = _load_series(
            self.client, self.run_id, panels, self.tracker.retry, self.tracker.uri, self.name, flush=self.flush
        )
        paths = []
        with tempfile.TemporaryDirectory() as tmp:
            for x in ("step", "generations"):
                out = render_curves([series], panels, x, Path(tmp) / f"curves_{x}.png", title=self.name)
                paths.append(self.log_file(out, artifact_dir))
        return paths

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
        # stopped from outside (Ctrl-C, SIGTERM as KeyboardInterrupt, Prefect's TerminationSignal, the pipeline's
        # Stopped: every BaseException that is not an Exception) -> KILLED; an error -> FAILED
        status = "FAILED" if issubclass(exc_type, Exception) else "KILLED"
        try:
            self.end(status)
        except Exception as end_exc:  # do not hide the stage's own error
            logger.warning("could not end run %s as %s: %s", self.run_id, status, _short(end_exc))
