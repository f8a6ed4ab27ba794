"""MLflow tracking for the stages: an experiment per suite, a pipeline run with one child run per stage.

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

Per-step metrics: the sink logs every finite numeric value it is given under its own name, plus
`generations_cum` (the running sum of `generations`: the rollout budget spent, the x axis of the
equal-budget view). Non-finite values (NaN, +-inf) are not logged as points: the step gets a
`nonfinite_metrics` point counting them, the run's `lopd.nonfinite_keys` tag lists their names, and a
warning is logged once per name. Values that are not numbers and names MLflow rejects are skipped with a
warning. Training never stops because of a metric value.

Robustness: opening checks the store first (`/health` of a server, a connection to a SQL database, a
writable directory for sqlite) and fails within `connect_timeout` seconds with `TrackingUnavailableError`
naming the URI (credentials masked) and what to check. Calls that fail with a transient error (connection
errors, a locked or unavailable database, HTTP 5xx/429) are retried with exponential back-off
(`RetryPolicy`), then raised as `TrackingError`. MLflow's own HTTP client retries first
(MLFLOW_HTTP_REQUEST_MAX_RETRIES, default 7 with back-off): set it lower where failing fast matters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import posixpath
import re
import sqlite3
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag, ViewType
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from lopd_core.artifacts import ArtifactRef, sha256_json

__all__ = [
    "CUM_GENERATIONS",
    "DEFAULT_PANELS",
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
    "git_sha",
    "plot_runs",
    "resolve_tracking_uri",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
GIT_SHA_ENV = "LOPD_GIT_SHA"  # set in images built without .git
DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
CONFIG_ARTIFACT = "config.yaml"

CUM_GENERATIONS = "generations_cum"  # running sum of `generations`, logged at every step
NONFINITE_METRICS = "nonfinite_metrics"  # number of non-finite values dropped at a step (logged when > 0)
# What a train step reports (lopd_core.step.TrainStep); steps without an update lack the loss terms.
STEP_METRICS = (
    "distill_kl", "margin", "beta", "anchor", "privilege_mean", "reward_mean", "success_rate", "teacher_topm_mass",
    "tail_mass", "n_action_tokens", "n_overlength", "failed_rollouts", "generations", "step_seconds",
)  # fmt: skip
DEFAULT_PANELS: tuple[tuple[str, ...], ...] = (("margin",), ("beta",), ("reward_mean", "success_rate"))
CurveX = Literal["step", "generations"]


class Tag:
    """Tag keys (search them with `tags.<key>`, dotted ones as tags.`<key>`)."""

    SUITE = "suite"
    STAGE = "stage"
    ROLE = "lopd.role"  # "pipeline" | "stage"
    METHOD = "method"
    SEED = "seed"
    BACKBONE = "backbone"
    BENCHMARK = "benchmark"
    BANK_SNAPSHOT = "bank_snapshot_id"
    CONFIG_HASH = "config_hash"  # sha256 of the config's canonical JSON
    GIT_SHA = "git_sha"
    PIPELINE_RUN = "pipeline_run_id"
    PREFECT_FLOW_RUN_ID = "prefect.flow_run_id"
    PREFECT_FLOW_RUN_URL = "prefect.flow_run_url"
    PARAMS_TRUNCATED = "lopd.params_truncated"  # params cut to MLflow's length limit (full values in config.yaml)
    NONFINITE_KEYS = "lopd.nonfinite_keys"
    LAST_CHECKPOINT = "lopd.last_checkpoint"  # artifact path of the newest checkpoint reference
    PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: nests the run under its parent in the UI
    GIT_COMMIT = "mlflow.source.git.commit"
    NOTE = "mlflow.note.content"  # the run description shown in the UI


# A stage run takes these from its parent unless given explicitly.
INHERITED_TAGS = (
    Tag.METHOD, Tag.SEED, Tag.BACKBONE, Tag.BENCHMARK, Tag.BANK_SNAPSHOT, Tag.PREFECT_FLOW_RUN_ID,
    Tag.PREFECT_FLOW_RUN_URL, Tag.NOTE,
)  # fmt: skip
ROW_COLUMNS = (
    "run_id", "run_name", "stage", "method", "seed", "backbone", "benchmark", "bank_snapshot_id", "config_hash",
    "pipeline_run_id", "status", "step", "generations",
)  # fmt: skip


class TrackingError(RuntimeError):
    """A tracking call kept failing (after retries)."""


class TrackingUnavailableError(TrackingError):
    """The tracking store cannot be reached at all."""


# ---------------------------------------------------------------- URIs, reachability, retries


def resolve_tracking_uri(tracking_uri: str | None = None, run_dir: str | Path | None = None) -> str:
    """The explicit URI (from the config), else $MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db."""
    uri = tracking_uri or os.environ.get(TRACKING_URI_ENV)
    if uri:
        return uri
    if run_dir is None:
        raise ValueError(
            f"no tracking URI: pass tracking_uri, set {TRACKING_URI_ENV}, or give run_dir for the default sqlite store"
        )
    return f"sqlite:///{Path(run_dir).resolve() / DEFAULT_DB}"


def redact(uri: str) -> str:
    """The URI with any password masked."""
    return re.sub(r"(://[^/@:]*:)[^/@]*@", r"\1***@", uri)


def _scheme(uri: str) -> str:
    return uri.split(":", 1)[0].split("+", 1)[0].lower() if "://" in uri else "file"


def _sqlite_path(uri: str) -> Path | None:
    path = uri.split("://", 1)[1].split("?", 1)[0]
    path = path[1:] if path.startswith("/") else path  # sqlite:///rel or sqlite:////abs
    return None if path in ("", ":memory:") else Path(path)


def check_reachable(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, with what to check, when the store behind `uri` cannot be used."""
    scheme = _scheme(uri)
    shown = redact(uri)
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingUnavailableError(
                f"MLflow tracking server at {shown} is unreachable ({reason}). Check that `mlflow server` is running "
                f"and listening on that host and port, that nothing blocks the connection, and that the tracking URI "
                f"(tracking_uri in the config, or ${TRACKING_URI_ENV}) is right."
            ) from None
        if status != 200:
            raise TrackingUnavailableError(
                f"{shown}/health answered HTTP {status}: is this an MLflow tracking server? Check the tracking URI "
                f"(tracking_uri in the config, or ${TRACKING_URI_ENV}) and the server's log."
            )
    elif scheme == "sqlite":
        path = _sqlite_path(uri)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TrackingUnavailableError(
                    f"cannot create the sqlite tracking store {shown}: {exc}. Check that the run directory is writable."
                ) from None
            _repair_half_built(path)
    elif scheme in ("postgresql", "mysql", "mssql"):
        import sqlalchemy

        connect_args = {"connect_timeout": max(1, math.ceil(timeout))} if scheme in ("postgresql", "mysql") else {}
        try:
            engine = sqlalchemy.create_engine(uri, connect_args=connect_args)
            try:
                with engine.connect():
                    pass
            finally:
                engine.dispose()
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TrackingUnavailableError(
                f"MLflow backend store {shown} is unreachable ({first_line}). Check that the database server is "
                f"running on that host and port, that the database exists, that the user may connect, and that its "
                f"driver is installed (postgresql+psycopg2:// needs psycopg2)."
            ) from None


TRANSIENT_ERROR_CODES = frozenset(
    {"TEMPORARILY_UNAVAILABLE", "INTERNAL_ERROR", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
)


def retryable_call(exc: BaseException) -> bool:
    """One MLflow call worth repeating (RetryPolicy): connection trouble, an unavailable/locked database, 5xx or
    rate limits. Whether a whole stage is worth re-running is `flows.stages.is_transient`."""
    if isinstance(exc, MlflowException):
        return exc.error_code in TRANSIENT_ERROR_CODES
    return isinstance(exc, OSError)  # ConnectionError, TimeoutError, requests' connection errors


def _short(exc: BaseException, limit: int = 500) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class RetryPolicy:
    """Retry transient failures `attempts` times in all, sleeping initial_delay, x multiplier, ... up to max_delay."""

    attempts: int = 4
    initial_delay: float = 0.5
    multiplier: float = 2.0
    max_delay: float = 8.0

    def run(self, fn: Callable[[], T], what: str, uri: str) -> T:
        delay = self.initial_delay
        for attempt in range(1, max(self.attempts, 1) + 1):
            try:
                return fn()
            except Exception as exc:
                if not retryable_call(exc):
                    raise
                if attempt >= self.attempts:
                    raise TrackingError(
                        f"{what} failed {attempt} times on MLflow at {redact(uri)}; last error: {_short(exc)}"
                    ) from exc
                logger.warning(
                    "%s failed (attempt %d/%d), retrying in %.1fs: %s",
                    what,
                    attempt,
                    self.attempts,
                    delay,
                    _short(exc, 200),
                )
                time.sleep(delay)
                delay = min(delay * self.multiplier, self.max_delay)
        raise AssertionError("unreachable")


def _half_built(path: Path) -> str | None:
    """What shows that the sqlite file is an MLflow database whose schema set-up was interrupted (a process
    killed during MLflow's migrations), or None."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables & {"alembic_version", "experiments"}:
                return None  # empty, or not MLflow's: MLflow's own error says so
            leftovers = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
            if leftovers:
                return f"an interrupted schema migration left the table {leftovers[0]}"
            if "alembic_version" not in tables or not db.execute("SELECT * FROM alembic_version").fetchall():
                return "it has tables but records no schema version (alembic_version)"
    except sqlite3.Error:
        return None
    return None


def _count_runs(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
        try:
            return int(db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        except sqlite3.OperationalError:  # no runs table yet
            return 0


def _repair_half_built(path: Path) -> None:
    """Move a half-initialised sqlite store that holds no runs aside (MLflow then creates it anew); raise
    TrackingUnavailableError naming the file when it holds runs."""
    if not path.is_file() or (problem := _half_built(path)) is None:
        return
    n_runs = _count_runs(path)
    if n_runs:
        raise TrackingUnavailableError(
            f"{path} is a half-initialised MLflow database ({problem}), and it holds {n_runs} run(s), so it is left "
            f"as it is: restore it from a backup, or move it aside to start a new store there. The tracking URI "
            f"is fine; the file is not."
        )
    aside = path.with_name(f"{path.name}.half-built-{time.strftime('%Y%m%d-%H%M%S')}")
    for suffix in ("", "-journal", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.replace(f"{path}{suffix}", f"{aside}{suffix}")
    logger.warning(
        "%s was a half-initialised MLflow database (%s) holding no runs: moved it to %s; MLflow creates a new one",
        path,
        problem,
        aside,
    )


def connect(uri: str, retry: RetryPolicy | None = None, connect_timeout: float = 5.0) -> MlflowClient:
    """An MlflowClient for `uri`, after checking that its store can be reached."""
    retry = retry or RetryPolicy()
    check_reachable(uri, connect_timeout)
    try:
        client = MlflowClient(tracking_uri=uri)
        retry.run(lambda: client.search_experiments(max_results=1), "listing experiments", uri)
    except TrackingUnavailableError:
        raise
    except Exception as exc:
        raise TrackingUnavailableError(
            f"cannot use the MLflow tracking store at {redact(uri)}: {_short(exc)}. Check the tracking URI "
            f"(tracking_uri in the config, or ${TRACKING_URI_ENV}) and that the store is an MLflow store."
        ) from exc
    return client


_git_sha_cache: dict[str, str] = {}


def git_sha() -> str:
    """$LOPD_GIT_SHA, else `git rev-parse HEAD` of this source tree, else "unknown"."""
    if os.environ.get(GIT_SHA_ENV):
        return os.environ[GIT_SHA_ENV]
    if "sha" not in _git_sha_cache:
        try:
            out = subprocess.run(
                ["git", "rev-parse", "HEAD"],
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            _git_sha_cache["sha"] = out.stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            _git_sha_cache["sha"] = "unknown"
    return _git_sha_cache["sha"]


# ---------------------------------------------------------------- values


def _config_data(config: Any) -> dict[str, Any]:
    """A config (pydantic model, dataclass or mapping) as plain JSON-compatible data."""
    if hasattr(config, "model_dump"):
        data = config.model_dump(mode="json")
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        data = dataclasses.asdict(config)
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(f"config must be a pydantic model, a dataclass or a mapping, got {type(config).__name__}")
    return json.loads(json.dumps(data, default=str))


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}` (the same keys as StrictModel.flat())."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_hash(config: Any) -> str:
    return sha256_json(_config_data(config))


def param_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, list | tuple | dict):
        return json.dumps(value, default=str)
    return str(value)


def format_params(params: Mapping[str, Any]) -> tuple[list[Param], list[str]]:
    """MLflow params, values cut to MLflow's length limit with a note; also the names of the cut ones."""
    out: list[Param] = []
    truncated: list[str] = []
    for key, value in params.items():
        text = param_text(value)
        if len(text) > MAX_PARAM_VAL_LENGTH:
            note = f"...[truncated from {len(text)} chars; full value in {CONFIG_ARTIFACT}]"
            text = text[: MAX_PARAM_VAL_LENGTH - len(note)] + note
            truncated.append(key)
        out.append(Param(key, text))
    return out, truncated


def _clip_tag(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_TAG_VAL_LENGTH else text[: MAX_TAG_VAL_LENGTH - 3] + "..."


_KEY_CHARS = re.compile(r"^[/\w.\- :]+$")


def valid_metric_key(key: Any) -> bool:
    """Whether MLflow accepts `key` as a metric name."""
    if not isinstance(key, str) or not key or len(key) > 250 or not _KEY_CHARS.match(key):
        return False
    return posixpath.normpath(key) == key and key != "." and not key.startswith(("/", ".."))


def _chunks(items: Sequence[T], size: int) -> Iterable[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _now_ms() -> int:
    return int(time.time() * 1000)


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

        `config` becomes the params (flattened), the `config_hash` tag and the `config.yaml` artifact; `params`
        adds more params. Unset labels are inherited from the parent run.
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
            all_params.update(config.flat() if hasattr(config, "flat") else flatten(data))
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


def _warn_once(warned: set[str], key: str, message: str, *args: Any) -> None:
    if key not in warned:
        warned.add(key)
        logger.warning(message, *args)


def _metric_points(metrics: Mapping[str, Any], step: int, ts: int, warned: set[str]) -> tuple[list[Metric], list[str]]:
    """Finite numeric values as MLflow metrics; also the names of the non-finite ones (not logged)."""
    points: list[Metric] = []
    nonfinite: list[str] = []
    for key, raw in metrics.items():
        if not valid_metric_key(key):
            _warn_once(warned, f"key:{key}", "metric name %r is not valid for MLflow; not logged", key)
            continue
        try:
            value = float(raw)
        except (TypeError, ValueError):
            _warn_once(warned, f"type:{key}", "metric %r has a non-numeric value %r; not logged", key, raw)
            continue
        if not math.isfinite(value):
            nonfinite.append(key)
            _warn_once(
                warned,
                f"nonfinite:{key}",
                "metric %r is %s at step %d; not logged (counted in %s)",
                key,
                value,
                step,
                NONFINITE_METRICS,
            )
            continue
        points.append(Metric(key, value, ts, step))
    return points, nonfinite


class MlflowMetricsSink:
    """`lopd_core.step.MetricsSink` over one MLflow run; create it with `TrackedRun.metrics_sink()`.

    Each `log(step, metrics)` adds the finite values plus `generations_cum` (running sum of `generations`) and,
    when some values were non-finite, `nonfinite_metrics`. Points are buffered and sent with `log_batch`.
    """

    def __init__(
        self,
        run: TrackedRun,
        cum_by_step: Mapping[int, float],
        flush_every: int,
        flush_seconds: float,
        logged: Mapping[str, set[int]] | None = None,
    ) -> None:
        self.run = run
        self._logged = {key: set(steps) for key, steps in (logged or {}).items()}
        self.flush_every = max(1, flush_every)
        self.flush_seconds = flush_seconds
        self._cum = dict(cum_by_step)
        self.last_step = max(self._cum, default=-1)
        self._resumed_at = self.last_step + 1
        self._buffer: list[Metric] = []
        self._buffered_steps = 0
        self._last_flush = time.monotonic()
        self._warned: set[str] = set()
        self._new_nonfinite: set[str] = set()

    @property
    def generations(self) -> float:
        """Generations spent up to the last logged step."""
        return self._cum.get(self.last_step, 0.0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        step = int(step)
        ts = _now_ms()
        points, nonfinite = _metric_points(metrics, step, ts, self._warned)
        try:
            generations = float(metrics.get("generations", 0.0))
        except (TypeError, ValueError):
            generations = 0.0
        if not math.isfinite(generations):
            generations = 0.0
        if step > self.last_step:
            before = self._cum.get(self.last_step, 0.0)
        else:  # a replayed step (resumed from an earlier checkpoint): continue from the step before it
            before = max(((s, c) for s, c in self._cum.items() if s < step), default=(-1, 0.0))[1]
        self._cum[step] = before + generations
        self.last_step = max(self.last_step, step)
        points.append(Metric(CUM_GENERATIONS, self._cum[step], ts, step))
        if nonfinite:
            points.append(Metric(NONFINITE_METRICS, float(len(nonfinite)), ts, step))
            self._new_nonfinite.update(nonfinite)
        if step < self._resumed_at:  # a replayed step (resumed from an earlier checkpoint): every step once
            kept = [p for p in points if step not in self._logged.get(p.key, ())]
            if len(kept) < len(points):
                logger.info(
                    "run %s: step %d is already in the tracking store (logged before the restart); its %d "
                    "stored values are kept and not logged again",
                    self.run.run_id,
                    step,
                    len(points) - len(kept),
                )
            points = kept
        self._buffer.extend(points)
        self._buffered_steps += 1
        if self._buffered_steps >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send the buffered points (kept for the next flush if sending fails)."""
        if self._buffer:
            batch, self._buffer = self._buffer, []
            try:
                self.run._log_points(batch)
            except Exception:
                self._buffer = batch + self._buffer
                raise
        self._buffered_steps = 0
        self._last_flush = time.monotonic()
        if self._new_nonfinite:
            keys, self._new_nonfinite = set(self._new_nonfinite), set()
            self.run._add_nonfinite_keys(keys)

    def close(self) -> None:
        self.flush()


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


_LINESTYLES = ("-", "--", ":", "-.")


def render_curves(
    series: Sequence[RunSeries],
    panels: Sequence[Sequence[str]],
    x: CurveX,
    out: Path,
    *,
    title: str | None = None,
    budget: float | None = None,
    reference: Mapping[str, float] | None = None,
) -> Path:
    """One panel per group of metrics, stacked on a shared x axis (step, or cumulative generations), written as PNG.

    One run: a colour per metric. Several runs: a colour per run, a line style per metric of the panel.
    `reference` draws horizontal dashed lines (e.g. the margin target), `budget` a vertical one (generations).
    """
    if x not in ("step", "generations"):
        raise ValueError(f"x must be 'step' or 'generations', got {x!r}")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend (Agg canvas)

    fig = Figure(figsize=(8.0, 2.4 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colors = [f"C{i % 10}" for i in range(max(len(series), max(len(p) for p in panels)))]
    for ax, keys in zip(axes, panels, strict=True):
        drawn = False
        for i, s in enumerate(series):
            for j, key in enumerate(keys):
                xs, ys = s.xy(key, x)
                if not xs:
                    continue
                if len(series) == 1:
                    color, style, label = colors[j], "-", key
                else:
                    color, style = colors[i], _LINESTYLES[j % len(_LINESTYLES)]
                    label = s.label if len(keys) == 1 else f"{s.label}: {key}"
                ax.plot(xs, ys, color=color, linestyle=style, marker="." if len(xs) <= 50 else None, label=label)
                drawn = True
        for key in keys:
            if reference and key in reference:
                ax.axhline(reference[key], color="gray", linestyle="--", linewidth=1, label=f"{key} target")
        if budget is not None and x == "generations":
            ax.axvline(budget, color="gray", linestyle=":", linewidth=1)
        ax.set_ylabel(" / ".join(keys))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small", loc="best")
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("cumulative generations (rollout budget)" if x == "generations" else "step")
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def plot_runs(
    tracking_uri: str,
    run_ids: Sequence[str],
    out: str | Path,
    *,
    panels: Sequence[Sequence[str]] = DEFAULT_PANELS,
    x: CurveX = "generations",
    labels: Mapping[str, str] | None = None,
    budget: float | None = None,
    title: str | None = None,
    retry: RetryPolicy | None = None,
) -> Path:
    """Per-step curves of several runs on shared axes (x = cumulative generations or step) as a PNG at `out`.

    Labels default to "<method> seed=<seed> <benchmark>" from the run tags; `budget` marks the equal-budget line.
    """
    retry = retry or RetryPolicy()
    client = connect(tracking_uri, retry)
    series = [_load_series(client, rid, panels, retry, tracking_uri, (labels or {}).get(rid)) for rid in run_ids]
    return render_curves(series, panels, x, Path(out), title=title, budget=budget)
