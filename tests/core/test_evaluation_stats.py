"""Intervals, pass@k, aggregation and the paper-shaped tables, on hand-checked values."""

from __future__ import annotations

import itertools
import math

import pytest

from lopd_core.envs.base import Task
from lopd_core.evaluation.harness import aggregate, flat_metrics, select_tasks
from lopd_core.evaluation.stats import (
    EpisodeRecord,
    Estimate,
    mean_interval,
    pass_at_k,
    pass_block,
    score_block,
    t_quantile_95,
    weighted_mean,
    wilson,
)
from lopd_core.evaluation.tables import behaviour_table, code_table, detail_table, report_markdown, tool_use_table


def test_wilson_matches_hand_computed_values() -> None:
    e = wilson(8, 10)  # p = 0.8, z = 1.96: centre 0.71674, half-width 0.22657
    assert e.value == 80.0 and e.method == "wilson" and e.n == 10
    assert e.lo == pytest.approx(49.02, abs=0.01) and e.hi == pytest.approx(94.33, abs=0.01)
    zero = wilson(0, 10)  # upper bound z^2 / (n + z^2)
    assert zero.lo == 0.0 and zero.hi == pytest.approx(100 * 3.8415 / 13.8415, abs=0.01)
    full = wilson(20, 20)
    assert full.hi == 100.0 and full.lo == pytest.approx(100 * 20 / (20 + 3.8415), abs=0.01)
    assert wilson(0, 0).n == 0
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_t_interval_matches_hand_computed_values() -> None:
    e = mean_interval([0.5, 0.6, 0.7, 0.8, 0.9])  # sd 0.158114, se 0.0707107, t(4) = 2.776
    assert e.value == 70.0 and e.method == "t"
    assert e.lo == pytest.approx(50.37, abs=0.01) and e.hi == pytest.approx(89.63, abs=0.01)
    clipped = mean_interval([0.0, 1.0])  # half-width 12.706 * 0.5: clipped to [0, 100]
    assert (clipped.lo, clipped.hi) == (0.0, 100.0)
    assert t_quantile_95(4) == 2.776 and t_quantile_95(1000) == pytest.approx(1.96, abs=1e-3)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    outcomes = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in d) for d in draws) / len(draws)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 2, 1), (5, 2, 2), (5, 0, 3), (5, 5, 1), (10, 3, 5), (7, 1, 7)])
def test_pass_at_k_is_the_probability_some_of_k_draws_passes(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_rejects_impossible_requests() -> None:
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def _rec(task: str, reward: float, **kw) -> EpisodeRecord:
    return EpisodeRecord(benchmark="b", task_id=task, reward=reward, success=reward >= 1.0, **kw)


def test_score_block_counts_failed_rollouts_as_zero_and_gives_behaviour() -> None:
    records = [
        _rec("a", 1.0, n_steps=4, n_calls=2, n_errors=1),
        _rec("b", 0.5, n_steps=2, n_calls=2),
        _rec("c", 1.0, n_steps=2, n_calls=0, failed=True, finish_reason="error"),
    ]
    block = score_block(records)
    assert block["n"] == 3 and block["failed"] == 1
    assert block["mean_reward"]["value"] == pytest.approx(50.0)  # (1 + 0.5 + 0) / 3
    assert block["success_rate"]["value"] == pytest.approx(100 / 3, abs=1e-3)
    assert block["steps_per_task"] == pytest.approx(8 / 3, abs=1e-4)
    assert block["calls_per_step"] == pytest.approx(4 / 8)  # total calls / total steps
    assert block["errors_per_episode"] == pytest.approx(1 / 3, abs=1e-4)
    assert block["finish_reasons"] == {"": 2, "error": 1}


def test_pass_block_single_sample_is_a_wilson_rate_and_multi_sample_is_unbiased() -> None:
    single = pass_block([_rec("a", 1.0), _rec("b", 0.0), _rec("c", 1.0), _rec("d", 1.0)], ks=(1, 5))
    assert single["pass@1"]["value"] == 75.0 and single["pass@1"]["method"] == "wilson"
    assert "pass@5" not in single  # needs 5 samples per task
    multi = [_rec("a", float(i < 2), sample=i) for i in range(5)] + [_rec("b", 0.0, sample=i) for i in range(5)]
    block = pass_block(multi, ks=(1, 2))
    assert block["samples_per_task"] == 5 and block["pass@1"]["method"] == "t"
    assert block["pass@1"]["value"] == pytest.approx(100 * (0.4 + 0.0) / 2)
    assert block["pass@2"]["value"] == pytest.approx(100 * (0.7 + 0.0) / 2)


def test_weighted_mean_is_task_weighted_with_added_variances() -> None:
    a, b = wilson(50, 100), wilson(10, 20)
    mean = weighted_mean([a, b])
    assert mean.value == pytest.approx((50 * 100 + 50 * 20) / 120)
    equal = weighted_mean([wilson(30, 100), wilson(10, 100)], weights=[1, 1])
    assert equal.value == pytest.approx(20.0) and equal.n == 200
    half = 1.96 * math.sqrt(sum(((p.hi - p.lo) / (2 * 1.96)) ** 2 for p in (wilson(30, 100), wilson(10, 100)))) / 2
    assert equal.hi - equal.value == pytest.approx(half, abs=1e-3)


def test_select_tasks_is_seeded_order_preserving_and_per_group() -> None:
    tasks = [Task(f"t{i}", "e", "eval", "x", metadata={"subset": "ab"[i % 2]}) for i in range(20)]
    one = select_tasks(tasks, 5, seed=0, key="k")
    assert one == select_tasks(tasks, 5, seed=0, key="k") and len(one) == 5
    assert [tasks.index(t) for t in one] == sorted(tasks.index(t) for t in one)
    assert one != select_tasks(tasks, 5, seed=1, key="k")
    per = select_tasks(tasks, 3, seed=0, key="k", by="subset")
    assert sorted(t.metadata["subset"] for t in per) == ["a"] * 3 + ["b"] * 3
    assert select_tasks(tasks, None, 0) == tasks


def _bfcl_records(accuracies: dict[str, int], n: int = 10) -> list[EpisodeRecord]:
    out = []
    for subset, correct in accuracies.items():
        for i in range(n):
            out.append(_rec(f"{subset}-{i}", float(i < correct), subset=subset, env_id=f"bfcl/{subset}", n_steps=3))
    return out


def test_bfcl_headline_is_the_unweighted_mean_of_subset_accuracies() -> None:
    records = _bfcl_records({"base": 5, "miss_func": 2, "miss_param": 0, "long_context": 1})
    records += [_rec(f"extra-{i}", 1.0, subset="base", env_id="bfcl/base") for i in range(10)]  # base: 15 of 20
    metrics = aggregate("bfcl", "bfcl", records, subsets=("base", "miss_func", "miss_param", "long_context"))
    assert metrics["by_subset"]["base"]["success_rate"]["value"] == 75.0
    assert metrics["headline"]["value"] == pytest.approx((75 + 20 + 0 + 10) / 4)
    assert metrics["subsets"] == ["base", "miss_func", "miss_param", "long_context"]
    assert "by_env" not in metrics


def test_tables_have_the_paper_shapes() -> None:
    bfcl_4 = _bfcl_records({"base": 5, "miss_func": 2, "miss_param": 0, "long_context": 1})
    tool = {
        "toolworld": aggregate("toolworld", "agent", [_rec("a", 1.0, n_steps=2, n_calls=2), _rec("b", 0.5)]),
        "bfcl": aggregate("bfcl", "bfcl", bfcl_4),
    }
    code = {
        "humaneval_plus": aggregate("humaneval_plus", "code", [_rec(f"h{i}", float(i < 3)) for i in range(4)]),
        "mbpp_plus": aggregate("mbpp_plus", "code", [_rec(f"m{i}", float(i < 1)) for i in range(12)]),
        "lcb_v5": aggregate("lcb_v5", "code", [_rec("l", 1.0)], family="livecodebench"),
    }
    rows = [("Vanilla", {**tool, **code}), ("Other", {"toolworld": tool["toolworld"]})]
    t1 = tool_use_table(rows)
    header = t1.splitlines()[0]
    assert "toolworld" in header and "BFCL-v3 base" in header and "BFCL-v3 avg" in header
    vanilla = next(line for line in t1.splitlines() if line.startswith("| Vanilla"))
    assert vanilla.split(" | ")[1:3] == ["75.0", "50.00"]  # mean reward x 100; BFCL base accuracy
    assert vanilla.rstrip(" |").endswith("20.00")  # (50 + 20 + 0 + 10) / 4
    other = next(line for line in t1.splitlines() if line.startswith("| Other"))
    assert other.count("—") == 5
    t2 = code_table(rows)
    assert t2.splitlines()[0] == "| Method | lcb_v5 | HumanEval+ | MBPP+ | EvalPlus avg |"
    assert t2.splitlines()[2].rstrip(" |").endswith(f"{100 * 4 / 16:.1f}")  # (3 + 1) passes / 16 tasks
    t3 = behaviour_table(rows)
    assert "| Vanilla | Built-in (toolworld) | 2 | 1.00 | 1.00 | 0.00 |" in t3  # 2 calls / 2 steps
    report = report_markdown("Eval", rows, details=rows[0][1])
    assert "tab. 1" in report and "tab. 2" in report and "tab. 3" in report and "[" in detail_table(code)


def test_flat_metrics_names_every_group() -> None:
    metrics = {"bfcl": aggregate("bfcl", "bfcl", _bfcl_records({"base": 5, "miss_func": 2}))}
    flat = flat_metrics(metrics, prefix="eval/")
    assert flat["eval/bfcl/headline"] == pytest.approx(35.0)
    assert flat["eval/bfcl/subset/base/success_rate"] == 50.0
    assert flat["eval/bfcl/overall/steps_per_task"] == 3.0
    assert all(isinstance(v, float) for v in flat.values())


def test_estimate_round_trips_and_formats() -> None:
    e = wilson(1, 3)
    assert Estimate.from_dict(e.to_dict()) == e
    assert e.format(1) == f"{e.value:.1f} [{e.lo:.1f}, {e.hi:.1f}]"
