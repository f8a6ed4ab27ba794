"""Agent benchmarks through the harness: BFCL-v3's ground truth scores 100% per subset (by the package's own
checker), the built-in suite's and an EnvScaler file's reference solutions score 100%, perturbed answers fail."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from lopd_core.envs.actions import ToolCall, format_call
from lopd_core.envs.base import Task
from lopd_core.evaluation.harness import ScriptedPolicy, aggregate, run_tasks, select_tasks
from lopd_core.evaluation.loaders import BenchmarkDataMissing, load_envscaler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"


def tagged(calls: list[ToolCall]) -> str:
    return "\n".join(f"<tool_call>{format_call(c)}</tool_call>" for c in calls)


# -- BFCL-v3 -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bfcl():
    pytest.importorskip("bfcl", reason="needs nvidia-bfcl (pip install --no-deps nvidia-bfcl==26.3 mpmath)")
    pytest.importorskip("mpmath")
    from lopd_core.envs.bfcl import BFCLSuite

    return BFCLSuite()


def bfcl_actions(suite, perturb: Callable[[list[list[ToolCall]]], None] | None = None) -> Callable[[Task], list[str]]:
    """Per user turn: the ground-truth calls in one action, then an answer that ends the turn."""

    def actions(task: Task) -> list[str]:
        reference = suite.reference_calls(task)
        turns = [[ToolCall(c.name, json.loads(json.dumps(c.arguments))) for c in t] for t in reference]
        if perturb is not None:
            perturb(turns)
        out = []
        for calls in turns:
            if calls:
                out.append(tagged(calls))
            out.append("Done with this request.")
        return out

    return actions


def _evaluate_bfcl(suite, tasks, actions) -> dict:
    from lopd_core.envs.bfcl import SUBSETS

    records, _ = run_tasks(ScriptedPolicy(actions), suite, tasks, "bfcl")
    return aggregate("bfcl", "bfcl", records, subsets=SUBSETS)


def test_bfcl_ground_truth_scores_100_on_every_subset(bfcl) -> None:
    tasks = select_tasks(bfcl.tasks("eval"), 6, seed=0, key="bfcl", by="subset")
    metrics = _evaluate_bfcl(bfcl, tasks, bfcl_actions(bfcl))
    assert metrics["subsets"] == ["base", "miss_func", "miss_param", "long_context"]
    for subset, block in metrics["by_subset"].items():
        assert block["n"] == 6 and block["success_rate"]["value"] == 100.0, subset
    assert metrics["headline"]["value"] == 100.0 and metrics["headline"]["n"] == 24
    assert metrics["overall"]["calls_per_step"] > 0 and metrics["overall"]["errors_per_episode"] == 0


def _first_string_argument(turns: list[list[ToolCall]]) -> None:
    for calls in turns:
        for call in calls:
            for key, value in call.arguments.items():
                if isinstance(value, str):
                    call.arguments[key] = value + "_x"
                    return


def _drop_last_call(turns: list[list[ToolCall]]) -> None:
    for calls in reversed(turns):
        if calls:
            calls.pop()
            return


@pytest.mark.parametrize("perturb", [_first_string_argument, _drop_last_call])
def test_bfcl_perturbed_answers_fail(bfcl, perturb) -> None:
    tasks = [t for t in bfcl.tasks("eval", subset="base")[:4]]
    metrics = _evaluate_bfcl(bfcl, tasks, bfcl_actions(bfcl, perturb))
    assert metrics["by_subset"]["base"]["success_rate"]["value"] == 0.0


@pytest.mark.slow
def test_bfcl_ground_truth_scores_100_on_all_800_tasks(bfcl) -> None:
    metrics = _evaluate_bfcl(bfcl, bfcl.tasks("eval"), bfcl_actions(bfcl))
    assert {s: b["success_rate"]["value"] for s, b in metrics["by_subset"].items()} == {
        "base": 100.0, "miss_func": 100.0, "miss_param": 100.0, "long_context": 100.0,
    }  # fmt: skip
    assert metrics["n_tasks"] == 800


# -- EnvScaler format: the built-in suite and user files -------------------------------------------------------------


def reference_actions(suite) -> Callable[[Task], list[str]]:
    def actions(task: Task) -> list[str]:
        calls = [ToolCall(c["name"], c["arguments"]) for c in suite.scenario(task.task_id)["reference_solution"]]
        return [tagged([c]) for c in calls] + ["All done."]

    return actions


def test_toolworld_reference_solutions_score_100_per_environment() -> None:
    from lopd_core.envs.toolworld import load_toolworld

    suite = load_toolworld()
    assert len(suite.tasks("eval")) == 680  # 200, plus 30 a level per environment at levels 1-2 (issue 41)
    tasks = []
    for env in sorted({t.env_id for t in suite.tasks("eval")}):
        tasks += [t for t in suite.tasks("eval") if t.env_id == env][:1]
    records, _ = run_tasks(ScriptedPolicy(reference_actions(suite)), suite, tasks, "toolworld")
    metrics = aggregate("toolworld", "agent", records)
    assert metrics["headline"]["value"] == 100.0 and len(metrics["by_env"]) == 8
    assert metrics["overall"]["calls_per_step"] == pytest.approx(
        sum(r.n_calls for r in records) / sum(r.n_steps for r in records)
    )


def test_envscaler_files_reference_passes_and_a_wrong_call_scores_partially() -> None:
    suite = load_envscaler(FIXTURES / "envscaler" / "env_metadata.json", FIXTURES / "envscaler" / "scenarios.json")
    tasks = suite.tasks("eval")
    assert [t.task_id for t in tasks] == ["counter-1", "counter-2"] and suite.tasks("train") == []
    records, _ = run_tasks(ScriptedPolicy(reference_actions(suite)), suite, tasks, "envscaler")
    assert [r.reward for r in records] == [1.0, 1.0]
    wrong = ScriptedPolicy(lambda task: [tagged([ToolCall("increment", {"name": "b", "amount": 2})]), "Done."])
    records, _ = run_tasks(wrong, suite, tasks[:1], "envscaler")
    assert records[0].reward == 0.0  # a unchanged (fails), b changed (fails)
    half = ScriptedPolicy(lambda task: [tagged([ToolCall("increment", {"name": "a", "amount": 1})]), "Done."])
    records, _ = run_tasks(half, suite, tasks[1:], "envscaler")
    assert records[0].reward == 0.5  # a is 1 (passes), b is still 0 (fails): the mean of the checks
    metrics = aggregate("envscaler", "agent", records)
    assert metrics["headline"]["value"] == 50.0 and metrics["overall"]["success_rate"]["value"] == 0.0


def test_envscaler_missing_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(BenchmarkDataMissing, match=r"envscaler.*nowhere\.json"):
        load_envscaler(tmp_path / "nowhere.json", FIXTURES / "envscaler" / "scenarios.json")
    with pytest.raises(BenchmarkDataMissing, match=r"missing\.json"):
        load_envscaler(FIXTURES / "envscaler" / "env_metadata.json", tmp_path / "missing.json")


def test_a_crashing_episode_counts_as_a_failed_zero() -> None:
    class Broken:
        name = "broken"

        def tasks(self, split: str) -> list[Task]:
            return [Task("b1", "broken", "eval", "do it")]

        def episode(self, task: Task):
            raise_on = self

            class Episode:
                def __init__(self) -> None:
                    self.task = task

                def initial_messages(self):
                    from lopd_core.conversation import Message

                    return [Message("user", task.instruction)]

                def step(self, action: str):
                    raise RuntimeError(f"environment crashed ({raise_on.name})")

                def result(self):
                    raise AssertionError("not reached")

                def close(self) -> None:
                    pass

            return Episode()

    suite = Broken()
    records, _ = run_tasks(ScriptedPolicy(lambda t: ["x"]), suite, suite.tasks("eval"), "broken")
    assert records[0].failed and records[0].reward == 0.0 and "crashed" in (records[0].error or "")
    metrics = aggregate("broken", "agent", records)
    assert metrics["overall"]["failed"] == 1 and metrics["headline"]["value"] == 0.0
