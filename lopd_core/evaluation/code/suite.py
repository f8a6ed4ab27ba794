"""A code benchmark as a suite: `CodeSuite` (evaluation-only tasks, reference outputs computed once) and
`CodeEpisode` (one assistant turn, then the code runs against the tests in sandboxes; reward 1 or 0)."""

from __future__ import annotations

from typing import Any

from lopd_core.conversation import Message
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.evaluation.code.grading import reference_outputs, run_program
from lopd_core.evaluation.code.problems import CodeExecConfig, CodeProblem
from lopd_core.evaluation.code.prompts import code_instruction, code_messages, extract_code
from lopd_core.sandbox import Sandbox


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
