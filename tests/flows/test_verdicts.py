"""The study's verdict tables (flows.verdicts) on a hand-checked case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.verdicts import Episode, read_episodes, verdicts, verdicts_markdown


def ep(env, reward, passed=None, without=None):
    return Episode(env, reward, 1 if passed is not None else 0, passed, without)


# warm start: a1 failed only by the code, a2 failed otherwise, b1 solved, b2 failed only by the code
BASE = {"a1": ep("A", 0.0, False, 1.0), "a2": ep("A", 0.0, True, 0.5), "b1": ep("B", 1.0, True, 1.0),
        "b2": ep("B", 0.0, False, 1.0)}  # fmt: skip
X = {
    0: {"a1": ep("A", 1.0, True), "a2": ep("A", 1.0, True), "b1": ep("B", 1.0, True), "b2": ep("B", 0.0, False)},
    1: {"a1": ep("A", 1.0, True), "a2": ep("A", 0.0, False), "b1": ep("B", 0.0, False), "b2": ep("B", 1.0, True)},
}
Y = {s: {t: ep(e.env, 0.0, False) for t, e in run.items()} for s, run in X.items()}  # fails everything


def test_verdicts_hand_checked():
    data = verdicts({"x": X, "y": Y}, BASE, control="y")
    assert data["n_tasks"] == 4 and data["n_clusters"] == 2
    x = data["arms"]["x"]
    assert x["reward"].value == pytest.approx(62.5)  # task means 1, 0.5, 0.5, 0.5
    assert x["rule_pass"].value == pytest.approx(62.5) and x["rule_pass"].n == 8  # 5 of 8 episodes
    assert x["rule_by_env"]["A"].value == pytest.approx(75.0)  # 3 of 4 in A
    # per task minus the warm start: 1, 0.5, -0.5, 0.5 -> +37.5 points
    assert x["vs_warm_start"]["t"].value == pytest.approx(37.5) and x["vs_warm_start"]["cluster"].value == 37.5
    assert x["vs_control"]["t"].value == pytest.approx(62.5)
    # seed 0 solves a1 (code) and a2 (otherwise); seed 1 solves a1 and b2 (both code) and loses b1
    assert x["gains"] == {"solved_by_code": 1.5, "solved_otherwise": 0.5, "lost": 0.5}
    pair = data["pairs"]["x vs y"]
    assert pair["t"].value == pytest.approx(62.5) and pair["mde"] == pytest.approx(2.8016 * pair["se"], rel=1e-3)
    assert "vs_control" not in data["arms"]["y"]
    text = verdicts_markdown(data, "toolworld-rules")
    assert "| x | 2 | 62.5" in text and "x vs y" in text and "| x | 1.5 | 0.5 | 0.5 |" in text


def test_read_episodes_takes_the_student_alone_and_the_first_sample(tmp_path):
    rows = [
        {"benchmark": "b", "task_id": "t1", "env_id": "E", "reward": 1.0, "rule_calls": 2, "rule_passed": True,
         "reward_without_rule": 1.0},
        {"benchmark": "b", "task_id": "t1", "env_id": "E", "reward": 0.0, "sample": 1},
        {"benchmark": "b", "task_id": "t2", "env_id": "E", "reward": 0.0, "context": "latent"},
        {"benchmark": "other", "task_id": "t3", "env_id": "E", "reward": 0.0},
    ]  # fmt: skip
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = read_episodes(tmp_path, "b", prefix="(s1) ")
    assert got == {"(s1) t1": Episode("(s1) E", 1.0, 2, True, 1.0)}


def test_draws_pool_into_one_replicate_per_seed_over_every_draws_tasks(tmp_path):
    """flows.study.pooled_report: each draw's records (found through its study.json) are read with the draw as a
    prefix of task and environment, a seed's runs on every draw form one replicate, and the warm starts of the draws
    one baseline: 2 draws x 2 tasks -> 4 tasks in 2 x 1 environment clusters."""
    from flows.study import pooled_report

    summaries = {}
    for draw, arm_reward in ((1, 1.0), (3, 0.0)):
        folder = tmp_path / f"draw{draw}"
        paths = {}
        for name, reward in (("base", 0.0), ("x0", arm_reward), ("x1", 1.0)):
            run = folder / name
            run.mkdir(parents=True)
            rows = [{"benchmark": "rules", "task_id": t, "env_id": "E", "reward": reward} for t in ("t1", "t2")]
            (run / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            paths[name] = str(run)
        (folder / "report").mkdir()
        study = {"episodes": {"rules": {"base": paths["base"], "arms": {"x": {"0": paths["x0"], "1": paths["x1"]}}}}}
        (folder / "report" / "study.json").write_text(json.dumps(study))
        summaries[draw] = {"report": str(folder / "report" / "report.md")}
    path = pooled_report(summaries, tmp_path / "pooled")
    data = json.loads((tmp_path / "pooled" / "study.json").read_text())["rules"]
    assert data["n_tasks"] == 4 and data["n_clusters"] == 2
    # seed 0: 1, 1 on draw 1 and 0, 0 on draw 3; seed 1: all 1 -> task means 1, 1, 0.5, 0.5 -> 75 points over 0
    assert data["arms"]["x"]["reward"]["value"] == 75.0 and data["arms"]["x"]["vs_warm_start"]["t"]["value"] == 75.0
    assert "rules, draws pooled" in Path(path).read_text()
