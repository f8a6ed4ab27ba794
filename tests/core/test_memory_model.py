"""The step memory model: hand-checked parts, the activation count against a hand count of one Llama layer, and the
model against the CPU measurements of bench/step_memory.py (tests/core/fixtures/step_memory_cpu.jsonl)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lopd_core.memory_model import (
    CONFIGS,
    HEAD_BUFFERS,
    MODEL_BUFFERS,
    RUNTIME_FRACTION,
    BackboneShape,
    StepShape,
    backbone_shape,
    largest_tokens,
    layer_activation_floats,
    predict_step,
)

TOY = BackboneShape("toy", layers=2, hidden=8, intermediate=16, vocab=100, params=1000, act_full=50.0, act_lora=40.0,
                    act_frozen=30.0)  # fmt: skip


def test_smollm2_layer_saves_what_a_hand_count_gives():
    """One SmolLM2 layer (d 576, f 1536, 9 heads of 64, 3 kv heads) saves per token: 4 [f] MLP tensors (gate, up,
    act, product), 10 [d] tensors (norm inputs and outputs, q, rotated q, attention output, ...), k and v at the
    kv heads (2 x 192), the rotary cos and sin (2 x 64), the attention's logsumexp per head (9) and 3 RMS scales."""
    hand = 4 * 1536 + 10 * 576 + 2 * 192 + 2 * 64 + 9 + 3
    assert layer_activation_floats(dict(CONFIGS["SmolLM2-135M"])) == hand == 12428
    # a frozen linear keeps no input: LoRA keeps its adapters' inputs and ranks, a frozen layer only what the
    # gradient to its input needs
    lora, frozen = (layer_activation_floats(dict(CONFIGS["SmolLM2-135M"]), t) for t in ("lora", "none"))
    assert frozen < lora < hand


def test_backbone_shapes_count_the_published_parameters():
    assert backbone_shape("Qwen3-8B").params == 8_190_735_360  # 8.2B, untied head
    assert backbone_shape("Qwen3-4B").params == 4_022_468_096  # 4.0B, tied
    with pytest.raises(ValueError, match="unknown backbone"):
        backbone_shape("gpt-9")


def test_parts_by_hand():
    s = StepShape(TOY, "lopd", tokens=10, action_tokens=4, latent_tokens=2, encoder_tokens=6, student="lora",
                  trainable=20, composer=30, checkpointing=False, dtype_bytes=4, chunk_size=3)  # fmt: skip
    p = predict_step(s)
    out = lambda t: MODEL_BUFFERS * t * 8 * 4  # noqa: E731
    assert p.parts["student_activations"] == out(10) + 2 * 40 * 10 * 4  # a LoRA student
    assert p.parts["teacher_activations"] == out(12) + 2 * 30 * 12 * 4  # frozen, back-propagating into its latents
    assert p.parts["encoder_activations"] == out(6) + 2 * 40 * 6 * 4  # the encoder's LoRA
    assert p.parts["loss_head"] == HEAD_BUFFERS["latent"] * 3 * 100 * 4 + 4 * 4 * 8 * 4
    assert p.parts["layer_rebuild"] == 0  # no checkpointing: every layer's activations are kept
    assert p.parts["gradients"] == 50 * 4 and p.parts["adamw_moments"] == 2 * 50 * 4
    assert p.weights == 1000 * 4 + 2 * 30 * 4
    saved = sum(p.parts[k] for k in ("student_activations", "teacher_activations", "encoder_activations"))
    backward = saved + p.parts["loss_head"] + 50 * 4
    assert p.parts["runtime"] == RUNTIME_FRACTION * 1000 * 4
    assert p.step_peak_excluding_weights == max(backward, 3 * 50 * 4) + RUNTIME_FRACTION * 1000 * 4
    # checkpointing keeps one [T, d] input a layer, and the layer's backward rebuilds its activations
    on = predict_step(replace(s, checkpointing=True))
    assert on.parts["student_activations"] == out(10) + 2 * 8 * 10 * 4
    # the largest pass's rebuilt layer: the student's 10 LoRA tokens (400) over the frozen teacher's 12 (360)
    assert on.parts["layer_rebuild"] == max(40 * 10, 30 * 12, 40 * 6) * 4 == 1600
    # a frozen text teacher keeps its output only; GRPO has none and no encoder
    opsd = predict_step(replace(s, method="opsd", context_tokens=5))
    assert opsd.parts["teacher_activations"] == out(15) and opsd.parts["encoder_activations"] == 0
    assert predict_step(replace(s, method="grpo")).parts["teacher_activations"] == 0


def test_full_fine_tuning_and_fsdp():
    s = StepShape(TOY, "opsd", tokens=10, action_tokens=4, student="full", checkpointing=True, world_size=1)
    p = predict_step(replace(s, checkpointing=False))
    assert p.parts["student_activations"] == MODEL_BUFFERS * 10 * 8 * 4 + 2 * 50 * 10 * 4  # every weight
    assert p.weights == 2 * 1000 * 4  # the frozen teacher and the student's copy
    assert p.parts["gradients"] == 1000 * 4 and p.parts["adamw_moments"] == 2 * 1000 * 4
    sharded = predict_step(replace(s, world_size=4))
    layer = (1000 - 100 * 8) / 2
    assert sharded.weights == 1000 * 4 + (1000 / 4 + layer) * 4
    assert sharded.parts["adamw_moments"] == 2 * 1000 / 4 * 4
    with pytest.raises(ValueError, match="FSDP2"):
        predict_step(replace(s, student="lora", world_size=2))


def test_largest_tokens_is_the_last_that_fits():
    s = StepShape(TOY, "lopd", tokens=1024, action_tokens=256, checkpointing=True)
    best = largest_tokens(s, 5e7)
    fits = lambda t: predict_step(replace(s, tokens=t, action_tokens=t // 4)).total  # noqa: E731
    assert best % 1024 == 0 and fits(best) <= 5e7 < fits(best + 1024)


FIXTURE = Path(__file__).parent / "fixtures" / "step_memory_cpu.jsonl"


def test_model_within_15_percent_of_the_cpu_measurements():
    """The rows `python bench/step_memory.py --backbone smollm2-135m ...` printed (docs/distributed.md lists the
    commands): SmolLM2-135M, LOPD / OPSD / GRPO, 2k-16k tokens, checkpointing off and on, LoRA and full."""
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]
    measured = [r for r in rows if "peak_mb" in r]
    assert len(measured) >= 25
    for r in measured:
        shape = r["shape"]
        shape["backbone"] = BackboneShape(**shape["backbone"])
        predicted = predict_step(StepShape(**shape)).step_peak_excluding_weights / 2**20
        assert abs(predicted / r["peak_mb"] - 1) <= 0.15, (r["method"], r["length"], predicted, r["peak_mb"])
