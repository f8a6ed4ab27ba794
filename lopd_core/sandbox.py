"""Run untrusted Python (dataset environments, check functions, generated code) in an isolated worker process.

The trainer never `exec`s dataset code. A `Sandbox` is a separate Python process that executes requests sent
over a pipe (one JSON line per request and per response) in one persistent namespace:

    with Sandbox(SandboxLimits(timeout_s=5)) as box:
        box.exec("def add(a, b):\\n    return a + b")
        box.call("add", 2, 3)            # SandboxResult(ok=True, value=5, ...)

    run_code("assert 1 + 1 == 2")        # one-shot: fresh worker, run, close
    call_function(source, "f", 1, 2)     # one-shot: define `source`, call `f(1, 2)`

The boundary is the operating system (`SandboxLimits.isolation = "bwrap"`, the default): the worker runs under
bubblewrap in its own user, mount, pid, network, ipc, uts and cgroup namespaces, as uid/gid 65534 (nobody), with
no capabilities and no_new_privs. Its filesystem is a read-only /usr (the shared libraries), a read-only view of
the interpreter's own prefix, a fresh /proc and /dev, and private size-limited tmpfs at /tmp (the working
directory, HOME and TMPDIR) and /dev/shm: nothing else of the host, so neither the project tree nor /root. There
is no network but a down loopback. A seccomp filter refuses process and thread creation (`max_processes=1`),
new namespaces, mounts, ptrace, keyctl, bpf and io_uring. The worker inherits fds 0-2 only. When the call ends
(`close`, a timeout, a crash) the namespace's first process is killed, which ends every process in it.

Inside the worker (`lopd_core.sandbox_worker`, shipped as text): rlimits (CPU seconds, address space, file
size, open files, no core dumps) and a Python audit hook reporting attempted writes outside the working
directory, process creation, signals, sockets and ctypes in `SandboxResult.violations`. That hook runs in the
untrusted process, so it is a second layer, never the verdict: graders that must not be fooled take only
plain data from a worker (`call(..., codec=True)`, see `lopd_core.evaluation.code`).

A machine without bubblewrap, or one that cannot create the namespaces, fails closed: `SandboxUnavailable`
says what to install. `isolation="none"` runs the worker as a plain child process (rlimits and the audit hook
only) and is for trusted code alone. Only the standard library is importable (`python -I -S`); modules in
`PRELOAD_MODULES` are imported before the code runs.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lopd_core import sandbox_worker
from lopd_core.sandbox_worker import decode, encode

# Modules the worker imports before the untrusted code runs.
PRELOAD_MODULES: tuple[str, ...] = (
    "abc", "array", "base64", "binascii", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "contextlib", "copy", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
    "functools", "glob", "hashlib", "heapq", "io", "itertools", "json", "keyword", "math", "numbers",
    "operator", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "statistics", "string", "struct",
    "tempfile", "textwrap", "time", "traceback", "types", "typing", "unicodedata", "uuid", "warnings",
    "weakref", "zlib",
)  # fmt: skip
ISOLATIONS = ("bwrap", "none")
SANDBOX_UID = 65534  # nobody, inside the user namespace
INSTALL_HINT = (
    "install bubblewrap (as root: apt-get install -y bubblewrap; `make venv` does it), or set the sandbox to "
    '"none" for trusted code only'
)


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock per request
    startup_timeout_s: float = 30.0  # wall clock for the worker to come up
    cpu_s: int = 120  # CPU seconds for the worker's whole life (RLIMIT_CPU)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the worker may write (RLIMIT_FSIZE)
    tmp_size_mb: int = 64  # size of the private /tmp and /dev/shm (bwrap)
    max_open_files: int = 64
    max_processes: int = 1  # 1 = no fork, no threads (the seccomp filter); larger values need isolation "none"
    max_output_chars: int = 20_000  # captured stdout/stderr kept per request
    max_response_bytes: int = 4 << 20  # a larger response is refused (reported as an error)
    network: bool = False  # True leaves networking alone (never needed by dataset code)
    isolation: str = "bwrap"  # "bwrap": OS namespaces (see the module docstring); "none": trusted code only
    audit_hook: bool = True  # the in-process second layer (the hostile battery turns it off to test the OS alone)

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(
                f"SandboxLimits.isolation must be one of {ISOLATIONS} ('none' for trusted code only), "
                f"got {self.isolation!r}"
            )
        if self.isolation == "bwrap" and (self.max_processes != 1 or self.network):
            raise ValueError("SandboxLimits.max_processes > 1 and network=True need isolation 'none'")


@dataclass
class SandboxResult:
    ok: bool
    value: Any = None
    error: str | None = None
    # "exception" (raised in the sandbox), "memory" (MemoryError), "timeout", "crash" (worker died),
    # "violation" (only from callers that treat violations as errors), "too_large", "start"
    error_type: str | None = None
    exc_type: str | None = None  # the exception's class name ("exception")
    traceback: str = ""
    stdout: str = ""
    violations: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def clean(self) -> bool:
        """Succeeded without attempting anything the sandbox forbids."""
        return self.ok and not self.violations

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SandboxInfo:
    pid: int  # the worker's process on the host (bwrap's monitor under bwrap): new after every restart
    uid: int  # the worker's uid as it sees it
    isolation: str  # "bwrap" | "none"
    workdir: str  # the working directory as the worker sees it


class SandboxError(RuntimeError):
    """The sandbox worker could not be started (reported as a failed request)."""


class SandboxUnavailable(RuntimeError):
    """The OS isolation cannot be had on this machine: nothing runs (raised, never a failed request)."""


# ---------------------------------------------------------------------------------------------- isolation

# Syscalls the seccomp filter refuses (EPERM; clone3 ENOSYS so that the C library falls back to clone):
# process and thread creation, new namespaces, mounts, tracing other processes, kernel keyrings, bpf, io_uring.
_DENIED_SYSCALLS = {
    # arch: (AUDIT_ARCH_*, {name: number})
    "x86_64": (0xC000003E, {
        "clone": 56, "fork": 57, "vfork": 58, "clone3": 435, "ptrace": 101, "unshare": 272, "setns": 308,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "keyctl": 250, "add_key": 248,
        "request_key": 249, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "process_vm_readv": 310, "process_vm_writev": 311,
    }),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "ptrace": 117, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
        "pivot_root": 41, "chroot": 51, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425, "process_vm_readv": 270,
        "process_vm_writev": 271,
    }),
}  # fmt: skip


def seccomp_filter(machine: str | None = None) -> bytes:
    """A classic-BPF seccomp program (what `bwrap --seccomp` reads) refusing `_DENIED_SYSCALLS`; another
    architecture's syscalls (and x32's) are refused too."""
    machine = machine or os.uname().machine
    if machine not in _DENIED_SYSCALLS:
        raise SandboxUnavailable(f"no seccomp filter for the {machine} architecture; {INSTALL_HINT}")
    arch, numbers = _DENIED_SYSCALLS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, errno, kill = 0x7FFF0000, 0x00050000, 0x80000000
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, errno | 1)]
    for name, nr in numbers.items():
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, errno | (38 if name == "clone3" else 1))]
    prog.append((ret, 0, 0, allow))
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _read_only_roots() -> list[str]:
    """Host directories the worker needs, read-only: /usr, and the interpreter's prefix (also when it lives
    somewhere else, e.g. under /root/.pyenv: then only that prefix, not its parents, becomes visible)."""
    roots = ["/usr"]
    exe = os.path.realpath(sys.executable)
    for path in (sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(exe))):
        real = os.path.realpath(path)
        if not any(real == r or real.startswith(r + os.sep) for r in roots):
            roots.append(real)
    return roots


def bwrap_command(limits: SandboxLimits, seccomp_fd: int, info_fd: int) -> list[str]:
    """The bubblewrap command line for one worker (the worker's own arguments follow it)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"the sandbox needs bubblewrap (`bwrap`), which is not installed: {INSTALL_HINT}")
    uid = str(SANDBOX_UID)
    cmd = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--uid", uid, "--gid", uid]
    cmd += ["--hostname", "sandbox", "--cap-drop", "ALL"] if os.geteuid() == 0 else ["--hostname", "sandbox"]
    for root in _read_only_roots():
        cmd += ["--ro-bind", root, root]
    for link in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(link):
            cmd += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            cmd += ["--ro-bind", link, link]
    size = ["--size", str(limits.tmp_size_mb << 20)] if _bwrap_has_size(bwrap) else []
    cmd += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm"]
    cmd += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += ["--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONHASHSEED", "0"]
    cmd += ["--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--"]
    return cmd


@functools.lru_cache(maxsize=4)
def _bwrap_has_size(bwrap: str) -> bool:
    """bubblewrap >= 0.8 bounds a tmpfs (`--size`); older ones (Ubuntu 22.04's 0.6) leave it to memory limits."""
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30, check=False)
    return "--size" in out.stdout + out.stderr


@functools.lru_cache(maxsize=1)
def check_isolation() -> str:
    """Start one trivial sandbox to prove that bwrap and the namespaces work here; raises SandboxUnavailable."""
    read, write = os.pipe()
    info_r, info_w = os.pipe()
    try:
        os.write(write, seccomp_filter())
        os.close(write)
        cmd = [*bwrap_command(SandboxLimits(), read, info_w), os.path.realpath(sys.executable), "-I", "-S", "-c", ""]
        proc = subprocess.run(cmd, pass_fds=(read, info_w), capture_output=True, timeout=30, check=False)
    finally:
        for fd in (read, info_w, info_r):
            try:
                os.close(fd)
            except OSError:
                pass
    if proc.returncode != 0:
        detail = proc.stderr.decode("utf-8", "replace").strip()[-500:]
        raise SandboxUnavailable(f"bubblewrap could not create the sandbox's namespaces ({detail}): {INSTALL_HINT}")
    return "bwrap"


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
