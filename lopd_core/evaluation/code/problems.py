"""A code problem and how its programs run: `CodeProblem` (the prompt and the tests, by kind; see the package
docstring), `CodeExecConfig` (time, memory and file limits, the forbidden project tree, the isolation) and the
constants they use."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lopd_core.sandbox import ISOLATIONS, SandboxLimits

PROJECT_ROOT = Path(__file__).resolve().parents[3]
TEST_KINDS = ("check", "script", "differential", "stdio", "functional")
GUARD_EXIT_CODE = 77  # the worker's exit code when code touched a forbidden path


@dataclass(frozen=True)
class CodeProblem:
    """One code-generation problem with its tests (see the package docstring for the test kinds)."""

    task_id: str
    benchmark: str  # "humaneval" | "humaneval_plus" | "mbpp_plus" | "livecodebench" | ...
    prompt: str  # HumanEval/EvalPlus: signature + docstring; LiveCodeBench: the problem statement
    test_kind: str
    entry_point: str = ""  # function name (HumanEval, EvalPlus, LiveCodeBench functional)
    test: str = ""  # "check" / "script" test code
    canonical_solution: str = ""  # "differential": the reference the expected outputs come from
    inputs: tuple[Any, ...] = ()  # "differential": argument lists
    atol: float = 0.0
    oracle: str = "exact"  # "differential": "exact" | "set" | "not_none" | "poly"
    cases: tuple[dict[str, str], ...] = ()  # "stdio" / "functional": {"input", "output"}
    starter_code: str = ""  # LiveCodeBench functional
    subset: str = ""  # LiveCodeBench platform, ...
    difficulty: str = ""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if self.test_kind not in TEST_KINDS:
            raise ValueError(f"{self.task_id}: test_kind must be one of {TEST_KINDS}, got {self.test_kind!r}")
        if self.test_kind in ("check", "differential", "functional") and not self.entry_point:
            raise ValueError(f"{self.task_id}: a {self.test_kind!r} problem needs an entry point")


@dataclass(frozen=True)
class CodeExecConfig:
    """Limits for running one program (a completion plus its tests)."""

    timeout_s: float = 10.0  # wall clock for a program
    per_case_timeout_s: float = 2.0  # added per stdio/functional/differential case
    max_timeout_s: float = 120.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    forbidden_roots: tuple[str, ...] = (str(PROJECT_ROOT),)  # opening or listing anything under these ends the run
    max_code_chars: int = 100_000  # longer replies fail without running
    sandbox: str = "bwrap"  # "bwrap" (OS namespaces) | "none" (trusted code only); see lopd_core.sandbox

    def __post_init__(self) -> None:
        if self.sandbox not in ISOLATIONS:
            raise ValueError(f"CodeExecConfig.sandbox must be one of {ISOLATIONS}, got {self.sandbox!r}")

    def limits(self, n_cases: int = 0) -> SandboxLimits:
        timeout = min(self.timeout_s + self.per_case_timeout_s * n_cases, self.max_timeout_s)
        return SandboxLimits(
            timeout_s=timeout,
            cpu_s=math.ceil(timeout) + 5,
            memory_mb=self.memory_mb,
            file_size_mb=self.file_size_mb,
            max_processes=1,
            network=False,
            isolation=self.sandbox,
        )
