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
