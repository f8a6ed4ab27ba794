"""The report's per-task statistics and the pipeline run's tables, against hand-computed values."""

from __future__ import annotations

import json

import pytest

from flows.report import add_task_stats, arms_table, evaluation_table, pipeline_metrics


def records(path, rewards: dict[str, float], benchmark: str = "toolworld"):
    path.mkdir(parents=True)
    lines = [{"benchmark": benchmark, "task_id": t, "reward": r, "sample": 0} for t, r in rewards.items()]
    lines.append({"benchmark": benchmark, "task_id": "t1", "reward": 1.0, "sample": 1})  # a second sample: not read
    (path / "records.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def row(run_id, method, arm=None, seed=None, value=50.0):
    return {"run_id": run_id, "method": method, "arm": arm or method, "seed": seed, "label": f"{arm or method} {seed}",
            "train_run_id": f"train-{run_id}" if method != "base" else None,
            "benchmarks": {"toolworld": {"value": value, "lo": 0.0, "hi": 100.0, "n": 4}}}  # fmt: skip


def test_success_has_a_wilson_interval_and_the_delta_is_paired_per_task(tmp_path):
    base = records(tmp_path / "base", {"t1": 1.0, "t2": 0.0, "t3": 0.0, "t4": 1.0})
    arm = records(tmp_path / "arm", {"t1": 1.0, "t2": 1.0, "t3": 0.0, "t4": 1.0, "t5": 1.0})  # t5: base lacks it
    rows = [row("b", "base"), row("a", "lopd", seed=0)]
    add_task_stats(rows, {"b": base, "a": arm})
    # 4 of 5 solved: Wilson (z = 1.96) centre (0.8 + 0.3842) / 1.7683, half 1.96 sqrt(0.032 + 0.0384) / 1.7683
    success = rows[1]["benchmarks"]["toolworld"]["success"]
    assert (success["value"], success["n"]) == (80.0, 5)
    assert success["lo"] == pytest.approx(37.55, abs=0.01) and success["hi"] == pytest.approx(96.38, abs=0.01)
    # paired on the 4 shared tasks: diffs 0, 1, 0, 0 -> mean 0.25, sd 0.5, se 0.25, t(3) = 3.182: [-0.546, 1.046]
    delta = rows[1]["benchmarks"]["toolworld"]["delta"]
    assert delta["value"] == 25.0 and delta["n"] == 4
    assert delta["lo"] == pytest.approx(-54.56, abs=0.02) and delta["hi"] == 100.0  # clipped to [-100, 100]
    assert "delta" not in rows[0]["benchmarks"]["toolworld"]  # the base model is the reference
    assert rows[0]["benchmarks"]["toolworld"]["success"]["value"] == 50.0
    # 0 of 4: a t interval over tasks that all scored 0 is [0, 0]; Wilson's is not
    none = records(tmp_path / "none", {"t1": 0.0, "t2": 0.0, "t3": 0.0, "t4": 0.0})
    zero = [row("z", "grpo", seed=0, value=0.0)]
    add_task_stats(zero, {"z": none})
    assert zero[0]["benchmarks"]["toolworld"]["success"]["hi"] == pytest.approx(48.99, abs=0.01)
    table = evaluation_table(rows + zero, {})
    assert "toolworld success % [Wilson]" in table and "0.0 [0.0, 49.0]" in table and "+25.0 [-54.5, +100.0]" in table
    assert "0 (reference)" in table


def test_arms_table_and_pipeline_metrics_average_over_seeds():
    rows = [row("b", "base", value=20.0), row("a0", "lopd", seed=0, value=30.0), row("a1", "lopd", seed=1, value=50.0)]
    rows[1]["benchmarks"]["toolworld"] |= {"delta": {"value": 10.0}, "success": {"value": 25.0}}
    rows[2]["benchmarks"]["toolworld"] |= {"delta": {"value": 30.0}, "success": {"value": 75.0}}
    training = [{"run_id": "train-a0", "final_generations": 64.0}, {"run_id": "train-a1", "final_generations": 96.0}]
    table = arms_table({"evaluations": rows, "training": training})
    assert table["columns"] == ["arm", "method", "seeds", "toolworld score", "toolworld Δ vs base",
                                "toolworld success %", "train generations"]  # fmt: skip
    assert table["data"] == [["base", "base", 1, 20.0, None, None, 0.0], ["lopd", "lopd", 2, 40.0, 20.0, 50.0, 80.0]]
    metrics = pipeline_metrics({"evaluations": rows, "training": []})
    assert metrics == {"base/eval/toolworld": 20.0, "lopd/eval/toolworld": 40.0,
                       "lopd/eval/toolworld/delta_vs_base": 20.0}  # fmt: skip
