"""Cost of grading one program in the sandbox: N HumanEval-style programs (a correct answer plus a
`check(candidate)` test) graded one after another through `CodeSuite`, wall time and parent CPU per program.

    OMP_NUM_THREADS=1 python bench/sandbox_cost.py [N]
"""

from __future__ import annotations

import sys
import time

from lopd_core.evaluation.code import CodeProblem, CodeSuite

PROMPT = 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n" + "".join(f"    assert candidate({i}, {i + 1}) == {2 * i + 1}\n" for i in range(10))
REPLY = "```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```"


def main(n: int = 50) -> None:
    problems = [CodeProblem(f"bench/{i}", "humaneval", PROMPT, "check", entry_point="add", test=TEST) for i in range(n)]
    suite = CodeSuite(problems)
    t0, c0 = time.perf_counter(), time.process_time()
    passed = 0
    for task in suite.tasks("eval"):
        episode = suite.episode(task)
        episode.initial_messages()
        episode.step(REPLY)
        passed += episode.result().reward == 1.0
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    per = f"{1000 * wall / n:.1f} ms wall, {1000 * cpu / n:.1f} ms parent CPU per program"
    print(f"{n} programs, {passed} passed: {per}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
