"""The joint train step on the tiny backbone: it learns, the dual variable moves the right way, bad input."""

from __future__ import annotations

import pytest
import torch

from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.step import LatentContext, LOPDObjective, TrainStep

CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64)


def make_batch(rewards=(1.0, 0.0, 0.5)):
    def traj(i, r):
        return Trajectory(
            task_id=f"t{i}",
            env_id="files",
            task=f"List the folder /f{i}",
            reward=r,
            messages=[
                Message("system", "You are an agent. Tools: ls(path)."),
                Message("user", f"List the folder /f{i}"),
                Message("assistant", '{"name": "ls", "arguments": {"path": "/f' + str(i) + '"}}'),
                Message("tool", '["a.txt", "b.txt"]'),
                Message("assistant", "It holds a.txt and b.txt."),
            ],
        )

    return [traj(i, r) for i, r in enumerate(rewards)]


def retrieve(task, task_id):
    return [f"Task: list /z\nTrace: ls(/z) -> ok ({task_id} excluded)", "Task: read q\nTrace: read(q) -> ok"]


class ListSink:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics):
        self.rows.append((step, dict(metrics)))


def make_step(tiny, sink=None, **overrides):
    model, tok = tiny
    cfg = CFG.model_copy(update=overrides)
    models = build_models(model, tok, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a student that differs from the teacher, so there is something to distil
        for n, p in models.backbone.named_parameters():
            if ".student." in n and "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ser = ChatSerializer(tok, max_seq_len=cfg.max_seq_len)
    return TrainStep(models, ser, LatentContext(models.composer, retrieve, cfg), LOPDObjective(cfg), cfg, sink)


def test_a_few_steps_lower_distill_kl(tiny):
    sink = ListSink()
    step = make_step(tiny, sink, student_lr=3e-3, composer_lr=1e-3)
    batch = make_batch()
    kls = [step(batch)["distill_kl"] for _ in range(6)]
    assert kls[0] > 1e-3
    assert kls[-1] < 0.7 * kls[0], kls
    assert [s for s, _ in sink.rows] == list(range(6))
    keys = {"distill_kl", "margin", "beta", "anchor", "privilege", "teacher_topm_mass", "tail_mass",
            "n_action_tokens", "n_overlength", "step_seconds"}  # fmt: skip
    assert keys <= sink.rows[-1][1].keys()
    assert sink.rows[0][1]["anchor"] == pytest.approx(0.0, abs=1e-10)  # c_phi equals c_phi0 before any update


def test_beta_rises_while_margin_below_target_and_decays_to_zero_above(tiny):
    step = make_step(tiny, margin_target=5.0)  # unreachable: Delta < m every step
    betas = [step(make_batch())["beta"] for _ in range(3)]
    assert betas[0] > 0 and betas[1] > betas[0] and betas[2] > betas[1]
    m = step.objective.cfg.margin_target
    step2 = make_step(tiny, margin_target=-5.0, beta_init=4.0)  # Delta > m every step
    rows = [step2(make_batch()) for _ in range(3)]
    # beta <- max(0, beta + 0.5 (m - Delta)) with m - Delta close to -5: 4 -> ~1.5 -> 0 -> 0
    assert rows[0]["beta"] == pytest.approx(max(0.0, 4.0 + 0.5 * (-5.0 - rows[0]["margin"])), abs=1e-9)
    assert rows[1]["beta"] == 0.0 and rows[2]["beta"] == 0.0
    assert m == 5.0


def test_failed_and_overlength_rollouts_are_excluded_and_counted(tiny):
    step = make_step(tiny, max_seq_len=80)
    batch = make_batch()
    batch[0].failed = True
    long_one = make_batch()[1]
    long_one.messages[3] = Message("tool", "x " * 400)
    out = step([*batch, long_one])
    assert out["failed_rollouts"] == 1.0
    assert out["n_overlength"] >= 1.0
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        make_step(tiny, max_seq_len=80, fail_on_overlength=True)([long_one])


def test_a_latent_span_past_max_seq_len_is_skipped_and_counted(tiny):
    """fail_on_overlength=false skips and counts whatever part of the sequence is over, the latent span too."""
    batch = make_batch()
    long_prompt = batch[0]
    long_prompt.messages[0] = Message("system", "You are an agent. Tools: " + "ls(path), " * 40)
    probe = make_step(tiny)
    teacher = probe.serializer.view(long_prompt.messages, probe.strategy.contexts([long_prompt])[0])
    limit = teacher.latent_start + 1  # the span starts inside the limit and runs past it
    assert limit > 64 and teacher.latent_len > 1
    out = make_step(tiny, max_seq_len=limit)(batch)
    assert out["n_overlength"] == 1.0 and out["n_records"] == 2.0 and out["updated"] == 1.0
    with pytest.raises(ValueError) as info:
        make_step(tiny, max_seq_len=limit, fail_on_overlength=True)([long_prompt])
    assert str(info.value) == (
        f"1 sequences exceed max_seq_len={limit}: ['t0']; raise max_seq_len, or set fail_on_overlength=false to "
        "leave them out of the loss and count them (n_overlength)"
    )


def test_placeholder_experiences_are_counted(tiny):
    """Two retrieved items for J=3 slots: the composer fills one slot per record with its placeholder item."""
    out = make_step(tiny)(make_batch())
    assert CFG.n_retrieved == 3 and out["n_placeholder_experiences"] == 3.0 and out["n_no_context"] == 0.0


def test_all_failed_batch_takes_no_step(tiny):
    step = make_step(tiny)
    batch = make_batch()
    for t in batch:
        t.failed = True
    before = [p.clone() for p in step.models.student_parameters()]
    out = step(batch)
    assert out["updated"] == 0.0 and out["failed_rollouts"] == 3.0
    assert all(torch.equal(a, b) for a, b in zip(before, step.models.student_parameters(), strict=True))


def test_one_optimizer_with_two_groups_and_record_normalisation(tiny):
    step = make_step(tiny, loss_normalization="record", student_lr=2e-5, composer_lr=1e-5)
    groups = {g["name"]: g["lr"] for g in step.optimizer.param_groups}
    assert groups == {"student": 2e-5, "composer": 1e-5}
    out = step(make_batch())
    assert out["updated"] == 1.0 and torch.isfinite(torch.tensor(out["loss"]))


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("top_m: 0\nanchor_reduction: max\n")
    with pytest.raises(ValueError, match="top_m") as exc:
        LOPDConfig.from_yaml(bad)
    assert "anchor_reduction" in str(exc.value)
    bad.write_text("topm: 3\n")
    with pytest.raises(ValueError, match="topm"):
        LOPDConfig.from_yaml(bad)
    good = tmp_path / "good.yaml"
    good.write_text("top_m: 5\nencoder_lora: {r: 4}\n")
    cfg = LOPDConfig.from_yaml(good)
    assert cfg.top_m == 5 and cfg.encoder_lora.r == 4 and cfg.margin_target == 0.05
    assert LOPDConfig().n_latents == 96
    for bad_div in ("opd: {divergence: jsd, divergence_coef: 1.0}\n", "opd: {divergence: mix, divergence_coef: 1.5}\n"):
        bad.write_text(bad_div)
        with pytest.raises(ValueError, match="divergence_coef"):
            LOPDConfig.from_yaml(bad)
    bad.write_text("opd: {divergence: hellinger}\n")
    with pytest.raises(ValueError, match="divergence"):
        LOPDConfig.from_yaml(bad)


def test_data_parallel_scheme_follows_the_student_and_fsdp_refuses_a_lora_student():
    assert not LOPDConfig().sharded  # LoRA: DDP
    assert LOPDConfig(student_mode="full").sharded  # auto: FSDP2
    assert not LOPDConfig(student_mode="full", data_parallel="ddp").sharded
    with pytest.raises(ValueError, match="data_parallel=fsdp needs student_mode=full"):
        LOPDConfig(data_parallel="fsdp")


def _with_grad(*values: float) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(values), dtype=torch.float64))
    p.grad = torch.tensor(values, dtype=torch.float64)
    return p


def test_composer_gradients_are_clipped_jointly_by_default_as_in_the_reference_training():
    from lopd_core.step import clip_gradients

    # student |g| = 5; encoder LoRA |g| = 3 and QFormer |g| = 4: jointly 5, so both scale by 1/5
    student, lora, qformer = _with_grad(3.0, 4.0), _with_grad(3.0), _with_grad(0.0, 4.0)
    norms = clip_gradients([student], [lora], [qformer], LOPDConfig())
    assert norms == pytest.approx({"grad_norm_student": 5.0, "grad_norm_composer": 5.0})
    torch.testing.assert_close(student.grad, torch.tensor([0.6, 0.8], dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(lora.grad, torch.tensor([0.6], dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(qformer.grad, torch.tensor([0.0, 0.8], dtype=torch.float64), rtol=1e-5, atol=0)

    # per group (the reference's cold-start values, 3.0 and 30.0): the LoRA is at its limit, the QFormer untouched
    lora, qformer = _with_grad(6.0), _with_grad(0.0, 4.0)
    cfg = LOPDConfig(composer_clip="per_group")
    norms = clip_gradients([], [lora], [qformer], cfg)
    assert norms == pytest.approx({"grad_norm_encoder_lora": 6.0, "grad_norm_qformer": 4.0})
    torch.testing.assert_close(lora.grad, torch.tensor([3.0], dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(qformer.grad, torch.tensor([0.0, 4.0], dtype=torch.float64))
