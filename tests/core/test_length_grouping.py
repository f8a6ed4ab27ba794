"""Length grouping (`lopd.length_grouping`): the backbone passes run on groups of records of similar length, each
padded to its own longest, and give the same hidden states, losses and gradients as one pass padded to the
batch's longest record (float64, so the comparison is exact up to rounding)."""

from __future__ import annotations

import copy

import pytest
import torch

from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.models import build_models, hidden_at
from lopd_core.serialization import ChatSerializer, aligned_action_positions, length_groups
from lopd_core.step import LatentContext, LOPDObjective, TrainStep


def test_groups_by_hand() -> None:
    # sorted: 100 (0), 110 (2), 120 (3) | 580 (4), 600 (1): adding 580 to the first group would pad 4 x 580 = 2320
    # tokens for 910 real ones (> 1.25 x); 2 x 600 = 1200 <= 1.25 x 1180
    assert length_groups([100, 600, 110, 120, 580], 1.25) == [[0, 2, 3], [1, 4]]
    assert length_groups([100, 600, 110, 120, 580], None) == [[0, 1, 2, 3, 4]]
    assert length_groups([5, 5, 5], 1.0) == [[0, 1, 2]]  # equal lengths: no padding at all, one group
    assert length_groups([4, 8], 1.0) == [[0], [1]]
    assert length_groups([4, 8], 1.5) == [[0, 1]]  # 2 x 8 = 16 <= 1.5 x 12


def traj(i: int, turns: int, reward: float) -> Trajectory:
    msgs = [Message("system", "You are an agent. Tools: ls(path)."), Message("user", f"List the folder /f{i}")]
    for k in range(turns):
        msgs += [Message("assistant", '{"name": "ls", "arguments": {"path": "/f' + f"{i}/{k}" + '"}}'),
                 Message("tool", '["a.txt", "b.txt"]' * (1 + k))]  # fmt: skip
    msgs.append(Message("assistant", "It holds a.txt and b.txt."))
    return Trajectory(task_id=f"t{i}", env_id="files", task=f"List the folder /f{i}", reward=reward, messages=msgs)


BATCH = [traj(0, 1, 1.0), traj(1, 6, 0.0), traj(2, 1, 0.5), traj(3, 5, 1.0), traj(4, 2, 0.0)]


def test_hidden_states_and_gradients_match_one_padded_pass(tiny) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    model = model.double()
    ser = ChatSerializer(tok)
    batch = ser.collate([ser.student_view(t) for t in BATCH])
    assert len(length_groups(batch.lengths, 1.25)) >= 2, batch.lengths  # the test needs several groups
    rows, pos, _, _ = aligned_action_positions(batch, batch)

    def run(b, idx):  # type: ignore[no-untyped-def]
        return model.model(input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False).last_hidden_state

    outs, grads = [], []
    for padding in (None, 1.25):
        model.zero_grad()
        h = hidden_at(batch, rows, pos, run, padding)
        (h * torch.linspace(-1, 1, h.shape[-1], dtype=h.dtype)).sum().backward()
        outs.append(h.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-9, atol=1e-10)


def retrieve(task: str, task_id: str) -> list[str]:
    return ["Task: list /z\nTrace: ls(/z) -> ok", "Task: read q\nTrace: read(q) -> ok"]


@pytest.mark.parametrize("method", ["lopd", "grpo"])
def test_a_train_step_is_the_same_grouped_or_padded(tiny, method: str) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny
    metrics = []
    for padding in (None, 1.25):
        cfg = LOPDConfig(method=method, n_queries=4, qformer_layers=2, encoder_max_tokens=64, length_grouping=padding)
        torch.manual_seed(0)  # the same adapters and composer on both sides
        models = build_models(copy.deepcopy(model).double(), tok, cfg)
        models.composer.double()
        step = TrainStep(models, ChatSerializer(tok, cfg.max_seq_len), LatentContext(models.composer, retrieve, cfg),
                         LOPDObjective(cfg), cfg) if method == "lopd" else _grpo_step(models, tok, cfg)  # fmt: skip
        metrics.append([step(BATCH) for _ in range(2)])
    for before, after in zip(*metrics, strict=True):
        for key in ("loss", "grad_norm_student", "grad_norm_composer", "beta", "margin"):
            if key in before:
                assert after[key] == pytest.approx(before[key], rel=1e-9, abs=1e-12), key


def _grpo_step(models, tok, cfg):  # type: ignore[no-untyped-def]
    from lopd_core.methods import build_method

    strategy, objective = build_method(models, cfg)
    return TrainStep(models, ChatSerializer(tok, cfg.max_seq_len), strategy, objective, cfg)


@pytest.mark.parametrize("method", ["lopd", "grpo", "opsd"])
def test_a_training_run_keeps_its_metrics(method: str) -> None:
    """A short run (3 steps of 8 records of unequal length, fp32, as the study trains) with one padded pass and
    with length groups: the same losses, beta and weights up to fp32 rounding (the speed-up changes no result)."""
    from tests.core.distributed_case import run_case

    padded, grouped = run_case(method, length_grouping=None), run_case(method)
    for a, b in zip(padded["history"], grouped["history"], strict=True):
        for key in ("loss", "beta", "margin", "reward_mean", "grad_norm_student"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
    for name, w in padded["weights"].items():  # AdamW moves a weight by up to lr = 1e-3 a step, even on a gradient
        # at rounding level: 1e-5 is a hundredth of one step's move
        torch.testing.assert_close(grouped["weights"][name], w, rtol=1e-4, atol=1e-5)
