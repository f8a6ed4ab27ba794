"""The study's sample-efficiency table: hand-checked crossings, and a reference that did not improve is said."""

from __future__ import annotations

import pytest

from flows.study import _efficiency_markdown, sample_efficiency
from lopd_core.evaluation.study import Band


def band(x, y):
    return Band(list(x), list(y), list(y), list(y))


def test_sample_efficiency_crossings_hand_checked():
    bands = {
        "grpo": band([100, 200, 300, 400], [0.1, 0.2, 0.3, 0.4]),
        "lopd": band([100, 200, 300, 400], [0.1, 0.5, 0.5, 0.5]),
    }
    eff = sample_efficiency(bands, "grpo")
    assert eff["reference_improved"] is True and eff["reference_generations"] == 400
    assert eff["arms"]["lopd"]["generations"] is not None and eff["arms"]["lopd"]["generations"] <= 200
    assert "did not rise" not in _efficiency_markdown(eff, "grpo")


def test_a_reference_that_did_not_improve_is_reported_as_such():
    bands = {"grpo": band([100, 200, 300], [0.3, 0.2, 0.1]), "lopd": band([100, 200, 300], [0.3, 0.3, 0.3])}
    eff = sample_efficiency(bands, "grpo")
    assert eff["reference_improved"] is False
    assert "training reward did not rise" in _efficiency_markdown(eff, "grpo")


def test_the_study_arms_flags_add_variants_that_the_config_accepts():
    from flows.config import load_config
    from flows.study import with_arms

    cfg = load_config("configs/study-rules.yaml", ["methods=[grpo,opsd,lopd]"])
    both = with_arms(cfg, ablation=True, family=True)
    assert {"opsd forward-kl", "opsd vopd", "lopd balanced", "lopd ra-opd", "lopd m=0", "lopd frozen composer"} <= set(
        both.variants
    )
    # each arm's overrides resolve to a valid LOPD config (a typo in a dotted key fails here)
    family = both.arm_config("opsd forward-kl")[0], both.arm_config("lopd balanced")[0]
    assert family[0].method == "opsd" and family[0].opd.divergence == "forward_kl"
    assert family[1].method == "lopd" and family[1].margin_advantage == "balanced"
    for name in both.variants:
        both.arm_config(name)
    hybrid, train = both.arm_config("hybrid diffgate-latent")
    assert hybrid.method == "diffgate_latent" and train.schedule.samples_per_task == 4  # GRPO's groups
    assert with_arms(cfg).variants == cfg.variants
    only_grpo = load_config("configs/study-rules.yaml", ["methods=[grpo]"])
    with pytest.raises(ValueError, match="opsd"):
        with_arms(only_grpo, family=True)


def test_variants_are_paired_with_their_method_and_with_lopd_hand_checked():
    from flows.study import variants_section

    opsd = {0: {"a": 0.0, "b": 1.0}, 1: {"a": 0.0, "b": 1.0}}
    variant = {0: {"a": 1.0, "b": 1.0}, 1: {"a": 0.0, "b": 1.0}}  # seed means: a 0.5, b 1.0
    lopd = {0: {"a": 0.5, "b": 0.5}}
    per_arm = {"opsd": ("opsd", opsd), "opsd fwd": ("opsd", variant), "lopd": ("lopd", lopd)}
    text, data = variants_section(per_arm, ("lopd", "grpo"))
    assert set(data) == {"opsd fwd"}  # arms named after their method are the references, not variants
    # vs opsd: differences a +0.5, b 0 -> mean +0.25 (x 100 in the table); vs lopd: a 0, b +0.5 -> +0.25
    assert data["opsd fwd"]["opsd"]["value"] == pytest.approx(25.0)
    assert data["opsd fwd"]["lopd"]["value"] == pytest.approx(25.0)
    assert "| opsd fwd | opsd | 25.0 [" in text and text.rstrip().endswith("| - |")  # no grpo arm here
    assert variants_section({"opsd": ("opsd", opsd)}, ("lopd",)) == ("", {})


def test_the_latent_probe_table_averages_each_arms_seeds_cold_and_trained(tmp_path):
    """probe_section reads each train run's `cold_probe_*` and `probe_*` (what components.train logs) from a real
    MLflow store and averages them over seeds; an arm without a latent teacher has no row."""
    from components.tracking import Tracker, train_metric
    from flows.study import probe_section

    tracker = Tracker.open("toolworld-rules", run_dir=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    rows = []
    for seed, own in ((0, 0.9), (1, 0.7)):
        run = tracker.start_stage("train", method="lopd", seed=seed)
        figures = {"probe_own": own, "probe_other": 0.5, "probe_none": 0.4, "probe_rewritten": 0.8,
                   "probe_change_other": 0.1, "probe_drift": -0.05 * (seed + 1), "cold_probe_own": 0.6,
                   "cold_probe_other": 0.5}  # fmt: skip
        for key, value in figures.items():
            tracker.client.log_metric(run.run_id, train_metric(key), value, step=0)
        run.end()
        rows.append({"arm": "lopd", "train_run_id": run.run_id})
    grpo = tracker.start_stage("train", method="grpo", seed=0)
    grpo.end()
    rows.append({"arm": "grpo", "train_run_id": grpo.run_id})
    text, table = probe_section(tracker, rows, ["lopd", "grpo"])
    assert set(table) == {"lopd"} and table["lopd"]["seeds"] == 2
    assert table["lopd"]["probe_own"] == pytest.approx(0.8) and table["lopd"]["cold_probe_own"] == pytest.approx(0.6)
    assert "| lopd | 2 | 0.60 | 0.50 | - | - | - | - | 0.80 | 0.50 | 0.40 | 0.80 | 0.10 | -0.075 |" in text
    assert "trained drift" in text


def test_seed_means_keep_a_variant_apart_from_its_method():
    """The report's 'Mean over seeds' groups by arm: `grpo shuffled` (method grpo) is not pooled with `grpo`."""
    from flows.report import seed_means

    def row(arm: str, method: str, seed: int, value: float) -> dict:
        return {"arm": arm, "method": method, "seed": seed, "benchmarks": {"b": {"value": value}}}

    rows = [row("grpo", "grpo", 0, 40.0), row("grpo", "grpo", 1, 50.0), row("grpo shuffled", "grpo", 0, 30.0)]
    means = {m["method"]: m for m in seed_means(rows)}
    assert means["grpo"]["seeds"] == [0, 1] and means["grpo"]["mean"]["b"] == 45.0
    assert means["grpo"]["std"]["b"] == pytest.approx(7.0710678)  # sample std of 40, 50
    assert means["grpo shuffled"]["seeds"] == [0] and means["grpo shuffled"]["mean"]["b"] == 30.0
