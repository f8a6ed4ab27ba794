"""The study's sample-efficiency table: hand-checked crossings, and a reference that did not improve is said."""

from __future__ import annotations

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
