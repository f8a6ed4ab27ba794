"""Run untrusted Python (dataset environments, check functions, generated code) in a limited worker process.

The trainer never `exec`s dataset code. A `Sandbox` is a separate Python process that executes requests sent
over a private pipe (one JSON line per request and per response) in one persistent namespace:

    with Sandbox(SandboxLimits(timeout_s=5)) as box:
        box.exec("def add(a, b):\\n    return a + b")
        box.call("add", 2, 3)            # SandboxResult(ok=True, value=5, ...)

    run_code("assert 1 + 1 == 2")        # one-shot: fresh worker, run, close (e.g. a HumanEval program)
    call_function(source, "f", 1, 2)     # one-shot: define `source`, call `f(1, 2)`

Layers of containment, outermost first:

* a wall-clock timeout per request, enforced by the parent: on expiry the worker's whole process group is
  killed (SIGKILL) and the result says "timeout"; the next request starts a fresh worker;
* resource limits set in the worker before any untrusted code runs: CPU seconds (RLIMIT_CPU), address
  space (RLIMIT_AS, so a huge allocation raises MemoryError), file size (RLIMIT_FSIZE), open files, no
  core dumps, and a process count (RLIMIT_NPROC);
* a fresh temporary working directory (also HOME and TMPDIR), removed on close;
* started by root, the worker moves to a new network namespace (unshare(CLONE_NEWNET) through ctypes: no
  interface but a down loopback) and then drops to an unprivileged uid of its own (so RLIMIT_NPROC = 1
  forbids fork and threads, and the OS refuses writes outside world-writable places). Started by another
  user it tries a user+network namespace; where that fails, networking is only blocked by the audit hook
  below (`SandboxInfo.network` says which);
* a Python audit hook (PEP 578; it cannot be removed once installed) that refuses: writes, renames and
  deletions outside the working directory, process creation (fork, exec, spawn, subprocess, os.system),
  signals to other processes, sockets, ctypes and sqlite files outside the directory. A refused operation
  raises PermissionError inside the worker *and* is reported in `SandboxResult.violations`, even when the
  code catches the exception, so callers can fail the request regardless of what the code returned.

The audit hook is a Python-level guard, not a security boundary against native code; the OS layers are.
Modules are preloaded before privileges are dropped (the interpreter's own files may not be readable by
the unprivileged uid); other imports may fail with ModuleNotFoundError inside the sandbox. Only the
standard library is importable (the worker runs with `python -I -S`).
"""

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Modules the worker imports before it drops privileges, so sandboxed code can import them afterwards.
PRELOAD_MODULES: tuple[str, ...] = (
    "abc", "array", "base64", "binascii", "bisect", "calendar", "cmath", "collections", "collections.abc",
    "contextlib", "copy", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
    "functools", "glob", "hashlib", "heapq", "io", "itertools", "json", "keyword", "math", "numbers",
    "operator", "pathlib", "pickle", "pprint", "queue", "random", "re", "shutil", "statistics", "string", "struct",
    "tempfile", "textwrap", "time", "traceback", "types", "typing", "unicodedata", "uuid", "warnings",
    "weakref", "zlib",
)  # fmt: skip

# Unprivileged uids for workers started by root: a fresh uid per worker (base + worker pid), so that
# RLIMIT_NPROC counts only that worker's processes. The range is far above any real account.
SANDBOX_UID_BASE = 1_700_000_000


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock per request
    startup_timeout_s: float = 30.0  # wall clock for the worker to come up
    cpu_s: int = 120  # CPU seconds for the worker's whole life (RLIMIT_CPU)
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_size_mb: int = 16  # largest file the worker may write (RLIMIT_FSIZE)
    max_open_files: int = 64
    max_processes: int = 1  # processes/threads for the sandbox uid (1 = no fork, no threads)
    max_output_chars: int = 20_000  # captured stdout/stderr kept per request
    max_response_bytes: int = 4 << 20  # a larger response is refused (reported as an error)
    network: bool = False  # True leaves networking alone (never needed by dataset code)
    drop_privileges: bool = True  # as root: run under a fresh unprivileged uid


@dataclass
class SandboxResult:
    ok: bool
    value: Any = None
    error: str | None = None
    # "exception" (raised in the sandbox), "memory" (MemoryError), "timeout", "crash" (worker died),
    # "violation" (only from callers that treat violations as errors), "too_large", "start"
    error_type: str | None = None
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
    pid: int
    uid: int
    network: str  # "netns" | "userns+netns" | "audit-hook" | "allowed"
    workdir: str
    nproc_limit: int


class SandboxError(RuntimeError):
    """The sandbox could not be started."""


# The worker program. It is trusted code (ours) running in the untrusted process; it is passed with `-c`
# so the worker needs no access to this package. argv[1] is a JSON configuration.
_WORKER = r"""
import builtins, sys, os, json, io, contextlib, traceback, resource
cfg = json.loads(sys.argv[1])
req_fd, resp_fd = os.dup(0), os.dup(1)
_null = os.open(os.devnull, os.O_RDWR)
os.dup2(_null, 0); os.dup2(_null, 1)
workdir = os.path.realpath(cfg["workdir"])
os.environ.update(HOME=workdir, TMPDIR=workdir, TMP=workdir, TEMP=workdir)
network = "allowed"
if not cfg["network"]:
    network = "audit-hook"
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if os.geteuid() == 0:
            if libc.unshare(0x40000000) == 0:
                network = "netns"
        else:
            uid, gid = os.getuid(), os.getgid()
            if libc.unshare(0x10000000 | 0x40000000) == 0:
                for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as fh:
                        fh.write(text)
                network = "userns+netns"
        del libc
    except Exception:
        pass
for _name in cfg["preload"]:
    try:
        __import__(_name)
    except Exception:
        pass
def _limit(res, value):
    soft, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY and value > hard:
        value = hard
    resource.setrlimit(res, (value, value))
_limit(resource.RLIMIT_CORE, 0)
_limit(resource.RLIMIT_CPU, cfg["cpu_s"])
_limit(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
_limit(resource.RLIMIT_FSIZE, cfg["file_size_mb"] << 20)
_limit(resource.RLIMIT_NOFILE, cfg["max_open_files"])
uid = os.getuid()
if os.geteuid() == 0 and cfg["uid"] is not None:
    _limit(resource.RLIMIT_NPROC, cfg["max_processes"])
    os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
    uid = cfg["uid"]
else:
    _limit(resource.RLIMIT_NPROC, cfg["nproc_other"] + cfg["max_processes"])
os.chdir(workdir)
for _name in ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "socket", "_socket"):
    sys.modules.pop(_name, None)

violations = []
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1, "os.truncate": 1,
    "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.setxattr": 1, "os.removexattr": 1, "os.chflags": 1,
    "os.lchflags": 1, "os.lchmod": 1, "os.mkfifo": 1, "os.mknod": 1, "shutil.rmtree": 1, "shutil.chown": 1,
    "shutil.copyfile": 2, "shutil.copymode": 2, "shutil.copystat": 2, "shutil.copytree": 2, "shutil.move": 2,
    "shutil.make_archive": 1, "shutil.unpack_archive": 2,
}
_BLOCKED = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
    "os.kill", "os.killpg", "subprocess.Popen", "pty.spawn", "resource.prlimit", "sys.remote_exec",
}
_BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing"}
_PREFIX_BLOCKED = ("ctypes.",) + (() if cfg["network"] else ("socket.",))

def _inside(path):
    if isinstance(path, int):
        return True
    try:
        path = os.fsdecode(path)
    except Exception:
        return False
    if path == os.devnull:
        return True
    real = os.path.realpath(os.path.join(workdir, path))
    return real == workdir or real.startswith(workdir + os.sep)

def _deny(what):
    violations.append(what[:300])
    raise PermissionError("sandbox: " + what[:300])

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _W)
        if path is not None and writing and not _inside(path):
            _deny(f"write outside the sandbox directory: {path!r}")
    elif event in _PATH_EVENTS:
        for path in args[: _PATH_EVENTS[event]]:
            if path is not None and not _inside(path):
                _deny(f"{event} outside the sandbox directory: {path!r}")
    elif event in _BLOCKED or event.startswith(_PREFIX_BLOCKED):
        _deny(f"{event} is not allowed")
    elif event == "import" and args[0] in _BLOCKED_IMPORTS:
        _deny(f"import {args[0]} is not allowed")
    elif event == "sqlite3.connect" and args and args[0] not in (":memory:", b":memory:", "") and not _inside(args[0]):
        _deny(f"sqlite database outside the sandbox directory: {args[0]!r}")

sys.addaudithook(_hook)

def _send(obj):
    try:
        data = json.dumps(obj, default=repr)
    except Exception as exc:
        data = json.dumps({"ok": False, "error_type": "exception", "error": f"unserialisable result: {exc!r}"[:2000],
                           "violations": obj.get("violations", [])})
    data = data.encode("utf-8", "replace")
    if len(data) > cfg["max_response_bytes"]:
        data = json.dumps({"ok": False, "error_type": "too_large", "violations": obj.get("violations", []),
                           "error": f"result of {len(data)} bytes exceeds {cfg['max_response_bytes']}"}).encode()
    data += b"\n"
    while data:
        data = data[os.write(resp_fd, data):]

_send({"ready": True, "pid": os.getpid(), "uid": uid, "network": network,
       "nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0]})
ns = {"__name__": "__sandbox__", "__builtins__": __builtins__}
reader = io.open(req_fd, "rb")
while True:
    line = reader.readline()
    if not line:
        break
    req = json.loads(line)
    del violations[:]
    out = io.StringIO()
    resp = {"ok": True, "value": None}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if req["op"] == "exec":
                exec(compile(req["code"], req.get("filename", "<sandbox>"), "exec"), ns)
            elif req["op"] == "call":
                head = req["name"].split(".")[0]
                target = ns[head] if head in ns else getattr(builtins, head)
                for attr in req["name"].split(".")[1:]:
                    target = getattr(target, attr)
                resp["value"] = target(*req.get("args", []), **req.get("kwargs", {}))
            else:
                raise ValueError(f"unknown op {req['op']!r}")
    except BaseException as exc:
        resp = {"ok": False, "error_type": "memory" if isinstance(exc, MemoryError) else "exception",
                "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc(limit=-8)[-4000:]}
    resp["violations"] = list(violations)
    resp["stdout"] = out.getvalue()[-cfg["max_output_chars"]:]
    del out
    _send(resp)
"""


def _count_user_tasks(uid: int) -> int:
    """Threads currently running under `uid` (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            total += int(fields.get("Threads", "1").strip() or 1)
    return total


class Sandbox:
    """A persistent worker process running untrusted Python under limits; restarted after a timeout or crash.

    `exec` adds code to the worker's namespace; `call` calls a (dotted) name from it with JSON-able arguments
    and returns the JSON-able result (other values come back as their repr). State lives in the worker: after
    a timeout or crash the namespace is gone (`restarts` counts how often that happened).
    """

    def __init__(self, limits: SandboxLimits | None = None, python: str | None = None) -> None:
        self.limits = limits or SandboxLimits()
        self.python = python or sys.executable
        self.info: SandboxInfo | None = None
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: str | None = None
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
        """Start the worker without waiting for it (the first request waits); lets callers overlap start-ups."""
        if self.alive:
            return
        self._kill()
        self._cleanup()
        self.info = None
        lim = self.limits
        self._workdir = tempfile.mkdtemp(prefix="lopd-sandbox-")
        as_root = os.geteuid() == 0 and lim.drop_privileges
        nproc_other = 0 if as_root else _count_user_tasks(os.getuid())
        stderr_path = os.path.join(self._workdir, ".stderr")
        stderr = open(stderr_path, "wb")  # noqa: SIM115 - handed to the child, closed below
        cfg = {
            "workdir": self._workdir,
            "network": lim.network,
            "preload": list(PRELOAD_MODULES),
            "cpu_s": lim.cpu_s,
            "memory_mb": lim.memory_mb,
            "file_size_mb": lim.file_size_mb,
            "max_open_files": lim.max_open_files,
            "max_processes": lim.max_processes,
            "nproc_other": nproc_other,
            "max_output_chars": lim.max_output_chars,
            "max_response_bytes": lim.max_response_bytes,
            "uid": None,
        }
        try:
            # The uid depends on the child's pid, which is known only after the start: the child learns it
            # through its configuration, so it is started through a tiny trusted shim reading it from stdin.
            self._proc = subprocess.Popen(
                [self.python, "-I", "-S", "-c", _SHIM],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                cwd=self._workdir,
                start_new_session=True,
                close_fds=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
            )
        finally:
            stderr.close()
        if as_root:
            cfg["uid"] = SANDBOX_UID_BASE + self._proc.pid
            os.chown(self._workdir, cfg["uid"], cfg["uid"])
            os.chown(stderr_path, cfg["uid"], cfg["uid"])
        self._buffer = b""
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write((_WORKER + "\0" + json.dumps(cfg) + "\n").encode())
            self._proc.stdin.flush()
        except OSError:
            pass

    def _wait_ready(self) -> SandboxInfo:
        ready = self._read_line(self.limits.startup_timeout_s)
        if not isinstance(ready, dict) or not ready.get("ready"):
            detail = self._stderr_tail()
            self._kill()
            raise SandboxError(f"sandbox worker failed to start ({ready!r}): {detail}")
        assert self._workdir is not None
        self.info = SandboxInfo(
            pid=ready["pid"],
            uid=ready["uid"],
            network=ready["network"],
            workdir=self._workdir,
            nproc_limit=ready["nproc"],
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

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.kill()
        except OSError:
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

    def _cleanup(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _stderr_tail(self, n: int = 2000) -> str:
        if self._workdir is None:
            return ""
        try:
            return Path(self._workdir, ".stderr").read_bytes()[-n:].decode("utf-8", "replace")
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
            return json.loads(line)
        except json.JSONDecodeError:
            return "garbled"

    def _request(self, req: dict[str, Any], timeout: float | None) -> SandboxResult:
        t0 = time.monotonic()
        try:
            self.start()
        except SandboxError as exc:
            return SandboxResult(ok=False, error=str(exc), error_type="start", duration_s=time.monotonic() - t0)
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(req, default=repr) + "\n").encode())
            self._proc.stdin.flush()
            resp = self._read_line(self.limits.timeout_s if timeout is None else timeout)
        except OSError:
            resp = "eof"
        duration = time.monotonic() - t0
        if isinstance(resp, dict):
            return SandboxResult(
                ok=bool(resp.get("ok")),
                value=resp.get("value"),
                error=resp.get("error"),
                error_type=resp.get("error_type"),
                traceback=resp.get("traceback", ""),
                stdout=resp.get("stdout", ""),
                violations=list(resp.get("violations", [])),
                duration_s=duration,
            )
        # timeout, crash or a garbled/oversized answer: the worker is unusable, kill it (state is lost).
        proc = self._proc
        self._kill()
        code = proc.returncode
        self.restarts += 1
        if resp == "timeout":
            error = f"timed out after {self.limits.timeout_s if timeout is None else timeout:.1f} s"
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

    def exec(self, code: str, timeout: float | None = None, filename: str = "<sandbox>") -> SandboxResult:
        """Execute `code` in the worker's namespace."""
        return self._request({"op": "exec", "code": code, "filename": filename}, timeout)

    def call(self, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> SandboxResult:
        """Call `name` (a dotted path in the namespace) with JSON-able arguments; the result is JSON-able."""
        return self._request({"op": "call", "name": name, "args": list(args), "kwargs": kwargs}, timeout)


# Reads the worker program and its configuration from stdin (separated by NUL), then runs it. Keeps argv
# short and lets the parent pick the unprivileged uid after the child's pid is known.
_SHIM = (
    "import sys\n"
    "data = b''\n"
    "while b'\\0' not in data or not data.split(b'\\0', 1)[1].endswith(b'\\n'):\n"
    "    chunk = sys.stdin.buffer.raw.read(1 << 16)\n"
    "    if not chunk: raise SystemExit(3)\n"
    "    data += chunk\n"
    "code, cfg = data.decode().split('\\0', 1)\n"
    "sys.argv = ['sandbox', cfg.strip()]\n"
    "exec(compile(code, '<sandbox-worker>', 'exec'), {'__name__': '__sandbox_worker__'})\n"
)


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
