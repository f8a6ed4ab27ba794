"""Stopping safely: a prompt stop on SIGTERM or Ctrl-C, no orphaned stage, one writer per run directory.

* **One writer.** `RunDirLock(folder)` holds an exclusive `flock` on `folder/.lock` for as long as the process
  lives. A second `lopd run` / `lopd study` on the same run directory (or a second stage process on one stage
  directory) is refused with the holder's PID and command. The OS drops the lock when its holder dies, even by
  SIGKILL, so a lock is never stale: the next run simply takes it.
* **A prompt stop.** `stop_on_signals()` (the CLI) turns SIGTERM into the same stop as Ctrl-C: the stop flag is
  set, every live child stage gets SIGTERM, and the main thread gets KeyboardInterrupt. No new stage starts after
  that, and a stage that ended because of the stop is not retried. A second signal kills the children outright.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PARENT_ENV = "LOPD_PARENT_PID"  # the parent's PID, given to a child stage (it checks that the parent still lives)
LOCK_FILE = ".lock"
STOP = threading.Event()  # set once a stop was asked for: no new stage starts, none is retried
_CHILDREN: set[subprocess.Popen[bytes]] = set()
_CHILDREN_LOCK = threading.Lock()
PR_SET_PDEATHSIG = 1


class RunDirBusy(RuntimeError):
    """Another live process writes to this directory."""


class Stopped(RuntimeError):
    """The run was asked to stop (SIGTERM or Ctrl-C); what finished is kept, the rest resumes on a rerun."""


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


def _stop_children(sig: int) -> None:
    with _CHILDREN_LOCK:
        children = list(_CHILDREN)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(sig)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT stop the run: the stop flag, SIGTERM to every child stage, KeyboardInterrupt here; a
    second signal sends SIGKILL to the children. The previous handlers come back on exit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    STOP.clear()

    def handler(signum: int, frame: Any) -> None:
        if STOP.is_set():  # a second signal: no more waiting
            _stop_children(signal.SIGKILL)
            return
        STOP.set()
        _stop_children(signal.SIGTERM)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_child(command: list[str], log: Any, env: dict[str, str]) -> int:
    """Run a child stage to its end and return its exit code; registered so that a stop reaches it. Refuses to
    start once a stop was asked for (a stage that ended non-zero during a stop: `Stopped`, see `check_stopped`)."""
    if STOP.is_set():
        raise Stopped("the run is stopping: no new stage starts")
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**env, PARENT_ENV: str(os.getpid())})
    with _CHILDREN_LOCK:
        _CHILDREN.add(child)
    try:
        while True:
            try:
                return child.wait()
            except KeyboardInterrupt:  # this thread is the main one: the stop reached the child too; wait for it
                STOP.set()
                _stop_children(signal.SIGTERM)
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
