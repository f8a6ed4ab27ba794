"""`Sandbox`: the host side of one worker process running untrusted Python (start under the isolation, requests
and responses over the pipe, callbacks, timeouts, kill and restart), and the one-shot helpers `run_code` and
`call_function`. The worker program itself is `lopd_core.sandbox_worker`, shipped to the process as text."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lopd_core import sandbox_worker
from lopd_core.sandbox.config import PRELOAD_MODULES, SandboxError, SandboxInfo, SandboxLimits, SandboxResult
from lopd_core.sandbox.isolation import bwrap_command, check_isolation, seccomp_filter
from lopd_core.sandbox_worker import decode, encode


class Sandbox:
    """A persistent worker process running untrusted Python under limits; restarted after a timeout or crash.

    `exec` adds code to the worker's namespace; `call` calls a (dotted) name from it with JSON-able arguments
    and returns the JSON-able result (other values come back as their repr), or, with `codec=True`, plain data
    both ways (`sandbox_worker.encode`: tuples, sets, bytes survive; other objects are an error). State lives in
    the worker: after a timeout or crash the namespace is gone (`restarts` counts how often that happened).
    """

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.python = python or sys.executable
        self.info: SandboxInfo | None = None
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._hostdir: str | None = None  # the parent's scratch directory (stderr; the workdir under "none")
        self._info_fd: int | None = None
        self._child_pid: int | None = None  # bwrap's first process in the namespace (host pid)
        self._buffer = b""

    # ------------------------------------------------------------------------------------------- lifecycle

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> SandboxInfo:
        """Start the worker (if needed) and wait until it is ready."""
        if self.alive and self.info is not None:
            return self.info
        if not self.alive:
            self.spawn()
        return self._wait_ready()

    def spawn(self) -> None:
        """Start the worker without waiting for it (the first request waits); lets callers overlap start-ups.
        Raises SandboxUnavailable when the isolation cannot be had."""
        if self.alive:
            return
        self._kill()
        self._cleanup()
        self.info = None
        lim = self.limits
        isolated = lim.isolation == "bwrap"
        if isolated:
            check_isolation()
        self._hostdir = tempfile.mkdtemp(prefix="lopd-sandbox-")
        cfg = {
            "workdir": "/tmp" if isolated else self._hostdir,
            "network": lim.network,
            "audit_hook": lim.audit_hook,
            "preload": list(PRELOAD_MODULES),
            "cpu_s": lim.cpu_s,
            "memory_mb": lim.memory_mb,
            "file_size_mb": lim.file_size_mb,
            "max_open_files": lim.max_open_files,
            "max_output_chars": lim.max_output_chars,
            "max_response_bytes": lim.max_response_bytes,
        }
        python = os.path.realpath(self.python)
        argv = [python, "-I", "-S", "-c", _WORKER_SOURCE, json.dumps(cfg)]
        fds: tuple[int, ...] = ()
        if isolated:
            seccomp_r, seccomp_w = os.pipe()
            os.write(seccomp_w, seccomp_filter())
            os.close(seccomp_w)
            self._info_fd, info_w = os.pipe()
            fds = (seccomp_r, info_w)
            argv = bwrap_command(lim, seccomp_r, info_w) + argv
        stderr = open(os.path.join(self._hostdir, ".stderr"), "wb")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=self._hostdir,
                start_new_session=True,
                close_fds=True,
                pass_fds=fds,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
            )
        finally:
            stderr.close()
            for fd in fds:
                os.close(fd)
        self._buffer = b""

    def _wait_ready(self) -> SandboxInfo:
        ready = self._read_line(self.limits.startup_timeout_s)
        if not isinstance(ready, dict) or not ready.get("ready"):
            detail = self._stderr_tail()
            self._kill()
            raise SandboxError(f"sandbox worker failed to start ({ready!r}): {detail}")
        assert self._proc is not None
        self.info = SandboxInfo(
            pid=self._proc.pid,
            uid=ready["uid"],
            isolation=self.limits.isolation,
            workdir="/tmp" if self.limits.isolation == "bwrap" else str(self._hostdir),
        )
        return self.info

    def close(self) -> None:
        self._kill()
        self._cleanup()

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _namespace_pid(self) -> int | None:
        """The host pid of the namespace's first process, from bwrap's --info-fd (None if not yet written)."""
        if self._child_pid is None and self._info_fd is not None:
            ready, _, _ = select.select([self._info_fd], [], [], 0.5)
            if ready:
                try:
                    self._child_pid = int(json.loads(os.read(self._info_fd, 1 << 16))["child-pid"])
                except (OSError, ValueError, KeyError, TypeError):
                    pass
        return self._child_pid

    def _kill(self) -> None:
        """End the worker and everything it started: killing the pid namespace's first process makes the
        kernel kill the rest; bwrap's monitor exits once that process is gone, so after the wait none is left."""
        proc, self._proc = self._proc, None
        if proc is not None:
            child = self._namespace_pid() if proc.poll() is None else None
            for pid in (child, proc.pid):
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL) if pid == child else os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    if pid == child:
                        try:
                            proc.wait(timeout=5)  # the monitor reaps the namespace's first process, then exits
                        except subprocess.TimeoutExpired:
                            pass
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._info_fd is not None:
            os.close(self._info_fd)
        self._info_fd = self._child_pid = None

    def _cleanup(self) -> None:
        if self._hostdir is not None:
            shutil.rmtree(self._hostdir, ignore_errors=True)
            self._hostdir = None

    def _stderr_tail(self, n: int = 2000) -> str:
        if self._hostdir is None:
            return ""
        try:
            return Path(self._hostdir, ".stderr").read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    # ------------------------------------------------------------------------------------------- protocol

    def _read_line(self, timeout: float) -> dict[str, Any] | str:
        """The next response line as a dict, or "timeout" / "eof" / "too_large"."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                return "timeout"
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "eof"
            self._buffer += chunk
            if len(self._buffer) > self.limits.max_response_bytes + 4096:
                return "too_large"
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):
            return "garbled"
        return obj if isinstance(obj, dict) else "garbled"

    def _request(
        self,
        req: dict[str, Any],
        timeout: float | None,
        serve: Callable[[str, list[Any]], dict[str, Any]] | None = None,
    ) -> SandboxResult:
        t0 = time.monotonic()
        try:
            self.start()
        except SandboxError as exc:
            return SandboxResult(ok=False, error=str(exc), error_type="start", duration_s=time.monotonic() - t0)
        assert self._proc is not None and self._proc.stdin is not None
        limit = self.limits.timeout_s if timeout is None else timeout
        deadline = t0 + limit
        try:
            self._write(req)
            while True:
                resp = self._read_line(deadline - time.monotonic())
                if not (isinstance(resp, dict) and "callback" in resp):
                    break
                if serve is None:  # a callback nobody asked for: the worker is off the protocol
                    resp = "garbled"
                    break
                try:
                    reply = serve(str(resp["callback"]), decode(resp.get("args", [])))
                except (TypeError, ValueError) as exc:
                    reply = {"ok": False, "exc_type": "TypeError", "error": f"arguments are not plain data: {exc}"}
                self._write(reply)
        except OSError:
            resp = "eof"
        duration = time.monotonic() - t0
        if isinstance(resp, dict):
            value = resp.get("value")
            if req.get("codec") and resp.get("ok"):
                try:
                    value = decode(value)
                except (TypeError, ValueError, RecursionError) as exc:
                    resp = {"ok": False, "error_type": "exception", "exc_type": "TypeError", "error": f"{exc}"}
            return SandboxResult(
                ok=bool(resp.get("ok")),
                value=value if resp.get("ok") else None,
                error=resp.get("error"),
                error_type=resp.get("error_type"),
                exc_type=resp.get("exc_type"),
                traceback=str(resp.get("traceback", "")),
                stdout=str(resp.get("stdout", "")),
                violations=[str(v) for v in resp.get("violations", [])],
                duration_s=duration,
            )
        # timeout, crash or a garbled/oversized answer: the worker is unusable, kill it (state is lost).
        proc = self._proc
        self._kill()
        code = proc.returncode
        self.restarts += 1
        if resp == "timeout":
            error = f"timed out after {limit:.1f} s"
            kind = "timeout"
        elif resp == "eof":
            if code is not None and code < 0:
                name = signal.Signals(-code).name
                hint = " (CPU time limit)" if name == "SIGXCPU" else ""
                error = f"worker killed by {name}{hint}"
            else:
                error = f"worker exited with code {code}"
            tail = self._stderr_tail(500).strip()
            error = f"{error}: {tail}" if tail else error
            kind = "crash"
        else:
            error, kind = f"worker sent an unusable response ({resp})", "too_large" if resp == "too_large" else "crash"
        return SandboxResult(ok=False, error=error, error_type=kind, duration_s=duration)

    def _write(self, obj: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(obj, default=repr) + "\n").encode())
        self._proc.stdin.flush()

    def exec(
        self,
        code: str,
        timeout: float | None = None,
        filename: str = "<sandbox>",
        serve: Callable[[str, list[Any]], dict[str, Any]] | None = None,
    ) -> SandboxResult:
        """Execute `code` in the worker's namespace. `serve(name, args)` answers the code's calls of
        `_lopd_remote(name)(*args)` (plain data both ways) with {"ok", "value"} or {"ok": False, "exc_type",
        "error"}; the calls share the request's timeout."""
        return self._request({"op": "exec", "code": code, "filename": filename}, timeout, serve)

    def call(
        self, name: str, *args: Any, timeout: float | None = None, codec: bool = False, **kwargs: Any
    ) -> SandboxResult:
        """Call `name` (a dotted path in the namespace); JSON-able arguments and result, or plain data both ways
        with `codec=True` (a result that is not plain data is an error)."""
        if codec:
            req = {"op": "call", "name": name, "args": encode(list(args)), "kwargs": encode(kwargs), "codec": True}
        else:
            req = {"op": "call", "name": name, "args": list(args), "kwargs": kwargs}
        return self._request(req, timeout)

    def map(self, name: str, arg_lists: list[list[Any]], timeout: float | None = None) -> SandboxResult:
        """Call `name` once per argument list (each on a fresh copy); plain data both ways; value: the results."""
        req = {"op": "map", "name": name, "args": encode([list(a) for a in arg_lists]), "codec": True}
        return self._request(req, timeout)


def run_code(code: str, limits: SandboxLimits | None = None, timeout: float | None = None) -> SandboxResult:
    """Run a program once in a fresh worker (e.g. a HumanEval completion plus its tests)."""
    with Sandbox(limits) as box:
        return box.exec(code, timeout=timeout, filename="<program>")


def call_function(
    source: str,
    name: str,
    *args: Any,
    limits: SandboxLimits | None = None,
    timeout: float | None = None,
    **kwargs: Any,
) -> SandboxResult:
    """Define `source` in a fresh worker and call `name(*args, **kwargs)` there."""
    with Sandbox(limits) as box:
        defined = box.exec(source, timeout=timeout, filename="<source>")
        if not defined.ok:
            return defined
        result = box.call(name, *args, timeout=timeout, **kwargs)
        result.violations = defined.violations + result.violations
        return result


# The worker program, shipped as text (the worker cannot import this package).
_WORKER_SOURCE = Path(sandbox_worker.__file__).read_text(encoding="utf-8")
