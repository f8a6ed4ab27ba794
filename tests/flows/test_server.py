"""A real Prefect server on PostgreSQL with a process worker: deploy prefect.yaml, run the pipeline deployment,
grow the bank, and see bank-watch's event trigger the re-training deployment, which runs to completion.

`prefect server start` on 127.0.0.1 (a free port) on a fresh PostgreSQL database (127.0.0.1:5432, trust auth,
user $LOPD_TEST_PG_USER, admin database $LOPD_TEST_PG_DB; dropped at the end), as the Kubernetes deployment
runs it; `lopd deploy` creates the work pools and registers every deployment; `prefect worker start --pool
lopd-process` runs the flow runs as subprocesses. The pipeline sends its evaluations to the
lopd-stage/stage-in-a-process deployment (mode=deployments), so the scale-out path (run_deployment, job variables,
the result hand-off through the stage cache) runs too. Every process started here is stopped by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.flows.presets import LEAN as PRESET_LEAN

ROOT = Path(__file__).resolve().parents[2]
PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_USER = os.environ.get("LOPD_TEST_PG_USER", "postgres")
PG_ADMIN_DB = os.environ.get("LOPD_TEST_PG_DB", "test")
pytestmark = pytest.mark.slow

LEAN = [
    *PRESET_LEAN,
    "evaluate.base=false",
    "execution.mode=deployments",
    "execution.remote_stages=[evaluate]",
    "execution.deployments={evaluate: lopd-stage/stage-in-a-process}",
    "execution.job_variables={evaluate: {env: {LOPD_TEST_MARK: x}}}",
]
# Services the test does not need (the trigger, action, event and task-run services stay on).
QUIET = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in ("SCHEDULER", "LATE_RUNS", "FOREMAN", "PAUSE_EXPIRATIONS", "CANCELLATION_CLEANUP", "REPOSSESSOR")
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_execute(sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_ADMIN_DB, connect_timeout=5)
    conn.autocommit = True
    with contextlib.closing(conn), conn.cursor() as cur:
        cur.execute(sql)


@contextlib.contextmanager
def started(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> Iterator[subprocess.Popen]:
    """A process in its own process group, stopped (SIGTERM, then SIGKILL) when the block ends."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """`prefect server start` on a fresh PostgreSQL database; yields the environment of its clients."""
    name = f"lopd_prefect_test_{uuid.uuid4().hex[:12]}"
    pg_execute(f'CREATE DATABASE "{name}"')
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_CLI_PROMPT": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    server_env = {
        **env,
        **QUIET,
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}",
    }
    log = home / "server.log"
    t0 = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        with started(cmd, server_env, log) as proc:
            while True:
                assert proc.poll() is None, f"prefect server exited:\n{log.read_text()[-3000:]}"
                assert time.monotonic() - t0 < 300, (
                    f"prefect server did not answer in 300 s:\n{log.read_text()[-3000:]}"
                )
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{api}/health", timeout=5).status_code == 200:
                        break
                time.sleep(1)
            yield {"env": env, "api": api, "home": home, "start_s": time.monotonic() - t0}
    finally:
        pg_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def lopd(server: dict[str, Any], *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        env=server["env"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"lopd {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def flow_runs(server: dict[str, Any], flow_name: str) -> list[dict[str, Any]]:
    body = {"flows": {"name": {"any_": [flow_name]}}, "sort": "EXPECTED_START_TIME_ASC"}
    return httpx.post(f"{server['api']}/flow_runs/filter", json=body, timeout=30).json()


def wait_for(what: str, check: Any, timeout: float, every: float = 2.0) -> Any:
    t0 = time.monotonic()
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(every)


def test_deploy_run_pipeline_and_retrain_on_bank_growth(server, tmp_path):
    timings = {"server_start_s": round(server["start_s"], 1)}
    t0 = time.monotonic()
    lopd(server, "deploy")
    timings["deploy_s"] = round(time.monotonic() - t0, 1)
    deployments = httpx.post(f"{server['api']}/deployments/filter", json={}, timeout=30).json()
    names = {d["name"] for d in deployments}
    assert {"local", "k8s", "sft", "collect", "cold-start", "train", "evaluate"} <= names and len(deployments) == 11
    study = next(d for d in deployments if d["entrypoint"].endswith(":lopd_study"))
    assert "config" in study["parameter_openapi_schema"]["properties"]  # the typed form
    pool = httpx.get(f"{server['api']}/work_pools/lopd-gpu", timeout=30).json()
    assert pool["type"] == "kubernetes"
    assert "nvidia.com/gpu" in json.dumps(pool["base_job_template"]["job_configuration"])
    retrain = next(d for d in deployments if d["entrypoint"].endswith(":lopd_retrain"))
    assert retrain["global_concurrency_limit"]["limit"] == 1
    assert retrain["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"

    worker_env = {**server["env"], "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
    worker_cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "lopd-process", "--type", "process"]
    run_dir = tmp_path / "run"
    with started(worker_cmd, worker_env, server["home"] / "worker.log"):
        # 1. the pipeline deployment; its evaluations run as lopd-stage/stage-in-a-process flow runs
        t0 = time.monotonic()
        config = [arg for item in [*LEAN, f"run_dir={run_dir}"] for arg in ("-s", item)]
        tiny = str(ROOT / "configs" / "tiny.yaml")
        shown = lopd(server, "run", tiny, *config, "-d", "lopd-pipeline/pipeline-on-this-machine")
        timings["pipeline_s"] = round(time.monotonic() - t0, 1)
        (pipe_run,) = flow_runs(server, "lopd-pipeline")
        # what the user sees: the table, where things are and the UI link, as a local run prints them
        assert "## Evaluation" in shown.stdout and "| Model |" in shown.stdout, shown.stdout
        assert "MLflow pipeline run" in shown.stdout and f"{run_dir}" in shown.stdout, shown.stdout
        assert f"/runs/flow-run/{pipe_run['id']}" in shown.stdout, shown.stdout
        assert pipe_run["state_type"] == "COMPLETED"
        stage_runs = flow_runs(server, "lopd-stage")
        assert [r["state_type"] for r in stage_runs] == ["COMPLETED"]  # the evaluation, in its own process
        assert all(r["job_variables"]["env"]["LOPD_TEST_MARK"] == "x" for r in stage_runs)
        assert all(r["job_variables"]["env"]["MLFLOW_TRACKING_URI"].endswith("mlflow.db") for r in stage_runs)
        trained = json.loads((run_dir / "trained.json").read_text())
        assert trained["bank_version"] == 1

        # 2. the bank grows (the bank CLI), bank-watch announces it twice in a row: one re-training
        grown = tmp_path / "grown.jsonl"
        rows = [
            {
                "task_id": f"extra-{i}",
                "env_id": "toolworld_bank",
                "task": f"Extra task {i}",
                "reward": 1.0,
                "messages": [{"role": "user", "content": f"Extra task {i}"}, {"role": "assistant", "content": "ok"}],
                "trace": f"Action: ok {i}",
            }
            for i in range(3)
        ]
        grown.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ingest = lopd(server, "bank", "ingest", str(grown), "--location", str(run_dir / "bank"), "--min-reward", "0")
        assert json.loads(ingest.stdout)["added"] == 3
        t0 = time.monotonic()
        first = json.loads(lopd(server, "watch", "--run-dir", str(run_dir), "--min-growth", "3").stdout)
        again = json.loads(
            lopd(server, "watch", "--run-dir", str(run_dir), "--min-growth", "3", "--debounce-s", "0").stdout
        )
        assert first["status"] == again["status"] == "emitted"  # two events: the trigger must debounce them
        done = wait_for(
            "the triggered lopd-retrain run to finish",
            lambda: [
                r
                for r in flow_runs(server, "lopd-retrain")
                if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            ],
            timeout=900,
        )
        timings["retrain_s"] = round(time.monotonic() - t0, 1)
        (run,) = done
        assert run["state_type"] == "COMPLETED", run["state"]
        assert run["parameters"]["run_dir"] == str(run_dir) and run["parameters"]["bank_version"] == 2
        assert json.loads((run_dir / "trained.json").read_text())["bank_version"] == 2
        time.sleep(5)
        assert len(flow_runs(server, "lopd-retrain")) == 1  # debounced: one growth burst, one re-training
        assert [r["state_type"] for r in flow_runs(server, "lopd-stage")] == ["COMPLETED"] * 2  # evaluated again
    print(json.dumps(timings))
