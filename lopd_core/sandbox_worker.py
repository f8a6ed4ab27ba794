"""The sandbox worker: our trusted code that runs inside the sandbox, around the untrusted code.

`lopd_core.sandbox` ships this file to the worker as text (`python -I -S -c <source> <config>`), so the worker
needs no access to this package; it is a real module so that it is linted and type-checked, and so that the
parent imports the same plain-data codec (`encode` / `decode`) the worker uses. Standard library only.

The worker reads one JSON request per line from fd 0 and answers one JSON line on fd 1 (both moved to private
descriptors; fds 0 and 1 then point at /dev/null). Whatever runs in this process can write to that channel,
so nothing here is a verdict: graders use it for plain data only (`lopd_core.evaluation.code`).

Inside: rlimits (soft = hard, so the code cannot raise them) and a Python audit hook (PEP 578) refusing writes
outside the working directory, process creation, signals, sockets and ctypes. The hook is a second layer that
reports attempts in `violations`; it lives in this process and can be fooled. The boundary is the operating
system: namespaces, a read-only view of the interpreter, a seccomp filter (`lopd_core.sandbox`).
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import io
import json
import math
import os
import resource
import sys
import traceback
from typing import Any

MAX_DEPTH = 200  # nesting of a plain-data value

# ------------------------------------------------------------------------------------------ plain-data codec


def encode(value: Any, depth: int = 0) -> Any:
    """A JSON value standing for `value`, which must be built of None, bool, int, float, complex, str, bytes,
    list, tuple, set, frozenset and dict (subclasses count as their base: a namedtuple is a tuple). Anything
    else raises TypeError: no object with its own `__eq__` survives the trip."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if value is None or isinstance(value, bool):
        return bool(value) if value is not None else None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        return {"$complex": [encode(value.real, d), encode(value.imag, d)]}
    if isinstance(value, list):
        return [encode(v, d) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, d) for v in value]}
    if isinstance(value, frozenset):
        return {"$frozenset": [encode(v, d) for v in value]}
    if isinstance(value, set):
        return {"$set": [encode(v, d) for v in value]}
    if isinstance(value, dict):
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: encode(v, d) for k, v in value.items()}
        return {"$dict": [[encode(k, d), encode(v, d)] for k, v in value.items()]}
    raise TypeError(f"not plain data: {type(value).__name__}")


_TAGS = {"$float", "$bytes", "$complex", "$tuple", "$frozenset", "$set", "$dict"}


def decode(obj: Any, depth: int = 0) -> Any:
    """The value `encode` stood for, built only of the built-in types (a malformed value raises ValueError)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [decode(v, d) for v in obj]
    if type(obj) is not dict:
        raise ValueError(f"not a plain-data encoding: {type(obj).__name__}")
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        (tag, body), = obj.items()  # fmt: skip
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$bytes" and type(body) is str:
            return base64.b64decode(body)
        if type(body) is not list:
            raise ValueError(f"malformed {tag}")
        items = [decode(v, d) for v in body]
        if tag == "$complex" and len(items) == 2:
            return complex(float(items[0]), float(items[1]))
        if tag == "$tuple":
            return tuple(items)
        if tag == "$set":
            return set(items)
        if tag == "$frozenset":
            return frozenset(items)
        if tag == "$dict" and all(type(p) is list and len(p) == 2 for p in items):
            return {k: v for k, v in items}
        raise ValueError(f"malformed {tag}")
    if any(k.startswith("$") for k in obj):
        raise ValueError("unknown tag in a plain-data encoding")
    return {k: decode(v, d) for k, v in obj.items()}


def remote_exception(exc_type: str, message: str) -> Exception:
    """An exception raised on the other side, rebuilt as the built-in class of that name (else RuntimeError)."""
    cls = getattr(builtins, exc_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(message)
    return RuntimeError(f"{exc_type}: {message}")


# ----------------------------------------------------------------------------------------- the audit hook

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_PATH_EVENTS = {
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1, "os.truncate": 1,
    "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.setxattr": 1, "os.removexattr": 1, "os.mkfifo": 1,
    "os.mknod": 1, "shutil.rmtree": 1, "shutil.chown": 1, "shutil.copyfile": 2, "shutil.copymode": 2,
    "shutil.copystat": 2, "shutil.copytree": 2, "shutil.move": 2, "shutil.make_archive": 1,
    "shutil.unpack_archive": 2,
}  # fmt: skip
_BLOCKED = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "resource.prlimit", "sys.remote_exec",
}  # fmt: skip
_MEMORY_DB = (":memory:", b":memory:", "")
_BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing"}


def install_audit_hook(workdir: str, network: bool, violations: list[str]) -> None:
    """Refuse (PermissionError) and record in `violations` what sandboxed code must not attempt."""
    prefixes = ("ctypes.",) if network else ("ctypes.", "socket.")

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True
        try:
            text = os.fsdecode(path)
        except Exception:
            return False
        if text == os.devnull:
            return True
        real = os.path.realpath(os.path.join(workdir, text))
        return real == workdir or real.startswith(workdir + os.sep)

    def deny(what: str) -> None:
        violations.append(what[:300])
        raise PermissionError("sandbox: " + what[:300])

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if path is not None and writing and not inside(path):
                deny(f"write outside the sandbox directory: {path!r}")
        elif event in _PATH_EVENTS:
            for path in args[: _PATH_EVENTS[event]]:
                if path is not None and not inside(path):
                    deny(f"{event} outside the sandbox directory: {path!r}")
        elif event in _BLOCKED or event.startswith(prefixes):
            deny(f"{event} is not allowed")
        elif event == "import" and args[0] in _BLOCKED_IMPORTS:
            deny(f"import {args[0]} is not allowed")
        elif event == "sqlite3.connect" and args and args[0] not in _MEMORY_DB and not inside(args[0]):
            deny(f"sqlite database outside the sandbox directory: {args[0]!r}")

    sys.addaudithook(hook)


# ------------------------------------------------------------------------------------------------ the loop


class Worker:
    """Executes requests in one persistent namespace; see `lopd_core.sandbox.Sandbox` for the operations."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.req = open(os.dup(0), "rb")  # noqa: SIM115 - the channel lives as long as the worker
        self.resp_fd = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        self.violations: list[str] = []
        self.ns: dict[str, Any] = {"__name__": "__sandbox__", "__builtins__": builtins, "_lopd_remote": self.remote}

    def send(self, obj: dict[str, Any]) -> None:
        try:
            data = json.dumps(obj, default=repr)
        except Exception as exc:
            data = json.dumps({"ok": False, "error_type": "exception", "error": f"unserialisable result: {exc!r}"})
        raw = data.encode("utf-8", "replace")
        limit = self.cfg["max_response_bytes"]
        if len(raw) > limit:
            msg = f"result of {len(raw)} bytes exceeds {limit}"
            raw = json.dumps({"ok": False, "error_type": "too_large", "error": msg}).encode()
        raw += b"\n"
        while raw:
            raw = raw[os.write(self.resp_fd, raw) :]

    def remote(self, name: str) -> Any:
        """A callable forwarding its plain-data arguments to `name` in another sandbox, through the parent."""

        def call(*args: Any) -> Any:
            self.send({"callback": name, "args": encode(list(args))})
            reply = json.loads(self.req.readline() or b'{"ok": false, "exc_type": "EOFError", "error": "closed"}')
            if reply.get("ok"):
                return decode(reply.get("value"))
            raise remote_exception(str(reply.get("exc_type")), str(reply.get("error")))

        call.__name__ = name
        return call

    def handle(self, req: dict[str, Any]) -> Any:
        if req["op"] == "exec":
            exec(compile(req["code"], req.get("filename", "<sandbox>"), "exec"), self.ns)
            return None
        head, *rest = req["name"].split(".")
        target = self.ns[head] if head in self.ns else getattr(builtins, head)
        for attr in rest:
            target = getattr(target, attr)
        if req.get("codec"):
            args, kwargs = decode(req.get("args", [])), decode(req.get("kwargs", {}))
        else:
            args, kwargs = req.get("args", []), req.get("kwargs", {})
        if req["op"] == "call":
            return target(*args, **kwargs)
        if req["op"] == "map":  # one call per argument list; a fresh copy of the arguments for each
            import copy

            return [target(*copy.deepcopy(a)) for a in args]
        raise ValueError(f"unknown op {req['op']!r}")

    def serve(self) -> None:
        cap = self.cfg["max_output_chars"]
        while True:
            line = self.req.readline()
            if not line:
                return
            req = json.loads(line)
            del self.violations[:]
            out = io.StringIO()
            resp: dict[str, Any] = {"ok": True, "value": None}
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    value = self.handle(req)
                    resp["value"] = encode(value) if req.get("codec") else value
            except BaseException as exc:
                resp = {
                    "ok": False,
                    "error_type": "memory" if isinstance(exc, MemoryError) else "exception",
                    "exc_type": type(exc).__name__,
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc(limit=-8)[-4000:],
                }
            resp["violations"] = list(self.violations)
            resp["stdout"] = out.getvalue()[-cap:]
            self.send(resp)


def _limit(res: int, value: int) -> None:
    _, hard = resource.getrlimit(res)
    if hard != resource.RLIM_INFINITY and value > hard:
        value = hard
    resource.setrlimit(res, (value, value))


def main(cfg: dict[str, Any]) -> None:
    workdir = os.path.realpath(cfg["workdir"])
    os.environ.update(HOME=workdir, TMPDIR=workdir, TMP=workdir, TEMP=workdir)
    worker = Worker(cfg)
    for name in cfg["preload"]:
        with contextlib.suppress(Exception):
            __import__(name)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_CPU, cfg["cpu_s"])
    _limit(resource.RLIMIT_AS, cfg["memory_mb"] << 20)
    _limit(resource.RLIMIT_FSIZE, cfg["file_size_mb"] << 20)
    _limit(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    os.chdir(workdir)
    for name in ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "socket", "_socket"):
        sys.modules.pop(name, None)
    if cfg.get("audit_hook", True):
        install_audit_hook(workdir, cfg["network"], worker.violations)
    worker.send({"ready": True, "pid": os.getpid(), "uid": os.getuid()})
    worker.serve()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
