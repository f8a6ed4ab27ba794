"""Code benchmarks as a suite: a problem is one user message, the reply's code runs against tests in a sandbox.

    suite = CodeSuite(load_humaneval())                 # or EvalPlus / LiveCodeBench problems (loaders.py)
    episodes = [suite.episode(t) for t in suite.tasks("eval")]
    RolloutEngine(model, tokenizer, cfg).run(episodes)   # one assistant turn per episode; reward 1 = all tests pass

An episode asks for the solution in the chat format (`code_messages`), extracts the code from the reply
(`extract_code`: a fenced block, else the raw text), assembles a test program (`build_program`) and runs it
in a fresh sandboxed worker (`lopd_core.sandbox`: its own temporary directory, CPU/memory/file-size/process
limits, no network, an unprivileged uid, an audit hook against writes outside the directory, process creation
and sockets). The program starts with a guard of ours that ends the worker when code opens or lists anything
under the project tree (`CodeExecConfig.forbidden_roots`). A program passes only when it finishes within its
time limit, raises nothing and attempted nothing the sandbox forbids; the evaluating process never executes a
completion.

Test kinds (`CodeProblem.test_kind`):
* "check": HumanEval's `def check(candidate)` test, called on the entry point;
* "script": a self-contained test script calling the function by name (EvalPlus' exported `test` field);
* "differential": EvalPlus' inputs; expected outputs come from the canonical solution, run once per problem
  in its own sandbox (outputs compared exactly, floats with `atol`, and EvalPlus' set / not-None oracles);
* "stdio": LiveCodeBench standard-input tests (each case runs the program as `__main__`; output lines
  compared after stripping, numeric tokens by value);
* "functional": LiveCodeBench LeetCode-style tests (`Solution().<func_name>(*args)`, JSON arguments and
  expected value).
"""

from __future__ import annotations

import json
import math
import re
import textwrap
import time
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.sandbox import ISOLATIONS, Sandbox, SandboxLimits, SandboxResult
from lopd_core.sandbox_worker import encode

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TEST_KINDS = ("check", "script", "differential", "stdio", "functional")
GUARD_EXIT_CODE = 77  # the worker's exit code when code touched a forbidden path

CODE_SYSTEM_PROMPT = "You are an expert Python programmer. You write correct, efficient and complete Python code."

# Imports LiveCodeBench solutions commonly rely on (all preloaded in the sandbox).
LCB_IMPORTS = (
    "from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\nimport math, heapq, bisect, itertools, "
    "functools, collections, re, string, sys, copy, random, operator\n"
)


@dataclass(frozen=True)
class CodeProblem:
    """One code-generation problem with its tests (see the module docstring for the test kinds)."""

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


# ---------------------------------------------------------------------------------------------------- prompts


def code_instruction(problem: CodeProblem) -> str:
    """The user message asking for a solution."""
    if problem.test_kind in ("stdio", "functional"):
        parts = [f"Solve the following programming problem in Python.\n\n{problem.prompt.strip()}"]
        if problem.starter_code.strip():
            parts.append(
                "Complete the following starter code and reply with the complete solution in one ```python code "
                f"block:\n```python\n{problem.starter_code.rstrip()}\n```"
            )
        else:
            parts.append(
                "Read the input from standard input and write the answer to standard output. Reply with the "
                "complete program in one ```python code block."
            )
        return "\n\n".join(parts)
    name = f" `{problem.entry_point}`" if problem.entry_point else ""
    return (
        f"Complete the following Python function{name}. Reply with the complete function, including its signature "
        f"and any imports it needs, in one ```python code block.\n\n```python\n{problem.prompt.rstrip()}\n```"
    )


def code_messages(problem: CodeProblem) -> list[Message]:
    return [Message("system", CODE_SYSTEM_PROMPT), Message("user", code_instruction(problem))]


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(def |class |import |from |async def |@|if __name__)", re.MULTILINE)


def defines(code: str, name: str) -> bool:
    """Whether `code` defines a top-level-or-nested function/class called `name`."""
    return bool(name) and re.search(rf"^\s*(async\s+)?(def|class)\s+{re.escape(name)}\s*[(:]", code, re.M) is not None


def extract_code(reply: str, entry_point: str = "") -> str:
    """The code in a model reply: the fenced block that defines `entry_point` (else the first python block,
    else the first block; an unclosed final fence counts), or, without fences, the raw reply from its first
    line that looks like code."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(reply)]
    if blocks:
        for _, body in blocks:
            if entry_point and defines(body, entry_point):
                return body.strip("\n")
        for lang, body in blocks:
            if lang in ("python", "py", "python3"):
                return body.strip("\n")
        return blocks[0][1].strip("\n")
    text = reply.strip("\n")
    match = _CODE_START.search(text)
    if match and match.start() > 0 and not text[: match.start()].lstrip().startswith((" ", "\t")):
        text = text[match.start() :]
    return text


# --------------------------------------------------------------------------------------------------- programs


def _guard(roots: tuple[str, ...]) -> str:
    """Trusted prelude: an audit hook ending the worker when code opens or lists a path under `roots`."""
    return textwrap.dedent(
        f"""
        def _lopd_install_guard(roots):
            import os, sys
            roots = tuple(os.path.realpath(r) for r in roots)
            events = ("open", "os.listdir", "os.scandir", "os.chdir", "os.walk", "glob.glob", "os.chroot")
            def hook(event, args):
                if event not in events or not args:
                    return
                path = args[0]
                if isinstance(path, int) or path is None:
                    return
                try:
                    real = os.path.realpath(os.fsdecode(path))
                except Exception:
                    return
                for root in roots:
                    if real == root or real.startswith(root + os.sep):
                        os._exit({GUARD_EXIT_CODE})
            sys.addaudithook(hook)
        _lopd_install_guard({list(roots)!r})
        del _lopd_install_guard
        """
    )


def solution_source(problem: CodeProblem, code: str) -> str:
    """The candidate module: the prompt's definitions (helpers, imports, the stub) followed by the code, which
    redefines the entry point; a code fragment that does not define it is taken as the body's continuation."""
    if problem.test_kind in ("stdio", "functional"):
        return LCB_IMPORTS + code
    if not problem.entry_point or defines(code, problem.entry_point):
        return problem.prompt + "\n\n" + code
    return problem.prompt + code


# Trusted helpers that run in the candidate's sandbox and only produce outputs: the comparison with the
# expected outputs happens in this process, which the candidate cannot reach.
_IO_HARNESS = """
def _lopd_run_io(source, kind, func_name, inputs):
    import builtins, contextlib, io, json, sys
    code = compile(source, "<solution>", "exec")
    def leave(*args):
        raise SystemExit(*args)
    def reader(stream):
        def read_line(prompt=""):
            line = stream.readline()
            if not line:
                raise EOFError("EOF when reading a line")
            return line.rstrip("\\n")
        return read_line
    outputs = []
    if kind == "functional":
        namespace = {"__name__": "__solution__", "exit": leave, "quit": leave}
        exec(code, namespace)
        cls = namespace.get("Solution")
        for text in inputs:
            args = [json.loads(line) for line in text.split("\\n") if line.strip()]
            target = getattr(cls(), func_name) if cls is not None else namespace[func_name]
            outputs.append(target(*args))
        return outputs
    for i, text in enumerate(inputs):
        stdin, stdout = io.StringIO(text), io.StringIO()
        namespace = {"__name__": "__main__", "exit": leave, "quit": leave}
        old_stdin, old_input = sys.stdin, builtins.input
        sys.stdin = stdin
        builtins.input = reader(stdin)
        try:
            with contextlib.redirect_stdout(stdout):
                try:
                    exec(code, namespace)
                except SystemExit as exc:
                    if exc.code not in (None, 0):
                        raise AssertionError(f"case {i}: exit status {exc.code!r}") from None
        finally:
            sys.stdin, builtins.input = old_stdin, old_input
        outputs.append(stdout.getvalue())
    return outputs
"""


def candidate_source(problem: CodeProblem, code: str, config: CodeExecConfig) -> str:
    """What runs in the candidate's sandbox: the guard, then the candidate module (check, script,
    differential) or the output-producing harness (stdio, functional; the solution runs when it is called)."""
    guard = _guard(config.forbidden_roots)
    if problem.test_kind in ("stdio", "functional"):
        return guard + _IO_HARNESS
    return guard + solution_source(problem, code)


def grader_source(problem: CodeProblem) -> str:
    """What runs in the grader's sandbox for "check" and "script" tests: the prompt's definitions (tests use
    its helpers), then the tests, with the entry point (also by name: some tests call it so) replaced by a
    proxy calling the candidate's sandbox."""
    entry = problem.entry_point
    source = problem.prompt + f"\n\n{entry} = _lopd_remote({entry!r})\n\n" + problem.test
    return source + (f"\n\ncheck({entry})\n" if problem.test_kind == "check" else "\n")


def build_program(problem: CodeProblem, code: str, config: CodeExecConfig) -> str:
    """The candidate's program (kept for callers that show it): see `candidate_source`."""
    return candidate_source(problem, code, config)


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


# ---------------------------------------------------------------------------------------------- suite/episode


def problem_task(problem: CodeProblem) -> Task:
    return Task(
        task_id=problem.task_id,
        env_id=problem.benchmark,
        split="eval",
        instruction=code_instruction(problem),
        suite=problem.benchmark,
        metadata={"subset": problem.subset, "difficulty_label": problem.difficulty, "test_kind": problem.test_kind},
    )


class CodeEpisode:
    """One attempt at a problem: one assistant turn, then the code runs against the tests (reward 1 or 0)."""

    def __init__(self, task: Task, problem: CodeProblem, config: CodeExecConfig, suite: CodeSuite) -> None:
        self.task = task
        self.problem = problem
        self.config = config
        self._suite = suite
        self._box: Sandbox | None = None  # the candidate's sandbox
        self._grader: Sandbox | None = None  # the tests' sandbox ("check" and "script")
        self._result: EpisodeResult | None = None
        self.code: str | None = None

    def initial_messages(self) -> list[Message]:
        self._open()  # the workers come up while the model writes
        return code_messages(self.problem)

    def _open(self) -> tuple[Sandbox, Sandbox | None]:
        if self._box is None:
            limits = self.config.limits(len(self.problem.cases) or len(self.problem.inputs))
            self._box = Sandbox(limits)
            self._box.spawn()
            if self.problem.test_kind in ("check", "script"):
                self._grader = Sandbox(limits)
                self._grader.spawn()
        return self._box, self._grader

    def step(self, action: str) -> StepResult:
        if self._result is not None:
            raise RuntimeError(f"episode {self.task.task_id} is already finished")
        self.code = extract_code(action, self.problem.entry_point)
        passed, detail = self._run(self.code)
        self._result = EpisodeResult(
            reward=1.0 if passed else 0.0,
            checks=[{"name": "tests", "passed": passed, "detail": detail}],
            trace=f"code: {len(self.code)} chars -> {'pass' if passed else 'fail'}",
        )
        self.close()
        return StepResult([], done=True, event="finish")

    def _run(self, code: str) -> tuple[bool, str]:
        if not code.strip():
            return False, "no code in the reply"
        if len(code) > self.config.max_code_chars:
            return False, f"code of {len(code)} characters exceeds {self.config.max_code_chars}"
        expected = None
        if self.problem.test_kind == "differential":
            expected, error = self._suite.expected_outputs(self.problem)
            if expected is None:
                return False, f"the reference solution failed: {error}"
        candidate, grader = self._open()
        return run_program(self.problem, code, self.config, candidate, grader, expected)

    def result(self) -> EpisodeResult:
        if self._result is None:  # never answered (e.g. the rollout stopped before the first turn)
            self._result = EpisodeResult(0.0, checks=[{"name": "tests", "passed": False, "detail": "no answer"}])
            self.close()
        return self._result

    def close(self) -> None:
        for box in (self._box, self._grader):
            if box is not None:
                box.close()
        self._box = self._grader = None


class CodeSuite:
    """Problems of one code benchmark as an evaluation-only suite (every task split "eval")."""

    def __init__(self, problems: list[CodeProblem], name: str = "", config: CodeExecConfig | None = None) -> None:
        if not problems:
            raise ValueError("a code suite needs at least one problem")
        self.name = name or problems[0].benchmark
        self.config = config or CodeExecConfig()
        self.problems = {p.task_id: p for p in problems}
        if len(self.problems) != len(problems):
            raise ValueError(f"{self.name}: duplicate task ids")
        self._tasks = [problem_task(p) for p in problems]
        self._expected: dict[str, tuple[list[Any] | None, str]] = {}

    def tasks(self, split: str = "eval") -> list[Task]:
        return list(self._tasks) if split == "eval" else []

    def episode(self, task: Task) -> CodeEpisode:
        return CodeEpisode(task, self.problems[task.task_id], self.config, self)

    def expected_outputs(self, problem: CodeProblem) -> tuple[list[Any] | None, str]:
        """The reference outputs of a differential problem (computed once, in a sandbox)."""
        if problem.task_id not in self._expected:
            self._expected[problem.task_id] = reference_outputs(problem, self.config)
        return self._expected[problem.task_id]
