"""Grading: `run_program` runs a candidate in its sandbox against the tests of its kind and reaches the verdict
(here, or in a grader sandbox that only gets the candidate's return values as plain data); the comparisons
(EvalPlus' tolerances and oracles, LiveCodeBench's outputs); `reference_outputs` runs a canonical solution."""

from __future__ import annotations

import json
import math
import time
from decimal import Decimal, InvalidOperation
from typing import Any

from lopd_core.evaluation.code.problems import GUARD_EXIT_CODE, CodeExecConfig, CodeProblem
from lopd_core.evaluation.code.programs import _guard, candidate_source, grader_source, solution_source
from lopd_core.sandbox import Sandbox, SandboxResult
from lopd_core.sandbox_worker import encode


def describe_failure(result: SandboxResult) -> str:
    """A short reason for a failed run."""
    if result.violations:
        return "forbidden operation: " + "; ".join(result.violations)[:300]
    if result.error_type == "crash" and f"code {GUARD_EXIT_CODE}" in (result.error or ""):
        return "forbidden access to the project tree"
    return f"{result.error_type}: {(result.error or '')[:300]}"


# An exception of one of these, raised by the candidate, fails the program whatever the tests do with it.
_FATAL = {"SystemExit", "KeyboardInterrupt", "GeneratorExit", "MemoryError"}


def _close(out: Any, exp: Any, atol: float) -> bool:
    """EvalPlus' comparison: floats within `atol` (at least 1e-6), containers element-wise, types equal."""
    if isinstance(exp, float) or isinstance(out, float):
        if not isinstance(out, (int, float)) or isinstance(out, bool) != isinstance(exp, bool):
            return False
        if isinstance(exp, float) and math.isnan(exp):
            return isinstance(out, float) and math.isnan(out)
        try:
            return math.isclose(out, exp, rel_tol=0.0, abs_tol=max(atol, 1e-6))
        except (TypeError, OverflowError):
            return False
    if isinstance(exp, (list, tuple)) and isinstance(out, (list, tuple)):
        if type(out) is not type(exp) or len(out) != len(exp):
            return False
        return all(_close(a, b, atol) for a, b in zip(out, exp, strict=True))
    if isinstance(exp, dict) and isinstance(out, dict):
        return out.keys() == exp.keys() and all(_close(out[k], exp[k], atol) for k in exp)
    return type(out) is type(exp) and out == exp


def _differential_ok(problem: CodeProblem, args: list[Any], out: Any, exp: Any) -> bool:
    if problem.oracle == "set":
        try:
            return set(out) == set(exp)
        except TypeError:
            return False
    if problem.oracle == "not_none":
        return (out is None) == (exp is None)
    if problem.oracle == "poly":
        try:
            x = float(out)
            return abs(sum(c * x**p for p, c in enumerate(args[0]))) <= max(problem.atol, 1e-6)
        except (TypeError, ValueError, OverflowError):
            return False
    return _close(out, exp, problem.atol)


def _same_text(out: str, exp: str) -> bool:
    """LiveCodeBench stdio: lines compared after stripping; numeric tokens by value."""
    a = [line.strip() for line in out.strip().splitlines()]
    b = [line.strip() for line in exp.strip().splitlines()]
    if a == b:
        return True
    ta, tb = " ".join(a).split(), " ".join(b).split()
    if len(ta) != len(tb):
        return False
    for x, y in zip(ta, tb, strict=True):
        if x == y:
            continue
        try:
            if Decimal(x) != Decimal(y):
                return False
        except (InvalidOperation, ValueError):
            return False
    return True


def _same_value(out: Any, exp: Any) -> bool:
    """LiveCodeBench functional: JSON values equal (a tuple as a list), a float within 1e-9 of a number."""
    if isinstance(out, tuple):
        out = list(out)
    if out == exp:
        return True
    return isinstance(out, float) and isinstance(exp, (int, float)) and abs(out - exp) < 1e-9


def run_program(
    problem: CodeProblem,
    code: str,
    config: CodeExecConfig,
    candidate: Sandbox,
    grader: Sandbox | None = None,
    expected: list[Any] | None = None,
) -> tuple[bool, str]:
    """Grade `code`; (passed, reason). The candidate runs in `candidate`; the verdict is reached here, or, for
    "check"/"script" tests, in `grader`, a second sandbox that only gets the candidate's return values as plain
    data. A candidate that exits, crashes, times out or attempts a forbidden operation fails."""
    kind = problem.test_kind
    deadline = time.monotonic() + candidate.limits.timeout_s
    defined = candidate.exec(candidate_source(problem, code, config), filename="<solution>")
    if not defined.clean:
        return False, describe_failure(defined)
    if kind in ("stdio", "functional"):
        source = solution_source(problem, code)
        inputs = [c["input"] for c in problem.cases]
        ran = candidate.call(
            "_lopd_run_io", source, kind, problem.entry_point, inputs, codec=True, timeout=_left(deadline)
        )
        if not ran.clean:
            return False, describe_failure(ran)
        outputs = ran.value if isinstance(ran.value, list) else []
        if len(outputs) != len(problem.cases):
            return False, "the harness returned the wrong number of outputs"
        for i, (out, case) in enumerate(zip(outputs, problem.cases, strict=True)):
            if kind == "stdio":
                ok = isinstance(out, str) and _same_text(out, case["output"])
            else:
                ok = _same_value(out, json.loads(case["output"]))
            if not ok:
                return False, f"case {i}: wrong output {out!r:.200}"
        return True, ""
    if kind == "differential":
        assert expected is not None
        ran = candidate.map(problem.entry_point, [list(a) for a in problem.inputs], timeout=_left(deadline))
        if not ran.clean:
            return False, describe_failure(ran)
        outputs = ran.value if isinstance(ran.value, list) else []
        if len(outputs) != len(problem.inputs) or len(expected) != len(problem.inputs):
            return False, "the reference produced a different number of outputs"
        for i, (args, out, exp) in enumerate(zip(problem.inputs, outputs, expected, strict=True)):
            if not _differential_ok(problem, list(args), out, exp):
                return False, f"case {i}: wrong output {out!r:.200}"
        return True, ""
    if grader is None:
        raise ValueError(f"{problem.task_id}: a {kind!r} test needs a grader sandbox")
    failures: list[str] = []

    def serve(name: str, args: list[Any]) -> dict[str, Any]:
        if failures:
            return {"ok": False, "exc_type": "RuntimeError", "error": "the candidate has already failed"}
        res = candidate.call(problem.entry_point, *args, codec=True, timeout=_left(deadline))
        if res.clean:
            return {"ok": True, "value": encode(res.value)}
        if res.violations or res.error_type != "exception" or res.exc_type in _FATAL:
            failures.append(describe_failure(res))
            return {"ok": False, "exc_type": "RuntimeError", "error": "the candidate failed"}
        return {"ok": False, "exc_type": res.exc_type, "error": res.error}

    verdict = grader.exec(grader_source(problem), timeout=_left(deadline), filename="<tests>", serve=serve)
    if failures:
        return False, failures[0]
    return (True, "") if verdict.clean else (False, describe_failure(verdict))


def _left(deadline: float) -> float:
    return max(0.05, deadline - time.monotonic())


def reference_outputs(problem: CodeProblem, config: CodeExecConfig) -> tuple[list[Any] | None, str]:
    """Run the canonical solution on the inputs in a sandbox; (its outputs as plain data, or None; error)."""
    source = _guard(config.forbidden_roots) + problem.prompt + "\n" + problem.canonical_solution
    with Sandbox(config.limits(len(problem.inputs))) as box:
        defined = box.exec(source, filename="<reference>")
        if not defined.clean:
            return None, describe_failure(defined)
        result = box.map(problem.entry_point, [list(a) for a in problem.inputs])
    if not result.clean or not isinstance(result.value, list):
        return None, describe_failure(result)
    return result.value, ""
