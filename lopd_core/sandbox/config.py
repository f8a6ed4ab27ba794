"""The sandbox's settings and answers: `SandboxLimits` (per-worker limits and the isolation), `SandboxResult` (one
request's outcome), `SandboxInfo` (a started worker), the errors, and the constants (modules preloaded in the
worker, the isolations, the sandbox uid, the install hint)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
    isolation: str = "bwrap"  # "bwrap": OS namespaces (see the package docstring); "none": trusted code only
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
