"""`Tracker`: an MLflow store plus an experiment per suite; starts (and names) pipeline and stage runs, resumes,
ends and finds runs, and reads across runs (compare, plot). One run's logging is `TrackedRun` (`run`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from components.tracking.names import (
    CUM_GENERATIONS,
    DEFAULT_ARTIFACTS,
    EXPERIMENT_KIND,
    INHERITED_TAGS,
    TRAINING_MODE,
    VIEW_KEY,
    VIEW_TAG,
    T,
    Tag,
    TrackingError,
    namespace_of,
)
from components.tracking.query import _compare, _filter_string, _search
from components.tracking.run import TrackedRun
from components.tracking.store import (
    RetryPolicy,
    _scheme,
    _sqlite_path,
    connect,
    git_sha,
    redact,
    resolve_tracking_uri,
)
from components.tracking.values import _clip_tag, _config_data, _now_ms, config_hash, curated_params, flatten
from lopd_core.artifacts import sha256_json
from lopd_core.timing import section


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
            kind = dict([EXPERIMENT_KIND])  # a training experiment, not a GenAI one
            try:
                exp_id = retry.run(
                    lambda: client.create_experiment(name, artifact_location=location, tags=kind),
                    "creating the experiment",
                    uri,
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
        with section("stage/tracking"):
            return self.retry.run(fn, what, self.uri)

    @property
    def is_server(self) -> bool:
        return _scheme(self.uri) in ("http", "https")

    def run_url(self, run_id: str, experiment_id: str | None = None) -> str | None:
        """The run's page in the MLflow UI (None for a local store)."""
        if not self.is_server:
            return None
        return experiment_url(self.uri, experiment_id or self.experiment_id, run_id)

    def experiment_url(self, ui: str | None = None) -> str | None:
        """The experiment's runs in the MLflow UI at `ui` (default: the server of this store; None for a local
        store without `ui`), in training mode, with the saved view (`publish_view`)."""
        base = ui or (self.uri if self.is_server else None)
        return experiment_url(base, self.experiment_id) if base else None

    def publish_view(self, columns: Sequence[str], x_metric: str = CUM_GENERATIONS) -> None:
        """The experiment's saved view (`?viewStateShareKey=lopd`, also in the UI's Views menu): the runs list
        shows `columns` (metric names, added to those already there), the charts plot against `x_metric` (the
        rollout budget spent) and hide empty charts."""
        exp = self.call("reading the experiment", lambda: self.client.get_experiment(self.experiment_id))
        try:
            before = json.loads(json.loads(exp.tags[VIEW_TAG])["state"]).get("selectedColumns", [])
        except (KeyError, ValueError, TypeError):
            before = []
        wanted = [*[c for c in before if c.startswith("metrics.")], *(f"metrics.`{c}`" for c in columns)]
        state = {
            "selectedColumns": ["tags.`lopd.arm`", "tags.`method`", "tags.`seed`", *dict.fromkeys(wanted)],
            "globalLineChartConfig": {"xAxisKey": "metric", "selectedXAxisMetricKey": x_metric, "lineSmoothness": 0},
            "hideEmptyCharts": True,
        }
        now = _now_ms()
        view = {"name": "LOPD: scores and curves", "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
        self.call(
            "saving the experiment's view",
            lambda: self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, json.dumps(view)),
        )

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
        tags: dict[str, Any] = {Tag.ROLE: role, Tag.GIT_SHA: sha, Tag.GIT_COMMIT: sha}
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
            flat = config.flat() if hasattr(config, "flat") else flatten(data)
            all_params.update(curated_params(flat, method=tags.get(Tag.METHOD)))
            tags[Tag.CONFIG_HASH] = sha256_json(data)
            if isinstance(flat.get("suite"), str):  # the task suite the run's data comes from (a param too)
                tags[Tag.SUITE] = flat["suite"]
        all_params.update(params or {})
        tag_map = {k: _clip_tag(v) for k, v in tags.items() if v is not None}
        run = self.call(
            f"creating run {name!r}",
            lambda: self.client.create_run(self.experiment_id, run_name=name, tags=tag_map),
        )
        tracked = TrackedRun(
            self, run.info.run_id, run.info.experiment_id, name, load_history=False, namespace=namespace_of(stage)
        )
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
        namespace = namespace_of(run.data.tags.get(Tag.STAGE))
        return TrackedRun(self, run_id, run.info.experiment_id, name, load_history=True, namespace=namespace)

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


def experiment_url(ui: str, experiment_id: str, run_id: str | None = None) -> str:
    """A page of the MLflow UI at `ui` in training mode: the experiment's runs with the saved view, or a run."""
    base = f"{ui.rstrip('/')}/#/experiments/{experiment_id}"
    if run_id:
        return f"{base}/runs/{run_id}?{TRAINING_MODE}"
    return f"{base}/runs?{TRAINING_MODE}&viewStateShareKey={VIEW_KEY}"


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
