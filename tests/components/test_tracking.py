"""MLflow tracking on real stores: a sqlite store, and a real `mlflow server` backed by the local PostgreSQL.

The sqlite store is created once per session (MLflow's schema migrations take seconds); each test uses its own
experiment. The server tests start one `mlflow server` subprocess on 127.0.0.1 (free port) over a fresh database
`lopd_mlflow_test_<random>` (dropped afterwards); its start-up takes long enough that they are marked slow.
PostgreSQL: 127.0.0.1:5432, trust auth, user $LOPD_TEST_PG_USER (default postgres), admin database `test`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

from components.tracking import (
    CUM_GENERATIONS,
    DEFAULT_PANELS,
    MARGIN_TARGET,
    NONFINITE_METRICS,
    STEP_METRICS,
    RetryPolicy,
    Tag,
    Tracker,
    TrackingError,
    TrackingUnavailableError,
    aggregate,
    compare_runs,
    curated_params,
    format_params,
    param_text,
    plot_runs,
    resolve_tracking_uri,
    valid_metric_key,
)
from lopd_core.artifacts import ArtifactRef, sha256_json
from lopd_core.config import LOPDConfig
from tests.flows.servers import stop_process_group

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_USER = os.environ.get("LOPD_TEST_PG_USER", "postgres")
PG_ADMIN_DB = os.environ.get("LOPD_TEST_PG_DB", "test")
SERVER_START_TIMEOUT = 300.0  # seconds; a loaded 2-core machine needs about a minute
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("LOPD_GIT_SHA", raising=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- PostgreSQL and the server


def pg_admin():
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_ADMIN_DB, connect_timeout=5)
    conn.autocommit = True
    return conn


def pg_execute(sql: str, *args: object) -> None:
    with contextlib.closing(pg_admin()) as conn, conn.cursor() as cur:
        cur.execute(sql, args or None)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[tuple[str, str]]:
    """A fresh database (name, SQLAlchemy URI), dropped at the end of the session."""
    name = f"lopd_mlflow_test_{uuid.uuid4().hex[:12]}"
    pg_execute(f'CREATE DATABASE "{name}"')
    try:
        yield name, f"postgresql+psycopg2://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        pg_execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        pg_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def database_outage(name: str, seconds: float | None = None) -> Iterator[None]:
    """No connection to `name` (existing ones are closed) until the block ends, or for `seconds` only."""
    pg_execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
    pg_execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", name)
    timer = None
    if seconds is not None:
        timer = threading.Timer(seconds, pg_execute, args=(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true',))
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.join()
        pg_execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')


@dataclass
class Server:
    uri: str
    db_name: str
    artifacts: Path


def start_mlflow_server(backend_uri: str, root: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on 127.0.0.1:`port` over `backend_uri`, artifacts under `root`, once /health answers;
    stop it with stop_process_group (it is its own process group)."""
    uri = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_uri, "--workers", "1",
        "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job workers
    log_path = root / "server.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return proc
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {SERVER_START_TIMEOUT}s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        stop_process_group(proc)
        raise


@pytest.fixture(scope="session")
def mlflow_server(pg_database, tmp_path_factory) -> Iterator[Server]:
    name, db_uri = pg_database
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    proc = start_mlflow_server(db_uri, root, port)
    try:
        yield Server(f"http://127.0.0.1:{port}", name, root / "artifacts")
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="session")
def sqlite_run_dir(tmp_path_factory) -> Path:
    """A run directory whose default sqlite store exists (created once: MLflow's migrations are slow)."""
    run_dir = tmp_path_factory.mktemp("run")
    Tracker.open("warm-up", tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}", run_dir=run_dir)
    return run_dir


@dataclass
class Store:
    kind: str
    uri: str
    run_dir: Path | None
    server: Server | None = None

    def open(self, suite: str, **kwargs) -> Tracker:
        return Tracker.open(suite, tracking_uri=self.uri, run_dir=self.run_dir, **kwargs)


@pytest.fixture(params=["sqlite", pytest.param("server", marks=pytest.mark.slow)])
def store(request) -> Store:
    if request.param == "sqlite":
        run_dir = request.getfixturevalue("sqlite_run_dir")
        return Store("sqlite", f"sqlite:///{run_dir / 'mlflow.db'}", run_dir)
    server = request.getfixturevalue("mlflow_server")
    return Store("server", server.uri, None, server)


@pytest.fixture
def suite(request) -> str:
    return f"{request.node.originalname}-{uuid.uuid4().hex[:8]}"


def expected_git_sha() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def assert_png(path: Path) -> None:
    from matplotlib.image import imread

    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC, path
    image = imread(path)
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert image.std() > 0.01  # something was drawn


# ---------------------------------------------------------------- pure parts


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///x.db", tmp_path) == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI"):
        resolve_tracking_uri(None, None)


def test_params_are_stringified_and_long_values_cut():
    params, truncated = format_params({"a": 1e-5, "b": ("x", "y"), "c": None, "d": "z" * 7000, "e": True})
    values = {p.key: p.value for p in params}
    assert values["a"] == "1e-05" and values["b"] == '["x", "y"]' and values["c"] == "null" and values["e"] == "True"
    assert len(values["d"]) == 6000 and values["d"].startswith("zzz") and "truncated from 7000 chars" in values["d"]
    assert truncated == ["d"]
    assert valid_metric_key("grad_norm_student") and valid_metric_key("eval/bfcl.success_rate")
    assert not valid_metric_key("bad name!") and not valid_metric_key("../up") and not valid_metric_key("")


def test_retry_policy_retries_transient_errors_then_surfaces_them():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise MlflowException("database is locked", error_code=TEMPORARILY_UNAVAILABLE)
        return "ok"

    assert RetryPolicy(attempts=4, initial_delay=0.01).run(flaky, "logging", "sqlite:///x.db") == "ok"
    assert len(calls) == 3

    calls.clear()

    def invalid():
        calls.append(1)
        raise MlflowException("bad value", error_code=INVALID_PARAMETER_VALUE)

    with pytest.raises(MlflowException, match="bad value"):
        RetryPolicy(attempts=4, initial_delay=0.01).run(invalid, "logging", "sqlite:///x.db")
    assert len(calls) == 1  # not transient: raised at once

    def down():
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(TrackingError, match=r"logging failed 3 times on MLflow at postgresql://u:\*\*\*@h/db"):
        RetryPolicy(attempts=3, initial_delay=0.01).run(down, "logging", "postgresql://u:pw@h/db")


def test_unreachable_stores_fail_fast_with_a_clear_message(tmp_path):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(TrackingUnavailableError) as info:
        Tracker.open("suite", tracking_uri=f"http://127.0.0.1:{port}")
    message = str(info.value)
    assert (
        f"http://127.0.0.1:{port}" in message and "unreachable" in message and "`mlflow server` is running" in message
    )

    with pytest.raises(TrackingUnavailableError) as info:
        Tracker.open("suite", tracking_uri=f"postgresql+psycopg2://lopd:secret@127.0.0.1:{port}/nodb")
    message = str(info.value)
    assert f"postgresql+psycopg2://lopd:***@127.0.0.1:{port}/nodb" in message and "secret" not in message
    assert "database server is running" in message

    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(TrackingUnavailableError, match="writable"):
        Tracker.open("suite", tracking_uri=f"sqlite:///{tmp_path}/a-file/run/mlflow.db")

    with pytest.raises(TrackingUnavailableError, match=f"127.0.0.1:{port}"):
        compare_runs(f"http://127.0.0.1:{port}", "suite")
    assert time.monotonic() - t0 < 15


# ---------------------------------------------------------------- runs, params, tags


KILLED_DURING_SETUP = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

@event.listens_for(Engine, "after_cursor_execute")
def kill_9(conn, cursor, statement, *args):
    if statement.lstrip().startswith("CREATE TABLE _alembic_tmp_trace_tags"):
        os.kill(os.getpid(), signal.SIGKILL)

from mlflow import MlflowClient
MlflowClient(sys.argv[1]).search_experiments()
"""


def test_a_half_initialised_sqlite_store_is_moved_aside_or_reported(tmp_path, caplog):
    """`kill -9` during MLflow's first database set-up (at the statement the issue names) leaves mlflow.db
    half-built. Holding no runs, it is moved aside and a new store is created; holding runs, it is reported."""
    script = tmp_path / "setup_then_die.py"
    script.write_text(KILLED_DURING_SETUP)
    db = tmp_path / "mlflow.db"
    child = subprocess.run([sys.executable, str(script), f"sqlite:///{db}"], capture_output=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]

    with caplog.at_level("WARNING", logger="components.tracking"):
        tracker = Tracker.open("half-built", run_dir=tmp_path)
    (aside,) = tmp_path.glob("mlflow.db.half-built-*")
    assert caplog.messages == [
        f"{db} was a half-initialised MLflow database (an interrupted schema migration left the table "
        f"_alembic_tmp_trace_tags) holding no runs: moved it to {aside}; MLflow creates a new one"
    ]
    with tracker.start_stage("train") as run:
        run.log_metrics({"margin": 0.5})
    assert tracker.client.get_run(run.run_id).info.status == "FINISHED"

    with contextlib.closing(sqlite3.connect(db)) as conn:  # the same interruption in a store that holds a run
        conn.execute("CREATE TABLE _alembic_tmp_trace_tags (key VARCHAR(250))")
        conn.commit()
    with pytest.raises(TrackingUnavailableError) as info:
        Tracker.open("half-built", run_dir=tmp_path)
    assert str(info.value) == (
        f"{db} is a half-initialised MLflow database (an interrupted schema migration left the table "
        f"_alembic_tmp_trace_tags), and it holds 1 run(s), so it is left as it is: restore it from a backup, or "
        f"move it aside to start a new store there. The tracking URI is fine; the file is not."
    )


def test_default_store_is_sqlite_in_the_run_directory(sqlite_run_dir, suite):
    tracker = Tracker.open(suite, run_dir=sqlite_run_dir)  # no URI, no MLFLOW_TRACKING_URI
    assert tracker.uri == f"sqlite:///{sqlite_run_dir.resolve()}/mlflow.db"
    with tracker.start_stage("collect", config={"episodes": 4}) as run:
        run.log_json({"n": 4}, "metrics/collect.json")
    stored = list((sqlite_run_dir / "mlartifacts").rglob("collect.json"))
    assert len(stored) == 1 and run.run_id in str(stored[0])
    assert run.url is None


def test_pipeline_and_stage_runs_round_trip(store, suite, tmp_path):
    cfg = LOPDConfig(top_m=10, seed=3)
    flow_url = "http://127.0.0.1:4200/runs/flow-run/flow-123"
    tracker = store.open(suite)
    pipe = tracker.start_pipeline(
        method="lopd", seed=3, backbone="tiny", prefect_flow_run_id="flow-123", prefect_flow_run_url=flow_url
    )
    with tracker.start_stage(
        "train", parent_run_id=pipe.run_id, config=cfg, bank_snapshot_id="bank-v7", params={"notes": "n" * 7000}
    ) as run:
        ref = ArtifactRef("file:///store/checkpoint/abc", "checkpoint", sha256_json({"c": 1}), {"step": 2})
        ref_path = run.log_artifact_ref(ref, "final")
    pipe.end()

    client = MlflowClient(store.uri)
    children = client.search_runs([tracker.experiment_id], f"tags.mlflow.parentRunId = '{pipe.run_id}'")
    assert [c.info.run_id for c in children] == [run.run_id]
    child = children[0]
    tags = child.data.tags
    assert tags[Tag.PARENT_RUN] == pipe.run_id and tags[Tag.PIPELINE_RUN] == pipe.run_id
    assert tags[Tag.STAGE] == "train" and child.info.run_name == "train"
    assert Tag.SUITE not in tags  # an LOPDConfig names no task suite (a stage spec does: see below)
    assert tags[Tag.METHOD] == "lopd" and tags[Tag.SEED] == "3" and tags[Tag.BACKBONE] == "tiny"  # inherited
    assert tags[Tag.BANK_SNAPSHOT] == "bank-v7"
    assert tags[Tag.PREFECT_FLOW_RUN_ID] == "flow-123" and tags[Tag.PREFECT_FLOW_RUN_URL] == flow_url
    assert flow_url in tags[Tag.NOTE]
    assert tags[Tag.CONFIG_HASH] == sha256_json(cfg.model_dump(mode="json"))
    assert tags[Tag.GIT_SHA] == expected_git_sha() == tags[Tag.GIT_COMMIT]
    assert child.info.status == "FINISHED" and client.get_run(pipe.run_id).info.status == "FINISHED"

    params = child.data.params
    for key, value in curated_params(cfg.flat(), method="lopd").items():
        assert params[key] == param_text(value), key
    assert params["top_m"] == "10" and params["encoder_lora.r"] == "16"
    assert "encoder_lora.target_modules" not in params and "head_chunk_size" not in params  # in config.yaml
    assert len(params["notes"]) == 6000 and tags[Tag.PARAMS_TRUNCATED] == "notes"

    config_file = client.download_artifacts(run.run_id, "config.yaml", str(tmp_path))
    assert LOPDConfig.from_yaml(config_file) == cfg
    ref_file = client.download_artifacts(run.run_id, ref_path, str(tmp_path))
    assert ArtifactRef.from_json(Path(ref_file).read_text()) == ref

    by_flow = client.search_runs([tracker.experiment_id], "tags.`prefect.flow_run_id` = 'flow-123'")
    assert {r.info.run_id for r in by_flow} == {pipe.run_id, run.run_id}
    assert tracker.find_runs(parent_run_id=pipe.run_id, stage="train") == [run.run_id]
    if store.kind == "server":
        assert (
            run.url
            == f"{store.uri}/#/experiments/{tracker.experiment_id}/runs/{run.run_id}?workflowType=machine_learning"
        )
        assert list(store.server.artifacts.rglob("config.yaml"))  # proxied into --artifacts-destination


def test_a_failing_stage_marks_its_run_failed(store, suite):
    tracker = store.open(suite)
    with pytest.raises(RuntimeError, match="boom"), tracker.start_stage("train") as run:
        run.metrics_sink().log(0, {"margin": 0.1})
        raise RuntimeError("boom")
    got = MlflowClient(store.uri).get_run(run.run_id)
    assert got.info.status == "FAILED" and got.data.metrics["train/margin"] == 0.1  # buffered points flushed on failure


# ---------------------------------------------------------------- per-step metrics


def test_step_metrics_history_equals_what_was_logged(store, suite):
    nan, inf = math.nan, math.inf
    steps = [
        {"distill_kl": 0.9, "margin": -0.2, "beta": 0.0, "reward_mean": 0.1, "success_rate": 0.0, "generations": 8},
        {"distill_kl": 0.7, "margin": -0.1, "beta": 0.125, "reward_mean": 0.3, "success_rate": 0.25, "generations": 8},
        {"distill_kl": 0.6, "margin": 0.0, "beta": 0.2, "reward_mean": 0.4, "success_rate": 0.25, "generations": 16},
        {"distill_kl": nan, "margin": 0.05, "beta": 0.2, "tail_mass": inf, "note": "text", "bad name!": 1.0,
         "generations": 8},
        {"distill_kl": 0.4, "margin": 0.1, "beta": 0.175, "reward_mean": 0.6, "success_rate": 0.5, "generations": 8},
        {"distill_kl": 0.3, "margin": 0.12, "beta": 0.14, "updated": True, "generations": nan},
        {"distill_kl": 0.2, "margin": 0.2, "beta": 0.065, "reward_mean": 0.8, "success_rate": 0.75, "generations": 8},
    ]  # fmt: skip
    tracker = store.open(suite)
    run = tracker.start_stage("train")
    sink = run.metrics_sink(flush_every=3, flush_seconds=3600)
    for i, metrics in enumerate(steps):
        sink.log(i, metrics)
    client = MlflowClient(store.uri)
    logged_so_far = sorted(m.step for m in client.get_metric_history(run.run_id, "train/margin"))
    assert logged_so_far == [0, 1, 2, 3, 4, 5]  # two batches of 3 steps sent; step 6 still buffered
    run.end()

    def history(key):
        return sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, key))

    for key in ("distill_kl", "margin", "beta", "reward_mean", "success_rate", "generations", "tail_mass", "updated"):
        expected = [(i, float(m[key])) for i, m in enumerate(steps) if key in m and math.isfinite(float(m[key]))]
        assert history(f"train/{key}") == expected, key  # the stage's namespace
    assert history(CUM_GENERATIONS) == [(0, 8.0), (1, 16.0), (2, 32.0), (3, 40.0), (4, 48.0), (5, 48.0), (6, 56.0)]
    assert CUM_GENERATIONS == "train/generations_cum"
    assert history(f"train/{NONFINITE_METRICS}") == [(3, 2.0), (5, 1.0)]
    got = client.get_run(run.run_id)
    assert got.data.tags[Tag.NONFINITE_KEYS] == "train/distill_kl,train/generations,train/tail_mass"
    assert not {k for k in got.data.metrics if not k.startswith("train/")}  # every name in the namespace
    assert "train/note" not in got.data.metrics and "train/bad name!" not in got.data.metrics
    assert sink.generations == 56.0 and run.next_step == 7


def test_train_step_metrics_reach_mlflow(sqlite_run_dir, suite, tiny):
    from tests.core.test_step import make_batch, make_step

    tracker = Tracker.open(suite, run_dir=sqlite_run_dir)
    with tracker.start_stage("train", config=LOPDConfig(n_queries=4, qformer_layers=2), method="lopd") as run:
        step = make_step(tiny, run.metrics_sink(flush_every=1))
        for _ in range(2):
            step(make_batch())
    metrics = MlflowClient(tracker.uri).get_run(run.run_id).data.metrics
    expected = {f"train/{k}" for k in STEP_METRICS} | {MARGIN_TARGET}
    assert expected <= metrics.keys(), expected - metrics.keys()
    assert metrics[CUM_GENERATIONS] == 6.0  # 3 trajectories per step, one generation each
    assert metrics[MARGIN_TARGET] == LOPDConfig().margin_target  # m beside the margin, at every step


# ---------------------------------------------------------------- curves, resume


def test_curves_are_logged_as_png_artifacts(store, suite, tmp_path):
    tracker = store.open(suite)
    with tracker.start_stage("train", config=LOPDConfig(margin_target=0.05)) as run:
        sink = run.metrics_sink()
        for i in range(6):
            sink.log(
                i,
                {
                    "margin": 0.02 * i,
                    "beta": max(0.0, 0.1 - 0.02 * i),
                    "reward_mean": 0.1 * i,
                    "success_rate": 0.15 * i,
                    "generations": 4 + i,
                },
            )
        paths = run.log_curves()
    assert paths == ["curves/curves_step.png", "curves/curves_generations.png"]
    client = MlflowClient(store.uri)
    assert sorted(f.path for f in client.list_artifacts(run.run_id, "curves")) == sorted(paths)
    for path in paths:
        assert_png(Path(client.download_artifacts(run.run_id, path, str(tmp_path))))


def test_resume_by_run_id_continues_the_step_count(store, suite):
    cfg = LOPDConfig(seed=1)
    ckpt = ArtifactRef("file:///store/checkpoint/x", "checkpoint", sha256_json({"step": 4}), {"step": 4})
    tracker = store.open(suite)
    run = tracker.start_stage("train", config=cfg, method="lopd", seed=1)
    run_id = run.run_id
    sink = run.metrics_sink(flush_every=100)
    for i in range(5):
        sink.log(i, {"margin": 0.1 * i, "generations": 8})
    run.log_checkpoint(ckpt, step=4)  # flushes
    sink.log(5, {"margin": 9.9, "generations": 8})  # buffered, then the process "dies"
    del run, sink

    resumed = store.open(suite).resume(run_id, config=cfg)
    client = MlflowClient(store.uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    assert resumed.next_step == 5
    assert resumed.latest_checkpoint() == ckpt
    sink = resumed.metrics_sink()
    assert sink.generations == 40.0
    for i in range(resumed.next_step, 8):
        sink.log(i, {"margin": 0.1 * i, "generations": 8})
    resumed.end()

    history = resumed.history(["train/margin", CUM_GENERATIONS])
    assert [s for s, _ in history["train/margin"]] == list(range(8))
    assert history["train/margin"][5][1] == pytest.approx(0.5)
    assert history[CUM_GENERATIONS] == [(i, 8.0 * (i + 1)) for i in range(8)]
    assert client.get_run(run_id).info.status == "FINISHED"
    with pytest.raises(ValueError, match="config hash"):
        tracker.resume(run_id, config=LOPDConfig(seed=2))


def test_a_resumed_run_that_replays_steps_logs_every_step_once(store, suite):
    """Steps 0-4 reached the store but the process died before checkpoint 5 was written: the resumed stage
    replays steps 2-4 from checkpoint 2. The store keeps one point per step and metric."""
    tracker = store.open(suite)
    run = tracker.start_stage("train", method="lopd", seed=0)
    sink = run.metrics_sink(flush_every=100)
    for i in range(5):
        sink.log(i, {"margin": 0.1 * i, "beta": 1.0, "generations": 8})
    sink.flush()
    del run, sink

    resumed = store.open(suite).resume(tracker.find_runs(stage="train")[0])
    sink = resumed.metrics_sink()
    for i in range(2, 7):  # the replay from checkpoint 2, then new steps
        sink.log(i, {"margin": 0.1 * i, "beta": 2.0, "generations": 8, "nonfinite_here": math.nan})
    resumed.end()

    client = MlflowClient(store.uri)
    for key in ("train/margin", "train/beta", CUM_GENERATIONS):
        steps = sorted(m.step for m in client.get_metric_history(resumed.run_id, key))
        assert steps == list(range(7)), (key, steps)
    assert [v for _, v in resumed.history(["train/beta"])["train/beta"]] == [1.0] * 5 + [2.0] * 2
    assert resumed.history([CUM_GENERATIONS])[CUM_GENERATIONS] == [(i, 8.0 * (i + 1)) for i in range(7)]
    nonfinite = sorted(m.step for m in client.get_metric_history(resumed.run_id, f"train/{NONFINITE_METRICS}"))
    assert nonfinite == [2, 3, 4, 5, 6]  # new values of a replayed step are still logged


@pytest.mark.slow
def test_a_train_stage_resumed_after_the_server_died_has_every_step_once(tmp_path, monkeypatch):
    """A real `mlflow server` is stopped during step 3 of 6 (checkpoints every 2 steps) and started again;
    the re-run train stage resumes the same run, which then holds every step exactly once."""
    import lopd_core.training as train_module  # the train stage imports train_loop from here when it runs
    from components.artifacts import ArtifactStore
    from components.train import TrainSpec, train

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast while the server is down
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    backend = f"sqlite:///{root / 'mlflow.db'}"
    server = {"proc": start_mlflow_server(backend, root, port)}
    try:
        empty = tmp_path / "trajectories.jsonl"
        empty.write_text("")  # OPSD's solutions come from the suite's reference solutions
        run_dir = tmp_path / "run"
        dataset = ArtifactStore(run_dir / "artifacts").put(empty, "dataset")
        spec = TrainSpec(
            run_dir=str(run_dir), tracking_uri=f"http://127.0.0.1:{port}", experiment="server-dies",
            backbone="tiny", dataset=dataset, lopd={"method": "opsd"},
            schedule={"steps": 6, "tasks_per_step": 1, "checkpoint_every": 2},
            rollout={"max_new_tokens": 8, "max_turns": 1, "batch_size": 1},
        )  # fmt: skip
        real_loop = train_module.train_loop

        def loop_losing_the_server(step, tasks, rollout, *args, **kwargs):
            def rollout_then_stop(batch):
                if step.step_index == 3:  # steps 0, 1 are in the store (checkpoint 2); 2 and 3 are buffered
                    stop_process_group(server["proc"])
                return rollout(batch)

            return real_loop(step, tasks, rollout_then_stop, *args, **kwargs)

        monkeypatch.setattr(train_module, "train_loop", loop_losing_the_server)
        with pytest.raises(TrackingError, match="failed 4 times on MLflow"):
            train(spec)
        monkeypatch.setattr(train_module, "train_loop", real_loop)
        server["proc"] = start_mlflow_server(backend, root, port)
        result = train(spec)

        client = MlflowClient(f"http://127.0.0.1:{port}")
        run = client.get_run(result.mlflow_run_id)
        assert run.info.status == "FINISHED" and result.metrics["steps"] == 6
        assert len(client.search_runs([run.info.experiment_id])) == 1  # the same run was resumed
        for key in ("train/distill_kl", "train/reward_mean", "train/generations", CUM_GENERATIONS):
            steps = sorted(m.step for m in client.get_metric_history(result.mlflow_run_id, key))
            assert steps == list(range(6)), (key, steps)
    finally:
        stop_process_group(server["proc"])


# ---------------------------------------------------------------- comparison across runs


SUCCESS = {  # (method, seed) -> (generations per step, success_rate per step)
    ("lopd", 0): (10, [0.1, 0.3, 0.5, 0.7, 0.9]),
    ("lopd", 1): (10, [0.2, 0.4, 0.5, 0.6, 0.8]),
    ("grpo", 0): (30, [0.05, 0.2, 0.4, 0.45, 0.5]),
    ("grpo", 1): (30, [0.1, 0.25, 0.3, 0.5, 0.6]),
}


def test_comparison_table_and_equal_budget_view(store, suite, tmp_path):
    tracker = store.open(suite)
    pipe = tracker.start_pipeline(backbone="tiny", benchmark="bfcl-base")
    for (method, seed), (gens, success) in SUCCESS.items():
        with tracker.start_stage("train", parent_run_id=pipe.run_id, method=method, seed=seed) as run:
            sink = run.metrics_sink()
            for step, value in enumerate(success):
                margin = {"margin": 0.01 * step} if step % 2 == 0 else {}  # not logged at odd steps
                sink.log(step, {"success_rate": value, "reward_mean": value / 2, "generations": gens, **margin})
    with tracker.start_stage("evaluate", parent_run_id=pipe.run_id, method="lopd", seed=0) as ev:
        ev.log_metrics({"success_rate": 0.66})
    other = tracker.start_pipeline(backbone="tiny")
    with tracker.start_stage("train", parent_run_id=other.run_id, method="lopd", seed=9) as extra:
        extra.metrics_sink().log(0, {"success_rate": 1.0, "generations": 5})

    rows = compare_runs(store.uri, suite, pipeline_run_id=pipe.run_id, stage="train")
    assert [(r["method"], r["seed"]) for r in rows] == [("grpo", 0), ("grpo", 1), ("lopd", 0), ("lopd", 1)]
    for row in rows:
        gens, success = SUCCESS[(row["method"], row["seed"])]
        assert row["backbone"] == "tiny" and row["benchmark"] == "bfcl-base" and row["stage"] == "train"
        assert row["pipeline_run_id"] == pipe.run_id and row["status"] == "FINISHED"
        assert row["step"] == 4 and row["generations"] == 5 * gens
        assert row["train/success_rate"] == success[-1] and row["train/reward_mean"] == success[-1] / 2
        assert row["train/margin"] == pytest.approx(0.04)

    budget = compare_runs(
        store.uri, suite, pipeline_run_id=pipe.run_id, stage="train", budget=65,
        metrics=["train/success_rate", "train/margin"],
    )  # fmt: skip
    for r in budget:
        r["success_rate"], r["margin"] = r.pop("train/success_rate"), r.pop("train/margin")
    picked = {(r["method"], r["seed"]): (r["step"], r["generations"], r["success_rate"], r["margin"]) for r in budget}
    assert picked[("lopd", 0)] == (4, 50, 0.9, pytest.approx(0.04))  # 50 <= 65: the whole run
    assert picked[("grpo", 0)] == (1, 60, 0.2, 0.0)  # 30, 60 <= 65 < 90: step 1; margin as of step 0
    assert picked[("grpo", 1)] == (1, 60, 0.25, 0.0)
    assert all(r["budget"] == 65 and set(r) >= {"run_id", "success_rate", "margin"} for r in budget)
    small = compare_runs(store.uri, suite, pipeline_run_id=pipe.run_id, stage="train", budget=20)
    assert {(r["method"], r["step"], r["generations"]) for r in small} == {("lopd", 1, 20), ("grpo", None, None)}
    assert all(r["train/success_rate"] is None for r in small if r["method"] == "grpo")

    summary = aggregate(budget, by=("method",), metrics=("success_rate",))
    assert [(s["method"], s["n_runs"], s["seeds"]) for s in summary] == [("grpo", 2, [0, 1]), ("lopd", 2, [0, 1])]
    assert summary[0]["success_rate_mean"] == pytest.approx(0.225) and summary[0]["generations_mean"] == 60
    assert summary[1]["success_rate_std"] == pytest.approx(math.sqrt(0.005))

    lopd_anywhere = tracker.compare(tags={Tag.METHOD: "lopd"})
    assert sorted((r["stage"], r["seed"]) for r in lopd_anywhere) == [
        ("evaluate", 0),
        ("train", 0),
        ("train", 1),
        ("train", 9),
    ]
    evaluation = tracker.compare(pipeline_run_id=pipe.run_id, stage="evaluate")
    assert [(r["method"], r["eval/success_rate"]) for r in evaluation] == [("lopd", 0.66)]

    run_ids = [r["run_id"] for r in rows]
    for x in ("generations", "step"):
        out = plot_runs(store.uri, run_ids, tmp_path / f"compare_{x}.png", x=x, budget=65, title="bfcl-base")
        assert_png(out)


# ---------------------------------------------------------------- transient failures on the server (slow)


@pytest.mark.slow
def test_a_database_outage_is_retried_then_surfaced(mlflow_server, suite, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # only our retries, so that the test is quick
    patient = RetryPolicy(attempts=10, initial_delay=0.5, multiplier=1.5, max_delay=3.0)
    tracker = Tracker.open(suite, tracking_uri=mlflow_server.uri, retry=patient)
    run = tracker.start_stage("train")
    sink = run.metrics_sink(flush_every=1)
    with database_outage(mlflow_server.db_name, seconds=2.0):
        sink.log(0, {"margin": 0.5})  # the first attempts fail, a later one goes through
    assert run.history(["train/margin"])["train/margin"] == [(0, 0.5)]

    impatient = Tracker.open(suite, tracking_uri=mlflow_server.uri, retry=RetryPolicy(attempts=2, initial_delay=0.1))
    again = impatient.resume(run.run_id)
    with database_outage(mlflow_server.db_name), pytest.raises(TrackingError) as info:
        again.log_metrics({"margin": 0.7}, step=1)
    assert f"failed 2 times on MLflow at {mlflow_server.uri}" in str(info.value)
    again.log_metrics({"margin": 0.7}, step=1)  # the server recovers with the database
    again.end()
    assert run.history(["train/margin"])["train/margin"] == [(0, 0.5), (1, 0.7)]


def test_stage_runs_are_named_by_arm_seed_and_stage(store, suite):
    tracker = store.open(suite)
    with tracker.start_stage("train", method="grpo", seed=1) as a:
        pass
    with tracker.start_stage("evaluate", method="lopd", seed=0, tags={"lopd.arm": "lopd m=0"}) as b:
        pass
    with tracker.start_stage("bank") as c:
        pass
    client = MlflowClient(store.uri)
    names = [client.get_run(r.run_id).info.run_name for r in (a, b, c)]
    assert names == ["grpo s1 · train", "lopd m=0 s0 · evaluate", "bank"]


def test_params_are_those_of_the_runs_method_and_the_suite_tag_is_the_task_suite(store, suite):
    """A GRPO train run shows no LOPD-only hyperparameter (margin target, composer) and LOPD's shows them; the
    `suite` tag is the spec's task suite, as its `suite` param, not the experiment's name."""
    from components.train import TrainSpec

    tracker = store.open(suite)
    ref = {"uri": "/nowhere", "kind": "dataset", "sha256": "0" * 64}
    runs = {}
    for method in ("grpo", "opsd", "lopd"):
        extra = {"bank_snapshot": ref | {"kind": "bank_snapshot"}, "composer": ref | {"kind": "checkpoint"}}
        spec = TrainSpec(dataset=ref, suite="toolworld-rules", lopd={"method": method},
                         schedule={"samples_per_task": 2}, **(extra if method == "lopd" else {}))  # fmt: skip
        with tracker.start_stage("train", config=spec, method=method) as run:
            runs[method] = MlflowClient(store.uri).get_run(run.run_id).data
    grpo, opsd, lopd = (runs[m].params for m in ("grpo", "opsd", "lopd"))
    assert "lopd.margin_target" not in grpo and "lopd.n_queries" not in grpo and "lopd.top_m" not in grpo
    assert grpo["lopd.baseline.clip_eps"] == "0.2" and grpo["lopd.student_lr"] == "1e-05"
    assert "lopd.margin_target" not in opsd and "lopd.n_queries" not in opsd and opsd["lopd.top_m"] == "20"
    assert "lopd.baseline.clip_eps" not in opsd and "lopd.baseline.teacher_sync" in opsd
    assert lopd["lopd.margin_target"] == "0.05" and lopd["lopd.n_queries"] == "32" and lopd["lopd.top_m"] == "20"
    assert "lopd.baseline.clip_eps" not in lopd and "lopd.baseline.teacher_sync" not in lopd
    assert all(runs[m].tags[Tag.SUITE] == "toolworld-rules" == runs[m].params["suite"] for m in runs)


def test_the_margin_target_is_drawn_from_its_metric(store, suite, tmp_path):
    """An LOPD run logs m as `train/margin_target`; the margin panel draws it dashed, labelled "target m"."""
    from components.tracking.plots import render_curves
    from components.tracking.query import run_series

    tracker = store.open(suite)
    with tracker.start_stage("train") as run:
        for i in range(4):
            run.metrics_sink().log(i, {"margin": 0.02 * i, "margin_target": 0.05, "beta": 0.1, "generations": 4})
    series = run_series(tracker, run.run_id, [k for panel in DEFAULT_PANELS for k in panel])
    assert series.history[MARGIN_TARGET] == [(i, 0.05) for i in range(4)]
    out = render_curves([series], DEFAULT_PANELS, "generations", tmp_path / "c.png")
    assert_png(out)


def test_stage_params_are_the_curated_set_and_config_yaml_the_full_spec(store, suite, tmp_path):
    """A train stage's spec: ~95 flattened fields (artifact refs with their metadata, paths, rollout limits) but
    the params are what a compare view plots: the method's hyperparameters, backbone, seed, suite, schedule."""
    import yaml

    from components.train import TrainSpec

    dataset = ArtifactRef("file:///store/dataset/d", "dataset", sha256_json({"d": 1}), {"n": 4})
    snapshot = ArtifactRef("file:///store/bank/b", "bank_snapshot", sha256_json({"b": 1}), {"backend": "qdrant"})
    composer = ArtifactRef("file:///store/composer/c", "checkpoint", sha256_json({"c": 1}), {"step": 200})
    spec = TrainSpec(
        run_dir=str(tmp_path),
        backbone="tiny",
        dataset=dataset,
        bank_snapshot=snapshot,
        composer=composer,
        lopd=LOPDConfig(seed=2),
    )
    from components.tracking.values import flatten

    assert len(flatten(spec.model_dump(mode="json"))) > 70
    with store.open(suite).start_stage("train", config=spec, method="lopd", seed=2) as run:
        pass
    client = MlflowClient(store.uri)
    params = client.get_run(run.run_id).data.params
    assert not [k for k in params if "metadata" in k or k.startswith(("dataset.", "bank_snapshot.", "rollout."))]
    assert {"backbone", "suite", "lopd.method", "lopd.seed", "lopd.top_m", "lopd.margin_target"} <= set(params)
    assert {"lopd.dual_lr", "lopd.anchor_weight", "lopd.n_retrieved", "lopd.n_queries", "schedule.steps"} <= set(params)
    assert params["lopd.seed"] == "2" and params["backbone"] == "tiny" and len(params) < 60
    full = yaml.safe_load(Path(client.download_artifacts(run.run_id, "config.yaml", str(tmp_path))).read_text())
    assert full["bank_snapshot"]["metadata"] == {"backend": "qdrant"} and TrainSpec.model_validate(full) == spec


def test_seeds_of_an_arm_are_drawn_as_their_mean_with_a_band(tmp_path):
    """`lopd compare` curves (issue 16): the seeds of a method become one mean line with a +-1 sd band."""
    from components.tracking.plots import SeedMean, by_arm, render_curves
    from components.tracking.query import RunSeries

    def run(label: str, rewards: list[float]) -> RunSeries:
        steps = list(enumerate(rewards))
        return RunSeries(label, label, {"reward_mean": steps, CUM_GENERATIONS: [(s, 8.0 * (s + 1)) for s, _ in steps]})

    series = [run("lopd seed=0 toolworld", [0.0, 0.5]), run("grpo seed=0 toolworld", [0.2, 0.2]),
              run("lopd seed=1 toolworld", [0.2, 0.7, 0.9])]  # fmt: skip
    arms = by_arm(series)
    assert [a.label for a in arms] == ["lopd toolworld (mean ± sd, 2 seeds)", "grpo seed=0 toolworld"]
    lopd = arms[0]
    assert isinstance(lopd, SeedMean) and isinstance(arms[1], RunSeries)
    band = lopd.band("reward_mean", "generations")
    assert band.x == [8.0, 16.0]  # cut to the shorter seed
    assert band.mean == pytest.approx([0.1, 0.6])
    sd = math.sqrt(2 * 0.1**2)  # two seeds, each 0.1 from the mean: sample sd = 0.1414
    assert band.lo == pytest.approx([0.1 - sd, 0.6 - sd]) and band.hi == pytest.approx([0.1 + sd, 0.6 + sd])
    assert lopd.xy("reward_mean", "step") == ([0.0, 1.0], pytest.approx([0.1, 0.6]))
    assert_png(render_curves(arms, [["reward_mean"]], "generations", tmp_path / "bands.png"))


def test_the_experiment_opens_in_training_mode_with_its_saved_view(store, suite):
    """MLflow 3.17 opens an experiment in GenAI mode unless the URL says otherwise: the links carry
    workflowType=machine_learning and the saved view (score columns, the generations x axis, no empty charts)."""
    import json

    from components.tracking.tracker import experiment_url

    tracker = store.open(suite)
    exp = MlflowClient(store.uri).get_experiment(tracker.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    tracker.publish_view(["eval/toolworld/headline", "lopd/eval/toolworld"])
    tracker.publish_view(["eval/bfcl/headline"])  # a later pipeline adds its columns to those there
    view = json.loads(MlflowClient(store.uri).get_experiment(tracker.experiment_id).tags["mlflow.sharedViewState.lopd"])
    state = json.loads(view["state"])
    assert state["selectedColumns"] == [
        "tags.`lopd.arm`", "tags.`method`", "tags.`seed`", "metrics.`eval/toolworld/headline`",
        "metrics.`lopd/eval/toolworld`", "metrics.`eval/bfcl/headline`",
    ]  # fmt: skip
    assert state["globalLineChartConfig"]["selectedXAxisMetricKey"] == CUM_GENERATIONS and state["hideEmptyCharts"]
    ui = "http://127.0.0.1:5000"
    assert experiment_url(ui, "7") == f"{ui}/#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=lopd"
    assert experiment_url(ui, "7", "r1") == f"{ui}/#/experiments/7/runs/r1?workflowType=machine_learning"
    if store.kind == "server":
        assert tracker.experiment_url() == experiment_url(store.uri, tracker.experiment_id)
    else:
        assert tracker.experiment_url() is None and tracker.experiment_url(ui).startswith(ui)
