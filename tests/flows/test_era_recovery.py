"""The era shift's recovery figure (flows.era.recovery) on hand-made per-step environment rewards."""

from __future__ import annotations

from flows.era import recovery, shifted_reward


def steps(shifted_sums: list[float], n: int = 2, per_step: int = 16) -> list[dict]:
    """Per step: the shifted environment S with `n` rollouts summing to the given reward, U one rollout of 1."""
    return [{"step": i, "generations_total": per_step * (i + 1), "envs": {"S": [r, n], "U": [1.0, 1]}}
            for i, r in enumerate(shifted_sums)]  # fmt: skip


def test_the_re_train_recovers_at_the_first_window_that_reaches_the_era_0_level():
    before = steps([0.0, 0.5, 1.0, 1.5])  # its last quarter (one step): 1.5 / 2 = 0.75
    assert shifted_reward(before[-1:], {"S"}) == 0.75 and shifted_reward(before, {"U"}) == 1.0
    after = steps([0, 0, 0.5, 1.0, 1.5, 2, 2, 2])  # windows of 2 steps: 0, .125, .375, .625, .875 (step 5: 96)
    assert recovery(before, after, {"S"}) == {"target": 0.75, "budget": 128, "generations": 96}


def test_no_recovery_and_no_target():
    before = steps([2.0, 2.0, 2.0, 2.0])  # 1.0: never reached below
    assert recovery(before, steps([0, 1, 1, 1]), {"S"})["generations"] is None
    assert recovery([], steps([2, 2]), {"S"}) == {"target": None, "budget": 32, "generations": None}
    assert recovery(before, steps([2, 2]), {"X"})["target"] is None  # no rollout on the shifted environments


def test_the_new_era_config_validates_like_one_read_from_a_file():
    """`for_era` renames the suite and the benchmarks that score it, and the result validates as a stage reads it
    (a subprocess stage validates its spec from JSON: the benchmark name pattern must take `-era<n>`)."""
    from components.evaluate import EvaluateSpec
    from flows.config import PipelineConfig, preset_config
    from flows.era import ERA_SHIFT

    cfg1 = preset_config("study-rules", list(ERA_SHIFT)).for_era(1)
    assert cfg1.suite == "toolworld-rules-s1-digits-era1"
    assert {b.name for b in cfg1.evaluate.benchmarks} == {"toolworld-rules-s1-digits-era1"}
    assert PipelineConfig.model_validate(cfg1.model_dump(mode="json")) == cfg1
    EvaluateSpec.model_validate({"benchmarks": [b.model_dump(mode="json") for b in cfg1.evaluate.benchmarks]})
