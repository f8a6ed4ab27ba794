"""Stopping safely: one SIGTERM or Ctrl-C stops a run within seconds, no orphaned stage, one writer per run directory.

* **One writer.** `RunDirLock(folder)` holds an exclusive `flock` on `folder/.lock` for as long as the process
  lives. A second `lopd run` / `lopd study` on the same run directory (or a second stage process on one stage
  directory) is refused with the holder's PID and command. The OS drops the lock when its holder dies, even by
  SIGKILL, so a lock is never stale: the next run simply takes it.
* **One stop, wherever the signal lands.** `request_stop()` is the stop: the flag `STOP` is set (no stage starts
  after it, none is retried, a stage waiting for a slot gives up), every live child stage gets SIGTERM, every stage
  running as another flow run (deployments) is cancelled, and a deadline is armed: if the process still lives
  `STOP_GRACE_S` later, the children are killed, the temporary Prefect server is stopped and the process exits.
  Who calls it:
  - the CLI's handler (`stop_on_signals`, SIGTERM and SIGINT), before any flow runs;
  - inside a flow, Prefect replaces the SIGTERM handler with its own bridge (it raises `TerminationSignal` in the
    main thread and marks the flow run Crashed); `stop_stages_on_sigterm()`, entered by every flow body, puts
    `request_stop` in front of that bridge, so the stages stop first, in the CLI, in a worker's flow-run process and
    in a Kubernetes pod alike;
  - `stopping_on_interrupt()` around the places a flow waits for its stages: any KeyboardInterrupt or
    TerminationSignal that reaches them (a Ctrl-C in a worker's process, say) stops the stages too.
  A second signal kills the children outright.
* **A clean record.** A stage cut by the stop ends with `Stopped`, a BaseException: Prefect marks its task run
  Crashed like the flow runs, never Failed, and MLflow marks its runs KILLED (`components.tracking`: any
  BaseException that is not an Exception); the CLI prints one line and exits 143 (SIGTERM) or 130 (Ctrl-C), with
  Prefect's API log handler detached first, so nothing logs into a shutting-down interpreter.
* **A child stage stops at once and never outlives its parent.** `as_child_stage()` (in `python -m flows.stages`)
  makes SIGTERM a KeyboardInterrupt: the current step is dropped; the last checkpoint was written atomically and a
  resume replays the dropped steps, logging each metric step once (components.tracking.sink). Linux's parent-death
  signal (PR_SET_PDEATHSIG) sends the child SIGTERM when its parent dies, however it dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PARENT_ENV = "LOPD_PARENT_PID"  # the parent's PID, given to a child stage (it checks that the parent still lives)
LOCK_FILE = ".lock"
STOP = threading.Event()  # set once a stop was asked for: no new stage starts, none is retried
_CHILDREN: set[subprocess.Popen[bytes]] = set()
_CHILDREN_LOCK = threading.RLock()  # re-entrant: a signal handler may run while its thread holds it
PR_SET_PDEATHSIG = 1


class RunDirBusy(RuntimeError):
    """Another live process writes to this directory."""


class Stopped(BaseException):
    """The run was asked to stop (SIGTERM or Ctrl-C); what finished is kept, the rest resumes on a rerun. A
    BaseException, like KeyboardInterrupt: not a failure, so Prefect records the cut stage as Crashed (never Failed,
    never retried) and MLflow its runs as KILLED."""


class RunDirLock:
    """An exclusive lock on `folder` for this process's lifetime (or until `release`): see the module docstring."""

    def __init__(self, folder: str | Path, what: str = "a run") -> None:
        self.folder = Path(folder)
        self.what = what
        self._fh: Any = None

    def acquire(self) -> RunDirLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        fh = open(path, "a+")  # noqa: SIM115 (held open: the lock lives as long as the file stays open)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise RunDirBusy(
                f"{self.folder} is in use by {holder}: one writer per directory. Wait for it to finish, stop it "
                f"(kill -TERM <pid>), or choose another run_dir"
            ) from None
        except OSError as exc:  # a file system without locks (some network mounts): warn, do not refuse to run
            fh.close()
            logging.getLogger(__name__).warning("%s: cannot lock (%s); one writer is not enforced here", path, exc)
            return self
        fh.seek(0)
        fh.truncate()
        command = " ".join(sys.argv)[:200]
        fh.write(f"PID {os.getpid()} ({self.what}: {command}), since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        fh.flush()
        self._fh = fh
        return self

    def release(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ------------------------------------------------------------------------------------ the parent: the CLI

STOP_GRACE_S = float(os.environ.get("LOPD_STOP_GRACE_S", "8"))  # a stop's deadline: then the process exits anyway
_STATE_LOCK = threading.RLock()
_STOP_SIGNAL: list[int] = []  # the signal of the first stop (SIGTERM, SIGINT), when one caused it
_REMOTE: dict[str, Callable[[], None]] = {}  # stages running as other flow runs: how to cancel each
_DEADLINE: dict[str, Any] = {}  # "message": what the CLI prints when the deadline ends the process


def _stop_children(sig: int) -> None:
    with _CHILDREN_LOCK:
        children = list(_CHILDREN)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sig)


def stop_signal() -> int | None:
    """The signal that stopped this run (None: no stop, or one without a signal)."""
    return _STOP_SIGNAL[0] if _STOP_SIGNAL else None


def exit_code(signum: int | None) -> int:
    """The shell's convention: 128 + the signal (143 for SIGTERM, 130 for Ctrl-C)."""
    return 128 + int(signum or signal.SIGINT)


def request_stop(signum: int | None = None, repeated_kills: bool = False) -> bool:
    """Stop the run (see the module docstring). Returns True for the first request. A repeated request with
    `repeated_kills` (a second signal) sends SIGKILL to the children."""
    with _STATE_LOCK:
        first = not STOP.is_set()
        if first:
            STOP.set()
            if signum is not None:
                _STOP_SIGNAL.append(int(signum))
    if not first:
        if repeated_kills:
            _stop_children(signal.SIGKILL)
        return False
    _stop_children(signal.SIGTERM)
    with _STATE_LOCK:
        cancels = list(_REMOTE.values())
    if cancels:  # API calls: never from inside a signal handler's frame
        threading.Thread(target=lambda: [_quietly(c) for c in cancels], name="lopd-cancel", daemon=True).start()
    timer = threading.Timer(STOP_GRACE_S, _deadline)
    timer.daemon = True
    timer.start()
    return True


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # a stop must not fail on a cancel that could not be sent
        logging.getLogger(__name__).warning("could not cancel a stage run: %s", exc)


@contextlib.contextmanager
def remote_stage(name: str, cancel: Callable[[], None]) -> Iterator[None]:
    """A stage running elsewhere (a deployment's flow run) for the duration of the block: a stop cancels it."""
    with _STATE_LOCK:
        _REMOTE[name] = cancel
    try:
        if STOP.is_set():
            _quietly(cancel)
            raise Stopped("the run is stopping: the stage run was cancelled")
        yield
    finally:
        with _STATE_LOCK:
            _REMOTE.pop(name, None)


def _deadline() -> None:
    """The stop's deadline passed and the process still lives: kill the children, stop the temporary Prefect
    server, say so once, exit."""
    _stop_children(signal.SIGKILL)
    quiet_prefect_logs()
    stop_temporary_servers()
    message = _DEADLINE.get("message")
    late = f"stopped: the process did not end within {STOP_GRACE_S:.0f} s of the stop"
    text = message() if callable(message) else late
    with contextlib.suppress(Exception):
        sys.stderr.write(f"error: {text}\n")
        sys.stderr.flush()
        sys.stdout.flush()
    os._exit(exit_code(stop_signal()))


def stop_temporary_servers() -> None:
    """Stop the temporary Prefect server this process started (Prefect stops it at exit; a forced exit skips that)."""
    try:
        from prefect.server.api.server import SubprocessASGIServer
    except Exception:  # pragma: no cover - Prefect is a dependency
        return
    for server in list(SubprocessASGIServer._instances.values()):
        with contextlib.suppress(Exception):
            server.stop()


def quiet_prefect_logs() -> None:
    """Detach Prefect's API log handler everywhere: after a stop, a record sent to the API from a shutting-down
    interpreter fails with a traceback per record ("--- Logging error ---")."""
    try:
        from prefect.logging.handlers import APILogHandler
    except Exception:  # pragma: no cover - Prefect is a dependency
        return
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for h in list(lg.handlers):
            if isinstance(h, APILogHandler):
                lg.removeHandler(h)


@contextlib.contextmanager
def stop_on_signals(message: Callable[[], str] | None = None) -> Iterator[None]:
    """The CLI: SIGTERM and SIGINT stop the run (`request_stop`) and raise KeyboardInterrupt here; a second
    signal sends SIGKILL to the children. `message` is the line printed if the stop's deadline ends the process.
    The previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    STOP.clear()
    _STOP_SIGNAL.clear()
    _DEADLINE["message"] = message

    def handler(signum: int, frame: Any) -> None:
        if request_stop(signum, repeated_kills=True):
            raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def stop_stages_on_sigterm() -> Iterator[None]:
    """Entered by every flow body: SIGTERM stops the stages first (`request_stop`), then goes on to the handler it
    found, Prefect's bridge, which raises TerminationSignal in the main thread and records the flow run as Crashed.
    Prefect installs that bridge when a flow starts, in front of the CLI's handler, so without this a SIGTERM never
    reached the stages, and the flow waited for every running stage to end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum: int, frame: Any) -> None:
        request_stop(signum, repeated_kills=True)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def stopping_on_interrupt() -> Iterator[None]:
    """Around a wait for stages: an interrupt that reaches it (KeyboardInterrupt, Prefect's TerminationSignal, a
    `Stopped`) stops the run's stages too, then goes on up."""
    try:
        yield
    except Exception:
        raise
    except BaseException as exc:
        signum = signal.SIGTERM if type(exc).__name__ == "TerminationSignal" else None
        if isinstance(exc, KeyboardInterrupt):
            signum = signal.SIGINT if not str(exc).startswith("SIGTERM") else signal.SIGTERM
        request_stop(signum)
        raise


def fast_exit() -> None:
    """A stopped process's exit without the seconds of garbage collection the interpreter's finalisation spends on a
    large heap (2-3 s for a stage holding a model): everything alive now moves to the permanent generation. What
    the stop must close (MLflow runs, locks, sandboxes) was closed by the with-blocks on the way out."""
    import gc

    gc.freeze()


def run_child(command: list[str], log: Any, env: dict[str, str]) -> int:
    """Run a child stage to its end and return its exit code; registered so that a stop reaches it. Refuses to
    start once a stop was asked for (a stage that ended non-zero during a stop: `Stopped`, see `check_stopped`)."""
    with _CHILDREN_LOCK:  # checked and registered at once: a stop either sees this child or stops it starting
        if STOP.is_set():
            raise Stopped("the run is stopping: no new stage starts")
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**env, PARENT_ENV: str(os.getpid())}
        )
        _CHILDREN.add(child)
    try:
        while True:
            try:
                return child.wait()
            except Exception:
                raise
            except BaseException as exc:  # this thread is the main one: the stop reached the child too; wait for it
                request_stop(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(child)


# ------------------------------------------------------------------------------------ the child: one stage


def _die_with_parent() -> None:
    """Linux: SIGTERM to this process when its parent dies (even by SIGKILL); if it already died, stop now."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    expected = os.environ.get(PARENT_ENV)
    if expected and os.getppid() != int(expected):  # the parent died before the prctl above
        raise SystemExit(f"the parent process {expected} is gone: not starting")


def as_child_stage() -> None:
    """Call first in a child stage process: SIGTERM is a KeyboardInterrupt (the current step is dropped and the
    with-blocks close: bank lock, rollout engine, MLflow run), and the child dies with its parent."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    _die_with_parent()


def check_stopped(what: str, code: int) -> None:
    """A child that ended non-zero while the run was stopping was stopped, not failed: `Stopped`, never retried."""
    if code != 0 and STOP.is_set():
        raise Stopped(f"{what} was stopped (exit code {code}); its last checkpoint is kept")
