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

The package, one job per module:

* `config`: the limits (`SandboxLimits`), results (`SandboxResult`, `SandboxInfo`), errors and constants;
* `isolation`: the OS boundary: the seccomp filter, the bubblewrap command line, the check that it works here;
* `process`: `Sandbox`, the host side of one worker process (start, requests over the pipe, kill, restart), and
  the one-shot helpers `run_code` and `call_function`.
"""

from lopd_core import sandbox_worker
from lopd_core.sandbox.config import (
    INSTALL_HINT,
    ISOLATIONS,
    PRELOAD_MODULES,
    SANDBOX_UID,
    SandboxError,
    SandboxInfo,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from lopd_core.sandbox.isolation import bwrap_command, check_isolation, seccomp_filter
from lopd_core.sandbox.process import Sandbox, call_function, run_code
from lopd_core.sandbox_worker import decode, encode

__all__ = [
    "INSTALL_HINT",
    "ISOLATIONS",
    "PRELOAD_MODULES",
    "SANDBOX_UID",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "bwrap_command",
    "call_function",
    "check_isolation",
    "decode",
    "encode",
    "run_code",
    "sandbox_worker",
    "seccomp_filter",
]
