"""BFCL-v3 multi-turn adapter: BFCL's ground truth passes through it, perturbed answers fail, state is isolated."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("bfcl", reason="needs nvidia-bfcl (pip install --no-deps nvidia-bfcl==26.3 mpmath)")
pytest.importorskip("mpmath")

from lopd_core.envs.actions import ToolCall, format_call
from lopd_core.envs.base import Episode, EpisodeResult, Suite, Task
from lopd_core.envs.bfcl import INSTALL_HINT, SUBSETS, BFCLEpisode, BFCLSuite, _package

Turns = list[list[ToolCall]]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite() -> BFCLSuite:
    return BFCLSuite()


def _task(suite: BFCLSuite, task_id: str) -> Task:
    subset = task_id.removeprefix("multi_turn_").rsplit("_", 1)[0]
    return next(t for t in suite.tasks("eval", subset=subset) if t.task_id == task_id)


def _tagged(calls: list[ToolCall]) -> list[str]:
    """All calls of a turn in one action, each in <tool_call> tags."""
    return ["I'll do that.\n" + "\n".join(f"<tool_call>{format_call(c)}</tool_call>" for c in calls)]


def _json_list(calls: list[ToolCall]) -> list[str]:
    """All calls of a turn in one action, as a bare JSON list."""
    return [json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls])]


def _one_per_action(calls: list[ToolCall]) -> list[str]:
    return [format_call(c) for c in calls]


def _play(
    suite: BFCLSuite,
    task: Task,
    turns: Turns,
    fmt: Callable[[list[ToolCall]], list[str]] = _tagged,
    close: bool = True,
) -> tuple[EpisodeResult, list[str], BFCLEpisode]:
    """Play `turns` (per user turn, the calls to make; an answer without calls ends each turn)."""
    episode = suite.episode(task)
    episode.initial_messages()
    observations: list[str] = []
    for i, calls in enumerate(turns):
        for action in fmt(calls) if calls else []:
            step = episode.step(action)
            assert not step.done, f"{task.task_id}: episode ended inside turn {i}"
            observations += [m.content for m in step.messages]
        step = episode.step("Done with this request.")
        assert step.done == (i == len(turns) - 1)
    result = episode.result()
    if close:
        episode.close()
    return result, observations, episode


def _instance_keys() -> set[str]:
    return {k for k in vars(_package().utils) if k.endswith("_instance")}


# -- tasks ---------------------------------------------------------------------------------------------------------


def test_suite_lists_the_four_subsets_as_eval_only(suite: BFCLSuite) -> None:
    assert isinstance(suite, Suite)
    assert suite.name == "bfcl-v3"
    assert suite.tasks("train") == []  # evaluation tasks never reach a training bank
    tasks = suite.tasks("eval")
    assert len(tasks) == 800
    assert len({t.task_id for t in tasks}) == 800
    assert {t.split for t in tasks} == {"eval"}
    for subset in SUBSETS:
        subset_tasks = suite.tasks("eval", subset=subset)
        assert len(subset_tasks) == 200
        assert {t.metadata["subset"] for t in subset_tasks} == {subset}
        assert {t.env_id for t in subset_tasks} == {f"bfcl-v3/{subset}"}
    assert len(BFCLSuite(subsets=("base",)).tasks("eval")) == 200
    with pytest.raises(ValueError):
        suite.tasks("test")
    with pytest.raises(ValueError):
        suite.tasks("eval", subset="composite")
    with pytest.raises(ValueError):
        BFCLSuite(subsets=("live_simple",))


def test_task_and_initial_messages(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    assert task.instruction.startswith("Move 'final_report.pdf' within document directory")
    assert task.difficulty == 10  # ground-truth calls over the four turns
    assert task.metadata["n_turns"] == 4
    assert set(task.metadata["involved_classes"]) == {"TwitterAPI", "GorillaFileSystem"}
    names = {tool["name"] for tool in task.tools}
    assert {"cd", "mkdir", "mv", "post_tweet"} <= names
    assert all(tool["parameters"]["type"] == "object" for tool in task.tools)  # BFCL's "dict" -> JSON "object"
    episode = suite.episode(task)
    assert isinstance(episode, Episode)
    system, user = episode.initial_messages()
    assert (system.role, user.role) == ("system", "user")
    assert user.content == task.instruction
    assert '"name": "mkdir"' in system.content and "<tool_call>" in system.content
    episode.close()


def test_miss_func_reveals_held_out_functions_at_bfcl_turn(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_miss_func_0")
    assert task.metadata["missed_function"] == {3: ["sort"]}
    assert "sort" not in {tool["name"] for tool in task.tools}
    episode = suite.episode(task)
    system, _ = episode.initial_messages()
    assert '"name": "sort"' not in system.content
    users = []
    for _ in range(3):
        users += [m.content for m in episode.step("Nothing to do.").messages]
    assert '"name": "sort"' not in users[0] + users[1]
    assert '"name": "sort"' in users[2]
    assert "I have updated some more functions you can choose from" in users[2]
    episode.close()


# -- ground truth passes, perturbations fail ---------------------------------------------------------------------

FORMATS = {"base": _tagged, "miss_func": _json_list, "miss_param": _one_per_action, "long_context": _tagged}


@pytest.mark.parametrize("subset", SUBSETS)
def test_ground_truth_passes_every_task(suite: BFCLSuite, subset: str) -> None:
    failures = []
    tasks = suite.tasks("eval", subset=subset)
    for task in tasks:
        result, _, _ = _play(suite, task, suite.reference_calls(task), FORMATS[subset])
        if result.reward != 1.0 or result.n_errors:
            failures.append((task.task_id, result.checks, result.error_counts))
        assert all(check["passed"] for check in result.checks) == (result.reward == 1.0)
    assert len(tasks) == 200
    assert not failures, f"{len(failures)}/200 ground-truth answers fail: {json.dumps(failures[:3])[:2000]}"


def _copy(turns: Turns) -> Turns:
    return [[ToolCall(c.name, json.loads(json.dumps(c.arguments))) for c in turn] for turn in turns]


def test_wrong_argument_fails_on_state(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    turns = _copy(suite.reference_calls(task))
    assert turns[0][1] == ToolCall("mkdir", {"dir_name": "temp"})
    turns[0][1].arguments["dir_name"] = "tmp"
    result, _, _ = _play(suite, task, turns)
    assert result.reward == 0.0
    detail = result.checks[-1]["detail"]
    assert detail["error_type"] == "multi_turn:instance_state_mismatch"
    assert detail["turn"] == 0 and "root" in detail["differences"]
    json.dumps(result.checks)  # the verdict is serialisable into a Trajectory


def test_wrong_read_argument_fails_on_response(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    turns = _copy(suite.reference_calls(task))
    assert turns[1][1].name == "grep"
    turns[1][1].arguments["pattern"] = "revenue"
    result, _, _ = _play(suite, task, turns)
    assert result.reward == 0.0
    assert result.checks[-1]["detail"]["error_type"] == "multi_turn:execution_response_mismatch"
    assert result.checks[-1]["detail"]["turn"] == 1


@pytest.mark.parametrize("subset", SUBSETS)
def test_missing_last_call_fails(suite: BFCLSuite, subset: str) -> None:
    for task in suite.tasks("eval", subset=subset)[::10]:
        turns = _copy(suite.reference_calls(task))
        last = max(i for i, turn in enumerate(turns) if turn)
        turns[last].pop()
        result, _, _ = _play(suite, task, turns)
        assert result.reward == 0.0, f"{task.task_id} passes without its last ground-truth call"
        assert not result.checks[-1]["passed"]


def test_skipped_turn_and_unfinished_episode_fail(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    turns = suite.reference_calls(task)
    result, _, _ = _play(suite, task, [turns[0], [], turns[2], turns[3]])
    assert result.reward == 0.0
    assert result.checks[-1]["detail"]["error_type"] == "multi_turn:empty_turn_model_response"
    # Stopped after two of four turns (as when the rollout engine runs out of turns): BFCL's force_terminated.
    episode = suite.episode(task)
    episode.initial_messages()
    for calls in turns[:2]:
        episode.step("\n".join(format_call(c) for c in calls))
        episode.step("ok")
    result = episode.result()
    episode.close()
    assert result.reward == 0.0
    assert result.checks[0] == {"name": "turns_reached", "passed": False, "detail": "3/4"}
    assert result.checks[-1]["detail"]["error_type"] == "multi_turn:force_terminated"


def test_irrelevance_check_is_optional(suite: BFCLSuite) -> None:
    """BFCL's runner skips turns without ground truth; `check_irrelevance` adds its irrelevance checker."""
    task = _task(suite, "multi_turn_miss_param_0")
    turns = _copy(suite.reference_calls(task))
    assert turns[3] == []
    turns[3] = [ToolCall("pwd", {})]  # a harmless call where the model should have asked for the missing value
    result, _, _ = _play(suite, task, turns)
    assert result.reward == 1.0
    strict = BFCLSuite(subsets=("miss_param",), check_irrelevance=True)
    result, _, _ = _play(strict, task, turns)
    assert result.reward == 0.0
    assert result.checks[-1]["detail"]["error_type"] == "multi_turn:irrelevance_error:decoder_success"


# -- errors are observations ---------------------------------------------------------------------------------------


def test_invalid_actions_are_observations_and_counted(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    episode = suite.episode(task)
    episode.initial_messages()
    cases = [
        ('{"name": "launch_rocket", "arguments": {}}', "unknown_tool", "does not exist"),
        ('{"name": "mkdir", "arguments": {"name": "x"}}', "bad_args", "no parameter"),
        ('{"name": "mkdir", "arguments": {"dir_name=__import__(\'os\').getcwd(),x": 1}}', "bad_args", "no parameter"),
        ('{"name": "mkdir", "arguments": {}}', "bad_args", "missing required"),
        ('{"name": "mkdir", "arguments": {"dir_name": ["a"]}}', "tool_error", "Error during execution"),
        ('<tool_call>{"name": "mkdir", "arguments": </tool_call>', "parse_error", "Error:"),
    ]
    for action, event, text in cases:
        step = episode.step(action)
        assert (step.event, step.done) == (event, False), action
        assert len(step.messages) == 1 and step.messages[0].role == "tool"
        assert text in step.messages[0].content
    step = episode.step('{"name": "ls", "arguments": {}}')
    assert step.event == "call" and step.n_calls == 1
    assert json.loads(step.messages[0].content) == {"current_directory_content": ["document", "archive"]}
    assert episode.executed_calls() == [[["mkdir(dir_name=['a'])"], ["ls()"]]]  # rejected calls never ran
    result = episode.result()
    episode.close()
    assert result.error_counts == {"unknown_tool": 1, "bad_args": 3, "tool_error": 1, "parse_error": 1}
    assert result.n_errors == 6 and result.n_calls == 2


def test_max_steps_per_turn_force_quits(suite: BFCLSuite) -> None:
    limited = BFCLSuite(subsets=("base",), max_steps_per_turn=3)
    task = _task(limited, "multi_turn_base_0")
    episode = limited.episode(task)
    episode.initial_messages()
    events = [episode.step('{"name": "pwd", "arguments": {}}') for _ in range(3)]
    assert [(s.event, s.done) for s in events] == [("call", False), ("call", False), ("max_steps", True)]
    assert episode.finish_reason == "max_steps"
    with pytest.raises(RuntimeError):
        episode.step("hello")
    result = episode.result()
    assert result.reward == 0.0 and result.checks[0]["passed"] is False
    episode.close()


def test_max_steps_in_last_turn_is_still_checked(suite: BFCLSuite) -> None:
    """As in BFCL: a force-quit in the last turn leaves every turn recorded, so the checker decides."""
    limited = BFCLSuite(subsets=("base",), max_steps_per_turn=6)
    task = _task(limited, "multi_turn_base_0")
    turns = limited.reference_calls(task)
    episode = limited.episode(task)
    episode.initial_messages()
    for calls in turns[:-1]:
        episode.step(_tagged(calls)[0])
        episode.step("ok")
    steps = [episode.step(format_call(c)) for c in turns[-1]]
    steps += [episode.step('{"name": "pwd", "arguments": {}}') for _ in range(2)]
    assert [s.done for s in steps] == [False] * 5 + [True]
    result = episode.result()
    episode.close()
    assert result.reward == 1.0, result.checks


# -- state isolation -----------------------------------------------------------------------------------------------


def test_same_task_twice_gives_the_same_result(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_3")
    turns = suite.reference_calls(task)
    first, obs1, _ = _play(suite, task, turns)
    second, obs2, episode = _play(suite, task, turns, close=False)
    assert first.reward == second.reward == 1.0
    assert obs1 == obs2
    assert episode.result().reward == 1.0  # the checker can run again on the same episode
    episode.close()


def test_modified_state_does_not_leak_into_the_next_episode(suite: BFCLSuite) -> None:
    task = _task(suite, "multi_turn_base_0")
    vandal = suite.episode(task)
    vandal.initial_messages()
    vandal.step('{"name": "cd", "arguments": {"folder": "document"}}')
    step = vandal.step('{"name": "rm", "arguments": {"file_name": "final_report.pdf"}}')
    assert "final_report.pdf" in step.messages[0].content and "error" not in step.messages[0].content.lower()
    listing = vandal.step('{"name": "ls", "arguments": {}}').messages[0].content
    assert "final_report.pdf" not in listing

    # A concurrent episode of the same task, and one started after the first closed, both see the original files.
    concurrent = suite.episode(task)
    concurrent.initial_messages()
    concurrent.step('{"name": "cd", "arguments": {"folder": "document"}}')
    assert "final_report.pdf" in concurrent.step('{"name": "ls", "arguments": {}}').messages[0].content
    concurrent.close()
    vandal.close()
    result, _, _ = _play(suite, task, suite.reference_calls(task))
    assert result.reward == 1.0


def test_long_context_shared_records_do_not_leak(suite: BFCLSuite) -> None:
    """Long-context TravelAPI puts the package's module-level credit-card dicts into every instance."""
    from bfcl.eval_checker.multi_turn_eval.func_source_code.long_context import CREDIT_CARD_EXTENSION

    task = next(
        t for t in suite.tasks("eval", subset="long_context") if t.metadata["involved_classes"] == ["TravelAPI"]
    )
    card = "1234567812345678"
    assert card in CREDIT_CARD_EXTENSION
    before = CREDIT_CARD_EXTENSION[card]["balance"]

    def call(episode: BFCLEpisode, name: str, **arguments: object) -> dict:
        step = episode.step(format_call(ToolCall(name, arguments)))
        assert step.event == "call", step
        return json.loads(step.messages[0].content)

    def balance_in_new_episode() -> float:
        episode = suite.episode(task)
        episode.initial_messages()
        token = call(episode, "authenticate_travel", client_id="c", client_secret="s", refresh_token="r",
                     grant_type="read_write", user_first_name="A", user_last_name="B")["access_token"]  # fmt: skip
        value = call(episode, "get_credit_card_balance", access_token=token, card_id=card)["card_balance"]
        episode.close()
        return value

    episode = suite.episode(task)
    episode.initial_messages()
    token = call(episode, "authenticate_travel", client_id="c", client_secret="s", refresh_token="r",
                 grant_type="read_write", user_first_name="A", user_last_name="B")["access_token"]  # fmt: skip
    call(episode, "set_budget_limit", access_token=token, budget_limit=10.0)
    booked = call(episode, "book_flight", access_token=token, card_id=card, travel_date="2024-12-01",
                  travel_from="SFO", travel_to="LAX", travel_class="economy", travel_cost=1000.0)  # fmt: skip
    assert booked["booking_status"] is True
    assert call(episode, "get_credit_card_balance", access_token=token, card_id=card)["card_balance"] == before - 1000
    episode.close()
    assert CREDIT_CARD_EXTENSION[card]["balance"] == before
    assert balance_in_new_episode() == before


def test_backend_instances_are_released(suite: BFCLSuite) -> None:
    before = _instance_keys()
    task = _task(suite, "multi_turn_long_context_0")
    episode = suite.episode(task)
    episode.initial_messages()
    assert len(_instance_keys() - before) == len(task.metadata["involved_classes"])
    episode.step('{"name": "ls", "arguments": {}}')
    episode.close()
    assert _instance_keys() == before
    with pytest.raises(RuntimeError):  # a closed episode cannot silently restart from the initial state
        episode.step('{"name": "ls", "arguments": {}}')
    _play(suite, task, suite.reference_calls(task))  # finishing releases the episode's instances, result() its own
    assert _instance_keys() == before


# -- packaging -----------------------------------------------------------------------------------------------------


def test_importable_without_the_package_with_an_install_hint() -> None:
    code = (
        "import sys; sys.modules['bfcl'] = None\n"
        "import lopd_core.envs.bfcl as b\n"
        "try:\n    b.BFCLSuite()\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd=REPO)
    assert INSTALL_HINT in out.stdout
