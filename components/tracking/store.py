"""The tracking store: where it is (URI resolution, redaction), whether it answers (reachability, retries of
transient errors), a half-initialised sqlite file, and the client connection."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from components.tracking.names import (
    DEFAULT_DB,
    GIT_SHA_ENV,
    TRACKING_URI_ENV,
    T,
    TrackingError,
    TrackingUnavailableError,
)

logger = logging.getLogger(__name__)

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
