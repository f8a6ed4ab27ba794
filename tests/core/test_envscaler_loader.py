"""Real EnvScaler files (a small fixture in their layout): loading, EnvScaler's init and reward, hostile code."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lopd_core.envs.base import Episode, Suite
from lopd_core.envs.envscaler import (
    EnvScalerConfig,
    EnvScalerSuite,
    load_env_items,
    load_scenarios,
    split_scenarios,
)
from lopd_core.sandbox import SandboxLimits

FIXTURES = Path(__file__).parent / "fixtures" / "envscaler"
ENV_FILE = FIXTURES / "191_env_metadata.json"
SCENARIO_FILE = FIXTURES / "envscaler_rl_scenario_metadata.json"
CONFIG = EnvScalerConfig(limits=SandboxLimits(timeout_s=3.0, memory_mb=512), check_timeout_s=2.0)


@pytest.fixture(scope="module")
def suite() -> EnvScalerSuite:
    return EnvScalerSuite.from_files(ENV_FILE, {"train": SCENARIO_FILE}, config=CONFIG)


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def test_environment_items_in_every_layout():
    items = load_env_items(ENV_FILE)
    assert sorted(items) == ["env_1_rl", "env_2_rl"]
    library, counter = items["env_1_rl"], items["env_2_rl"]
    # OpenAI layout and a JSON-string tool list both become flat schemas
    assert [t["name"] for t in library["tools"]] == ["search_books", "borrow_book", "return_book"]
    assert [t["name"] for t in counter["tools"]] == ["add", "spin", "escape", "crash"]
    assert library["tools"][1]["parameters"]["required"] == ["book_id", "member"]
    as_list = load_env_items(list(json.loads(ENV_FILE.read_text()).values()))
    assert as_list["env_1_rl"]["tools"] == library["tools"]
    with pytest.raises(ValueError, match="lacks"):
        load_env_items({"env_x": {"env_id": "env_x", "tools": []}})


def test_suite_tasks_follow_the_protocol(suite):
    assert isinstance(suite, Suite)
    tasks = suite.tasks("train")
    assert [t.task_id for t in tasks] == ["lib-001", "lib-hostile", "counter-001"]
    assert suite.skipped == ["orphan: unknown environment 'env_9_rl'"]
    assert suite.tasks("eval") == []
    first = tasks[0]
    assert first.env_id == "env_1_rl" and first.split == "train" and first.suite == "envscaler"
    assert first.instruction == "Lend 'Dune Messiah' to Omar and take 'Emma' back."
    assert [t["name"] for t in first.tools] == ["search_books", "borrow_book", "return_book"]
    episode = suite.episode(first)
    assert isinstance(episode, Episode)
    system, user = episode.initial_messages()
    assert system.role == "system" and "A library catalogue" in system.content
    assert "A book can be lent to one member at a time." in system.content
    assert '{"tool": "borrow_book", "book_id": "...", "member": "..."}' in system.content
    assert user.role == "user" and user.content.startswith(first.instruction)
    episode.close()
    with pytest.raises(ValueError, match="duplicate task_id"):
        EnvScalerSuite(load_env_items(ENV_FILE), {"train": load_scenarios(SCENARIO_FILE)[:1] * 2})


def test_a_solved_scenario_scores_one_and_a_partial_one_the_fraction(suite):
    episode = suite.episode(suite.task("lib-001"))
    episode.initial_messages()
    found = episode.step(call("search_books", query="messiah"))
    assert found.event == "call" and '"B-3"' in found.messages[0].content
    assert episode.step(call("borrow_book", book_id="B-3", member="Omar")).event == "call"
    assert episode.step('{"tool": "return_book", "book_id": "B-2"}').event == "call"  # the flat form
    assert episode.step("Done: lent and returned.").done
    result = episode.result()
    assert result.reward == 1.0 and [c["passed"] for c in result.checks] == [True, True, True]
    assert result.n_calls == 3 and result.n_errors == 0
    assert "borrow_book" in result.trace and "answer: Done: lent and returned." in result.trace

    partial = suite.episode(suite.task("lib-001"))
    partial.step(call("borrow_book", book_id="B-3", member="Omar"))
    assert partial.result().reward == round(2 / 3, 4) == 0.6667  # "Dune is untouched" holds, Emma not back


def test_errors_become_counted_observations(suite):
    episode = suite.episode(suite.task("lib-001"))
    steps = [
        episode.step('{"name": "borrow_book", "arguments": {"book_id": "B-3"'),  # cut JSON
        episode.step(call("renew_book", book_id="B-3")),
        episode.step(call("borrow_book", book_id="B-3")),  # missing member
        episode.step(call("return_book", book_id="B-1")),  # raises ValueError inside the environment
        episode.step(call("borrow_book", book_id="B-3", member="Omar")),
    ]
    assert [s.event for s in steps] == ["parse_error", "unknown_tool", "bad_args", "tool_error", "call"]
    assert all(not s.done and s.messages[0].role == "tool" for s in steps)
    assert "Available tools: search_books, borrow_book, return_book" in steps[1].messages[0].content
    assert "missing required argument(s) 'member'" in steps[2].messages[0].content
    assert "ValueError: B-1 is not lent" in steps[3].messages[0].content
    two = episode.step(call("search_books", query="dune") + "\n" + call("borrow_book", book_id="B-1", member="Ann"))
    assert two.event == "extra_calls" and len(two.messages) == 1  # one action per step, as in EnvScaler
    assert '"B-1"' in two.messages[0].content and "1 more in your reply were ignored" in two.messages[0].content
    result = episode.result()
    assert result.error_counts == {
        "parse_error": 1, "unknown_tool": 1, "bad_args": 1, "tool_error": 1, "extra_calls": 1,
    }  # fmt: skip
    assert result.n_errors == 5 and result.n_calls == 5  # the cut JSON never became a call
    assert result.checks[2]["passed"]  # the ignored second call did not lend Dune


def test_envscaler_init_without_constructor_argument_and_initial_state(suite):
    episode = suite.episode(suite.task("counter-001"))
    assert '"value": 8' in episode.step(call("add", amount=3)).messages[0].content  # init_config set value=5
    assert episode.result().reward == 1.0


def test_hostile_tools_are_contained_and_the_episode_continues(suite):
    marker = Path("/dev/shm/lopd-envscaler-fixture-escape.txt")
    marker.unlink(missing_ok=True)
    episode = suite.episode(suite.task("counter-001"))
    assert episode.step(call("add", amount=1)).event == "call"
    spin = episode.step(call("spin"))
    assert spin.event == "tool_error" and "timed out" in spin.messages[0].content
    escape = episode.step(call("escape"))
    assert escape.event == "tool_error" and "write outside the sandbox directory" in escape.messages[0].content
    crash = episode.step(call("crash"))
    assert crash.event == "tool_error" and "exited with code 1" in crash.messages[0].content
    # the environment was rebuilt from its last state after the timeout and the crash: value is still 6
    assert '"value": 8' in episode.step(call("add", amount=2)).messages[0].content
    assert not marker.exists()
    result = episode.result()
    assert result.reward == 1.0 and result.error_counts["tool_error"] == 3


def test_hostile_check_functions_fail_alone_and_the_run_continues(suite):
    marker = Path("/dev/shm/lopd-envscaler-fixture-check.txt")
    marker.unlink(missing_ok=True)
    episode = suite.episode(suite.task("lib-hostile"))
    episode.step(call("borrow_book", book_id="B-1", member="Ann"))
    t0 = time.monotonic()
    result = episode.result()
    elapsed = time.monotonic() - t0
    by_name = {c["name"]: c for c in result.checks}
    assert by_name["Dune is lent"]["passed"] and by_name["Ann has a loan"]["passed"]
    assert by_name["loops forever"]["detail"].startswith("timeout")
    assert by_name["allocates 64 GiB"]["detail"].startswith("memory")
    assert "write outside the sandbox directory" in by_name["writes outside its directory"]["detail"]
    assert "os.fork is not allowed" in by_name["forks"]["detail"]
    assert by_name["kills its worker"]["detail"].startswith("crash")
    assert "not bool" in by_name["returns a non-bool"]["detail"]
    assert "KeyError" in by_name["raises"]["detail"]
    assert sum(c["passed"] for c in result.checks) == 2
    assert result.reward == round(2 / 9, 4)  # EnvScaler: failed checks count as 0 in the mean
    assert not marker.exists()
    assert elapsed < 40  # one check timeout (2 s) plus worker restarts, not a hang


def test_an_environment_that_cannot_be_built_fails_every_check():
    items = load_env_items(ENV_FILE)
    broken = {**items["env_1_rl"], "env_class_code": "raise RuntimeError('broken dataset')"}
    scenario = {**load_scenarios(SCENARIO_FILE)[0], "task_id": "broken"}
    suite = EnvScalerSuite({"env_1_rl": broken}, {"eval": [scenario]}, config=CONFIG)
    episode = suite.episode(suite.tasks("eval")[0])
    step = episode.step(call("borrow_book", book_id="B-3", member="Omar"))
    assert step.event == "tool_error" and "broken dataset" in step.messages[0].content
    result = episode.result()
    assert result.reward == 0.0 and all(not c["passed"] for c in result.checks)
    assert "broken dataset" in result.checks[0]["detail"]


def test_split_scenarios_is_seeded_and_disjoint():
    items = [{"task_id": f"t{i}", "env_id": "e", "task": "x", "checklist_with_func": [1]} for i in range(50)]
    a, b = split_scenarios(items, n_eval=10, seed=1), split_scenarios(items, n_eval=10, seed=1)
    assert a == b and len(a["eval"]) == 10 and len(a["train"]) == 40
    assert not {i["task_id"] for i in a["eval"]} & {i["task_id"] for i in a["train"]}
    assert split_scenarios(items, n_eval=10, seed=2)["eval"] != a["eval"]


def test_limits_are_configurable(suite):
    fast = replace(CONFIG, limits=replace(CONFIG.limits, timeout_s=0.5))
    quick = EnvScalerSuite(suite.env_items, {"train": load_scenarios(SCENARIO_FILE)[2:3]}, config=fast)
    episode = quick.episode(quick.tasks("train")[0])
    t0 = time.monotonic()
    assert episode.step(call("spin")).event == "tool_error"
    assert time.monotonic() - t0 < 3
    episode.close()


# ------------------------------------------------------------------------------------------- shared workers

SHARED = replace(CONFIG, episodes_per_worker=3)


def test_a_shared_worker_hosts_episodes_apart_and_is_replaced_after_its_quota():
    suite = EnvScalerSuite.from_files(ENV_FILE, {"train": SCENARIO_FILE}, config=SHARED)
    task = suite.task("counter-001")
    a, b, c = (suite.episode(task) for _ in range(3))
    a.initial_messages(), b.initial_messages(), c.initial_messages()
    assert a._env is b._env is c._env  # one worker, three slots
    assert '"value": 6' in a.step(call("add", amount=1)).messages[0].content
    assert '"value": 15' in b.step(call("add", amount=10)).messages[0].content
    assert '"value": 8' in c.step(call("add", amount=3)).messages[0].content
    assert '"value": 7' in a.step(call("add", amount=1)).messages[0].content  # a's own state, not b's
    d = suite.episode(task)
    d.initial_messages()
    assert d._env is not a._env  # the first worker served its 3 episodes; a new one takes over
    retired = a._env
    assert retired.retired and retired.box.alive  # still hosting a, b and c
    assert [e.result().reward for e in (a, b, c)] == [0.0, 0.0, 1.0]
    assert not retired.box.alive  # closed when its last episode let go
    assert d._env.box.alive
    d.close()
    suite.close()


def test_a_timeout_in_a_shared_worker_restores_every_hosted_episode():
    suite = EnvScalerSuite.from_files(ENV_FILE, {"train": SCENARIO_FILE}, config=SHARED)
    task = suite.task("counter-001")
    quiet, noisy = suite.episode(task), suite.episode(task)
    assert '"value": 7' in quiet.step(call("add", amount=2)).messages[0].content
    assert noisy.step(call("spin")).event == "tool_error"  # kills the shared worker
    assert '"value": 8' in quiet.step(call("add", amount=1)).messages[0].content  # rebuilt from its last state
    assert '"value": 6' in noisy.step(call("add", amount=1)).messages[0].content
    assert quiet.result().reward == 1.0
    noisy.close()
    suite.close()


def test_compact_prompt_lists_signatures_only():
    suite = EnvScalerSuite.from_files(ENV_FILE, {"train": SCENARIO_FILE}, config=replace(CONFIG, prompt="compact"))
    task = suite.task("lib-001")
    episode = suite.episode(task)
    system, user = episode.initial_messages()
    assert system.content == "Tools: search_books(query) borrow_book(book_id, member) return_book(book_id)"
    assert user.content == task.instruction  # no call cue
    episode.close()
    with pytest.raises(ValueError, match="prompt must be one of"):
        EnvScalerConfig(prompt="terse")
