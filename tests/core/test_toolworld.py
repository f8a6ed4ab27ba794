"""The built-in toolworld suite: shipped data = regeneration, splits, graded difficulty, verified scenarios."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from lopd_core.envs.envscaler import load_env_items, load_scenarios
from lopd_core.envs.toolworld import DATA_DIR, ENV_FILE, SPLIT_FILES, load_toolworld
from lopd_core.envs.toolworld.envs.bank import BankEnv
from lopd_core.envs.toolworld.envs.calendar_app import CalendarEnv
from lopd_core.envs.toolworld.envs.smarthome import SmartHomeEnv
from lopd_core.envs.toolworld.generate import compose, fingerprint, render
from lopd_core.envs.toolworld.scenarios import ENVIRONMENTS


@pytest.fixture(scope="module")
def suite():
    return load_toolworld()


@pytest.fixture(scope="module")
def scenarios() -> dict[str, list[dict]]:
    return {split: load_scenarios(DATA_DIR / name) for split, name in SPLIT_FILES.items()}


def test_shipped_files_equal_a_regeneration():
    files = render()
    assert sorted(files) == sorted([ENV_FILE, *SPLIT_FILES.values()])
    for name, text in files.items():
        assert (DATA_DIR / name).read_text(encoding="utf-8") == text, (
            f"{name}: run python -m lopd_core.envs.toolworld.generate"
        )
    assert sum(len(t.encode()) for t in files.values()) < 5 * 1024 * 1024


def test_eight_environments_of_different_kinds():
    items = load_env_items(DATA_DIR / ENV_FILE)
    assert len(items) == len(ENVIRONMENTS) >= 8
    assert len({item["environment_summary"] for item in items.values()}) == len(items)
    for env_id, item in items.items():
        assert f"class {item['env_class_name']}" in item["env_class_code"], env_id
        assert len(item["tools"]) >= 6 and item["constraints_rules"] and item["environment_introduction"]
        names = [t["name"] for t in item["tools"]]
        assert len(set(names)) == len(names)
        assert all(t["parameters"]["type"] == "object" and t["description"] for t in item["tools"])
        for example in item["usage_examples"]:
            assert example["call"]["name"] in names


def test_splits_difficulty_levels_and_sizes(suite, scenarios):
    train, evaluation = suite.tasks("train"), suite.tasks("eval")
    assert len(evaluation) == 680 and len(train) >= 700  # 200 + 480 more held-out tasks at levels 1-2 (issue 41)
    low = Counter(t.env_id for t in evaluation if t.difficulty <= 2)
    assert set(low.values()) == {69}  # per environment: 5 + 30 at level 1, 4 + 30 at level 2
    for split, tasks in (("train", train), ("eval", evaluation)):
        levels = Counter(min(t.difficulty, 6) for t in tasks)
        assert sorted(levels) == [1, 2, 3, 4, 5, 6], split
        assert {t.env_id for t in tasks} == {spec.env_id for spec in ENVIRONMENTS}
        assert all(t.split == split and t.suite == "toolworld" for t in tasks)
    for items in scenarios.values():
        for item in items:
            assert item["difficulty"] == len(item["reference_solution"])
            assert 1 <= item["difficulty"] <= 8 and item["checklist_with_func"]
            assert len(item["checklist"]) == len(item["checklist_with_func"])


def test_splits_are_disjoint_by_task_id_and_by_generated_instance(scenarios):
    train, evaluation = scenarios["train"], scenarios["eval"]
    assert not {s["task_id"] for s in train} & {s["task_id"] for s in evaluation}
    assert not {fingerprint(s) for s in train} & {fingerprint(s) for s in evaluation}
    assert not {(s["env_id"], s["task"]) for s in train} & {(s["env_id"], s["task"]) for s in evaluation}
    assert not {json.dumps(s["init_config"], sort_keys=True) for s in train} & {
        json.dumps(s["init_config"], sort_keys=True) for s in evaluation
    }
    # the fingerprint really identifies an instance: changing the initial state changes it
    other = {**evaluation[0], "init_config": {**evaluation[0]["init_config"], "extra": 1}}
    assert fingerprint(other) != fingerprint(evaluation[0])


def test_harder_scenarios_chain_dependent_calls(scenarios):
    items = [s for split in scenarios.values() for s in split]
    hidden, produced = Counter(), Counter()
    for item in items:
        if item["difficulty"] < 3:
            continue
        config_text = json.dumps(item["init_config"])
        values = [v for c in item["reference_solution"] for v in c["arguments"].values()]
        # a value the task does not state must come from an earlier call's result
        if any(str(v) not in item["task"] for v in values if isinstance(v, str)):
            hidden[item["env_id"]] += 1
        # an id that exists in no initial state was created by an earlier call in the same episode
        if any(isinstance(v, str) and re.fullmatch(r"[A-Z]+-\d+", v) and v not in config_text for v in values):
            produced[item["env_id"]] += 1
    for spec in ENVIRONMENTS:
        assert hidden[spec.env_id] >= 20, spec.env_id
    assert sum(produced.values()) >= 20 and len(produced) >= 3


def test_instructions_name_no_tool_and_hold_no_call(suite):
    tool_names = {t["name"] for item in suite.env_items.values() for t in item["tools"] if "_" in t["name"]}
    for task in suite.tasks("train") + suite.tasks("eval"):
        assert "{" not in task.instruction
        assert not [n for n in tool_names if n in task.instruction], task.task_id


def test_compose_is_seeded():
    spec = ENVIRONMENTS[0]
    a = compose(spec, 4, random.Random("seed-a"))
    b = compose(spec, 4, random.Random("seed-a"))
    c = compose(spec, 4, random.Random("seed-b"))
    assert a is not None and c is not None
    assert a[0] == b[0] and a[2] == b[2] and (a[0], a[2]) != (c[0], c[2])
    assert len(a[2]) == 4


def test_reference_solutions_score_one_in_the_sandbox_and_doing_nothing_does_not(suite):
    rng = random.Random(0)
    tasks = suite.tasks("eval")
    picked = [rng.choice([t for t in tasks if t.env_id == spec.env_id]) for spec in ENVIRONMENTS]
    for task in picked:
        episode = suite.episode(task)
        episode.initial_messages()
        for call in suite.scenario(task.task_id)["reference_solution"]:
            flat = json.dumps({"tool": call["name"], **call["arguments"]})
            step = episode.step(flat)
            assert step.event == "call" and json.loads(step.messages[0].content)["success"], task.task_id
        assert episode.step("Done.").done
        result = episode.result()
        assert result.reward == 1.0 and result.n_errors == 0, (task.task_id, result.checks)
        idle = suite.episode(task)
        assert idle.step("Nothing to do.").event == "finish"
        assert idle.result().reward < 1.0


def test_environment_rules_are_enforced():
    home = SmartHomeEnv(
        {"devices": {"light_1": {"name": "lamp", "room": "office", "kind": "light", "on": False, "brightness": 0}}}
    )
    assert not home.set_brightness("light_1", 50)["success"]  # a light must be on first
    assert home.turn_on("light_1")["success"] and home.set_brightness("light_1", 50)["success"]
    assert not home.set_temperature("light_1", 20)["success"]  # not a thermostat
    bank = BankEnv(
        {
            "accounts": {
                "A-1": {"owner": "x", "kind": "checking", "balance": 10.0, "frozen": False},
                "A-2": {"owner": "y", "kind": "savings", "balance": 0.0, "frozen": True},
            }
        }
    )
    assert "frozen" in bank.transfer("A-1", "A-2", 5)["error"]
    assert "insufficient" in bank.transfer("A-2", "A-1", 5)["error"] or not bank.transfer("A-2", "A-1", 5)["success"]
    cal = CalendarEnv(
        {
            "events": {"EV-1": {"title": "a", "date": "2025-05-12", "start": "09:00", "end": "10:00", "attendees": []}},
            "next_event_number": 2,
        }
    )
    assert "overlaps" in cal.create_event("b", "2025-05-12", "09:30", "10:30")["error"]
    assert cal.create_event("b", "2025-05-12", "10:00", "10:30") == {"success": True, "event_id": "EV-2"}
