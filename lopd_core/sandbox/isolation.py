"""The OS boundary of a worker: the seccomp filter (`seccomp_filter`), the bubblewrap command line
(`bwrap_command`: namespaces, a read-only view of /usr and the interpreter, private tmpfs) and `check_isolation`,
which proves once per process that bubblewrap and the namespaces work on this machine (else `SandboxUnavailable`)."""

from __future__ import annotations

import functools
import os
import shutil
import struct
import subprocess
import sys

from lopd_core.sandbox.config import INSTALL_HINT, SANDBOX_UID, SandboxLimits, SandboxUnavailable

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
