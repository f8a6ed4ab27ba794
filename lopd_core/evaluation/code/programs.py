"""The sources that run in the sandboxes: the guard ending a worker that touches the project tree, the candidate
module (`solution_source`, `candidate_source`), the I/O harness for LiveCodeBench tests, and the grader's tests
calling the candidate through a proxy (`grader_source`)."""

from __future__ import annotations

import textwrap

from lopd_core.evaluation.code.problems import GUARD_EXIT_CODE, CodeExecConfig, CodeProblem
from lopd_core.evaluation.code.prompts import defines

# Imports LiveCodeBench solutions commonly rely on (all preloaded in the sandbox).
LCB_IMPORTS = (
    "from typing import *\nfrom collections import *\nfrom functools import *\nfrom itertools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\nimport math, heapq, bisect, itertools, "
    "functools, collections, re, string, sys, copy, random, operator\n"
)


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
