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

The package, one job per module:

* `problems`: `CodeProblem` (a problem and its tests) and `CodeExecConfig` (limits for running one program);
* `prompts`: the chat messages asking for a solution, and the code extracted from a reply;
* `programs`: the sources that run in the sandboxes (the project-tree guard, the candidate module or the I/O
  harness, the grader's tests);
* `grading`: running a candidate against its tests and reaching the verdict, the reference outputs;
* `suite`: `CodeSuite` and `CodeEpisode`, a benchmark's problems as an evaluation-only suite.
"""

from lopd_core.evaluation.code.grading import describe_failure, reference_outputs, run_program
from lopd_core.evaluation.code.problems import GUARD_EXIT_CODE, PROJECT_ROOT, TEST_KINDS, CodeExecConfig, CodeProblem
from lopd_core.evaluation.code.programs import (
    LCB_IMPORTS,
    build_program,
    candidate_source,
    grader_source,
    solution_source,
)
from lopd_core.evaluation.code.prompts import CODE_SYSTEM_PROMPT, code_instruction, code_messages, defines, extract_code
from lopd_core.evaluation.code.suite import CodeEpisode, CodeSuite, problem_task

__all__ = [
    "CODE_SYSTEM_PROMPT",
    "GUARD_EXIT_CODE",
    "LCB_IMPORTS",
    "PROJECT_ROOT",
    "TEST_KINDS",
    "CodeEpisode",
    "CodeExecConfig",
    "CodeProblem",
    "CodeSuite",
    "build_program",
    "candidate_source",
    "code_instruction",
    "code_messages",
    "defines",
    "describe_failure",
    "extract_code",
    "grader_source",
    "problem_task",
    "reference_outputs",
    "run_program",
    "solution_source",
]
