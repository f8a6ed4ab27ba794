"""The study's statistics against hand-checked values: intervals over tasks and seeds, paired deltas, bands."""

from __future__ import annotations

import pytest

from lopd_core.evaluation.study import arm_summary, final_value, generations_to_reach, seed_band, smooth


def test_arm_summary_hand_checked():
    seeds = {0: {"a": 1.0, "b": 0.5, "c": 0.0}, 1: {"a": 1.0, "b": 1.0, "c": 0.0}}
    base = {"a": 0.5, "b": 0.5, "c": 0.0, "d": 1.0}  # "d" was not scored by the arm: left out
    s = arm_summary(seeds, base)
    assert s["n_tasks"] == 3 and s["n_seeds"] == 2
    # per-task means 1.0, 0.75, 0.0: mean 0.5833; sd = 0.5204; t(2) = 4.303; half = 4.303 * 0.5204 / sqrt(3)
    assert s["reward_tasks"].value == pytest.approx(58.3333, abs=1e-3)
    assert s["reward_tasks"].hi == pytest.approx(100.0)  # clipped to the score's range
    assert s["reward_tasks"].lo == pytest.approx(max(0.0, 58.3333 - 100 * 4.303 * 0.520416 / 3**0.5), abs=1e-2)
    # seeds' means 0.5 and 0.6667: t(1) = 12.706, sd = 0.11785, half = 12.706 * 0.11785 / sqrt(2)
    assert s["reward_seeds"].value == pytest.approx(58.3333, abs=1e-3)
    assert s["reward_seeds"].lo == pytest.approx(0.0)
    assert s["success_tasks"].value == pytest.approx(100 * (1.0 + 0.5 + 0.0) / 3, abs=1e-3)
    # paired deltas per task: 0.5, 0.25, 0.0 -> mean 0.25, sd 0.25, half = 4.303 * 0.25 / sqrt(3) = 0.62108
    assert s["delta_reward"].value == pytest.approx(25.0)
    assert s["delta_reward"].lo == pytest.approx(25.0 - 62.108, abs=1e-2)
    assert s["delta_reward"].hi == pytest.approx(25.0 + 62.108, abs=1e-2)
    assert s["delta_success"].value == pytest.approx(100 * (1.0 + 0.5 + 0.0) / 3, abs=1e-3)  # base solves none


def test_a_consistent_improvement_has_an_interval_above_zero():
    tasks = [f"t{i}" for i in range(40)]
    base = {t: 0.0 if i % 2 else 1.0 for i, t in enumerate(tasks)}
    better = {t: 1.0 if i % 4 != 3 else 0.0 for i, t in enumerate(tasks)}  # fixes half the failures
    s = arm_summary({0: better, 1: better, 2: better}, base)
    assert s["delta_reward"].lo > 0
    worse = arm_summary({0: {t: 0.0 for t in tasks}}, base)
    assert worse["delta_reward"].hi < 0
    with pytest.raises(ValueError, match="no task"):
        arm_summary({0: {"x": 1.0}}, {"y": 1.0})


def test_smoothing_bands_and_sample_efficiency():
    assert smooth([0, 2, 4, 6], 2) == [0, 1, 3, 5]
    band = seed_band([([10, 20, 30, 40], [0.0, 0.2, 0.4, 0.6]), ([10, 20, 30, 40, 50], [0.2, 0.2, 0.6, 0.6, 9])])
    assert band.x == [10, 20, 30, 40]  # cut to the shortest
    assert band.mean == pytest.approx([0.1, 0.2, 0.5, 0.6])
    assert band.hi[0] - band.mean[0] == pytest.approx(0.1414, abs=1e-4)  # sd of (0, 0.2)
    assert final_value(band, tail=0.5) == pytest.approx(0.55)
    assert generations_to_reach(band.x, band.mean, 0.5) == 30
    assert generations_to_reach(band.x, band.mean, 0.9) is None
    # a reward's band as drawn: mean - sd = 0.1 - 0.1414 < 0 is clipped to 0, the mean is kept
    shown = band.clipped()
    assert band.lo[0] == pytest.approx(-0.0414, abs=1e-4) and shown.lo[0] == 0.0
    assert shown.mean == band.mean and shown.hi[0] == band.hi[0] and shown.lo[1:] == band.lo[1:]
    assert seed_band([([1, 2], [0.9, 1.0]), ([1, 2], [1.0, 1.0])]).clipped().hi[0] == 1.0  # 0.95 + 0.07 -> 1
