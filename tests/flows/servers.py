"""Real servers for the slow flow tests, stopped by their process group: a Prefect server on a fresh PostgreSQL
database (with its UI for the browser test), an MLflow UI on a run's store, and the `lopd` CLI against them.

`prefect server start` runs on 127.0.0.1 (a free port) on a fresh PostgreSQL database (127.0.0.1:5432, trust auth,
user $LOPD_TEST_PG_USER, admin database $LOPD_TEST_PG_DB; dropped at the end), as the Kubernetes deployment runs it.
"""

from __future__ import annotations

import contextlib
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

ROOT = Path(__file__).resolve().parents[2]
PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_USER = os.environ.get("LOPD_TEST_PG_USER", "postgres")
PG_ADMIN_DB = os.environ.get("LOPD_TEST_PG_DB", "test")
# Services the tests do not need (the trigger, action, event and task-run services stay on).
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


def stop_process_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a process started in its own process group (a server CLI, uvicorn and their children): SIGTERM, then
    SIGKILL to the group, and SIGKILL to children that outlived the leader."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def started(cmd: list[str], env: dict[str, str], log: Path, cwd: Path = ROOT) -> Iterator[subprocess.Popen]:
    """A process in its own process group, stopped (`stop_process_group`) when the block ends."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            stop_process_group(proc)


def wait_until_up(url: str, proc: subprocess.Popen, log: Path, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, f"{what} exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"{what} did not answer in {timeout} s:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)


@contextlib.contextmanager
def prefect_server(home: Path, ui: bool = False) -> Iterator[dict[str, Any]]:
    """`prefect server start` on a fresh PostgreSQL database; yields the environment of its clients (`env`), the
    API URL (`api`), the UI's (`ui`, with `ui=True`), `home` and the start-up seconds (`start_s`)."""
    name = f"lopd_prefect_test_{uuid.uuid4().hex[:12]}"
    home.mkdir(parents=True, exist_ok=True)
    pg_execute(f'CREATE DATABASE "{name}"')
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
        "PREFECT_UI_ENABLED": "true" if ui else "false",
        "PREFECT_UI_API_URL": api,  # the UI's own calls: this server, not the default port
        "PREFECT_API_DATABASE_CONNECTION_URL": f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}",
    }
    log = home / "server.log"
    t0 = time.monotonic()
    try:
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        with started(cmd, server_env, log) as proc:
            wait_until_up(f"{api}/health", proc, log, 300, "prefect server")
            ui_url = api.removesuffix("/api") if ui else None
            yield {"env": env, "api": api, "ui": ui_url, "home": home, "start_s": time.monotonic() - t0}
    finally:
        pg_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def mlflow_ui(tracking_uri: str, log: Path) -> Iterator[str]:
    """`mlflow ui` on a store (one worker, no job runners); yields its URL."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri, "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]  # fmt: skip
    with started(cmd, env, log) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(f"{url}/health", proc, log, 120, "mlflow ui")
        yield url


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
