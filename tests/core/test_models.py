"""Composer, teacher and student on the tiny backbone: latents, gradients, adapter isolation, checkpointing."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer, TeacherContext

CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64)
MESSAGES = [
    Message("system", "You are an agent. Tools: ls(path)."),
    Message("user", "List the folder /a"),
    Message("assistant", '{"name": "ls", "arguments": {"path": "/a"}}'),
    Message("tool", '["x.txt"]'),
    Message("assistant", "The folder holds x.txt."),
]
RETRIEVED = [["Task: list /b\nTrace: ls(/b) -> ok", "Task: read y\nTrace: read(y) -> ok"]]


def randomize_lora(model, adapter, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if f".{adapter}." in n and "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def setup(tiny, cfg=CFG):
    model, tok = tiny
    models = build_models(model, tok, cfg)
    ser = ChatSerializer(tok)
    return models, ser


def teacher_batch(ser, cfg=CFG):
    return ser.collate([ser.teacher_view(MESSAGES, TeacherContext.latent(cfg.n_latents))])


def test_composer_shapes_and_missing_items(tiny):
    models, _ = setup(tiny)
    lat = models.composer(["task a", "task b"], [RETRIEVED[0], []])  # task b retrieved nothing
    assert lat.shape == (2, CFG.n_latents, models.backbone.config.hidden_size)
    assert len(models.composer.frame(["t"], [["one"]])) == CFG.n_retrieved


def test_latents_change_teacher_only_through_the_span(tiny):
    models, ser = setup(tiny)
    batch = teacher_batch(ser)
    d = models.backbone.config.hidden_size
    start = int(batch.latent_start[0])
    with torch.no_grad():
        a = models.teacher_hidden(batch, torch.randn(1, CFG.n_latents, d))
        b = models.teacher_hidden(batch, torch.randn(1, CFG.n_latents, d))
        # the placeholder ids themselves never reach the model: other ids, same output
        other = teacher_batch(ser)
        other.input_ids[0, start : start + CFG.n_latents] = 7
        lat = torch.randn(1, CFG.n_latents, d)
        c1, c2 = models.teacher_hidden(batch, lat), models.teacher_hidden(other, lat)
    assert torch.equal(a[0, :start], b[0, :start])  # causal: nothing before the span moves
    assert not torch.allclose(a[0, start + CFG.n_latents :], b[0, start + CFG.n_latents :])
    assert torch.equal(c1, c2)
    with pytest.raises(ValueError, match="latents"):
        models.teacher_hidden(batch, None)


def test_composer_gets_gradient_through_the_teacher_and_student_lora_does_not_leak(tiny):
    models, ser = setup(tiny)
    randomize_lora(models.backbone, "student")
    randomize_lora(models.backbone, "encoder", seed=1)
    batch = teacher_batch(ser)
    latents = models.composer(["List the folder /a"], RETRIEVED)
    hidden = models.teacher_hidden(batch, latents)
    hidden[0, -5:].pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in models.composer.qformer.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in models.composer.encoder_parameters())
    assert all(p.grad is None for p in models.student_parameters())
    # the teacher equals the plain backbone: rebuild a pristine tiny model with the same seed and compare
    from lopd_core.backbone import load_backbone

    plain, _ = load_backbone("tiny")
    with torch.no_grad():
        embeds = plain.get_input_embeddings()(batch.input_ids)
        start = int(batch.latent_start[0])
        embeds[0, start : start + CFG.n_latents] = latents[0]
        ref = plain.model(inputs_embeds=embeds, attention_mask=batch.attention_mask).last_hidden_state
    assert torch.allclose(hidden.detach(), ref, atol=1e-5)


def test_student_adapter_changes_the_student_only(tiny):
    models, ser = setup(tiny)
    batch = ser.collate([ser.student_view(MESSAGES)])
    with torch.no_grad():
        before = models.student_hidden(batch)
        randomize_lora(models.backbone, "student")
        after = models.student_hidden(batch)
        with models.switch.use(None):
            plain = models.backbone.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert not torch.allclose(before, after)
    assert torch.allclose(before, plain.last_hidden_state, atol=1e-6)


def _one_step_grads(tiny, checkpointing, min_len=2048):
    from lopd_core.step import LatentContext, LOPDObjective, TrainStep
    from tests.core.test_step import make_batch

    torch.manual_seed(0)
    cfg = CFG.model_copy(
        update={"gradient_checkpointing": checkpointing, "gradient_checkpointing_min_len": min_len, "beta_init": 0.7}
    )
    models, ser = setup(tiny, cfg)
    randomize_lora(models.backbone, "student")
    randomize_lora(models.backbone, "encoder", seed=1)
    models.composer.freeze_anchor()
    randomize_lora(models.backbone, "encoder", seed=2)  # the anchor differs from the live encoder
    strategy = LatentContext(models.composer, lambda t, i: RETRIEVED[0], cfg)
    step = TrainStep(models, ser, strategy, LOPDObjective(cfg), cfg)
    step.optimizer.step = lambda: None  # keep the weights: only the gradients are compared
    metrics = step(make_batch())
    grads = {n: p.grad.clone() for n, p in models.backbone.named_parameters() if p.grad is not None}
    grads.update({f"q.{n}": p.grad.clone() for n, p in models.composer.qformer.named_parameters()})
    return metrics, grads


def test_gradient_checkpointing_gives_the_same_gradients(tiny):
    from lopd_core.backbone import load_backbone

    m0, g0 = _one_step_grads(tiny, checkpointing=False)
    m1, g1 = _one_step_grads(load_backbone("tiny"), checkpointing=True)
    assert m0["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    assert g0.keys() == g1.keys() and any(".student." in k for k in g0) and any(".encoder." in k for k in g0)
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=1e-4), name


def test_auto_checkpointing_turns_on_for_long_sequences_with_the_same_gradients(tiny):
    """The default ("auto") checkpoints a step whose longest view reaches gradient_checkpointing_min_len: here 16
    tokens, so the tiny batch counts as long; its gradients (student, encoder and QFormer, through the adapter
    switching of the shared backbone) equal those of the same step without checkpointing."""
    from lopd_core.backbone import load_backbone

    assert LOPDConfig().gradient_checkpointing == "auto"
    m0, g0 = _one_step_grads(tiny, checkpointing=False)
    m1, g1 = _one_step_grads(load_backbone("tiny"), checkpointing="auto", min_len=16)
    assert m0["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.allclose(g0[name], g1[name], atol=1e-6, rtol=1e-4), name


def test_auto_checkpointing_follows_the_batch_length(tiny):
    from lopd_core.step import LatentContext, LOPDObjective, TrainStep
    from tests.core.test_step import make_batch

    models, ser = setup(tiny, CFG)
    layers = [m for m in models.backbone.modules() if isinstance(m, GradientCheckpointingLayer)]
    step = TrainStep(models, ser, LatentContext(models.composer, lambda t, i: RETRIEVED[0], CFG), LOPDObjective(CFG),
                     CFG.model_copy(update={"gradient_checkpointing_min_len": 16}))  # fmt: skip
    assert not any(layer.gradient_checkpointing for layer in layers)  # "auto" starts off
    step(make_batch())
    assert all(layer.gradient_checkpointing for layer in layers)
    step.cfg = CFG  # min_len 2048: the tiny batch is short
    step(make_batch())
    assert not any(layer.gradient_checkpointing for layer in layers)


def test_checkpointing_replays_the_adapter_it_ran_with(tiny):
    """Switch adapters between forward and backward: the recomputation must still use the original one."""
    models, ser = setup(tiny)
    randomize_lora(models.backbone, "student")
    batch = ser.collate([ser.student_view(MESSAGES)])

    def grads(checkpointing):
        models.set_gradient_checkpointing(checkpointing)
        models.train()
        for p in models.student_parameters():
            p.grad = None
        h = models.student_hidden(batch)  # the student adapter is live only inside this call
        with models.switch.use("encoder"):
            h.pow(2).sum().backward()
        return [p.grad.clone() for p in models.student_parameters()]

    for a, b in zip(grads(False), grads(True), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_full_finetuning_keeps_a_frozen_teacher(tiny):
    cfg = CFG.model_copy(update={"student_mode": "full"})
    models, _ = setup(tiny, cfg)
    assert models.student is not models.backbone
    assert all(p.requires_grad for p in models.student.parameters())
    assert not any(p.requires_grad for n, p in models.backbone.named_parameters() if "lora_" not in n)
    w_s, w_t = models.head_weights()
    assert w_s.requires_grad and not w_t.requires_grad


@pytest.mark.parametrize("length", [1, 5, 20, 32, 64])
def test_qformer_handles_encoder_sequences_shorter_and_longer_than_k(length):
    """K = 32 queries over L encoder states (a short task text, or an empty bank's one-line placeholder, gives
    L < K). Padding must act exactly like absent states: the padded batch equals each row run on its own."""
    from lopd_core.composer import QFormer

    torch.manual_seed(0)
    d, k = 16, 32
    qformer = QFormer(d, n_heads=2, n_queries=k, n_layers=2).double()
    states = torch.randn(2, length + 3, d, dtype=torch.float64)
    mask = torch.ones(2, length + 3, dtype=torch.long)
    mask[0, length:] = 0  # row 0 has `length` real states, row 1 has length + 3
    out = qformer(states, mask)
    assert out.shape == (2, k, d) and torch.isfinite(out).all()
    alone = qformer(states[:1, :length], torch.ones(1, length, dtype=torch.long))
    torch.testing.assert_close(out[:1], alone, rtol=1e-10, atol=1e-10)


def test_token_latents_are_mixtures_of_the_experiences_own_token_embeddings():
    """lopd.latent_values: tokens: each latent is a convex mixture of the unmasked token embeddings (one-hot rows
    here, so its coordinates are the pointer's weights: >= 0, summing to 1, none on padding); a single real token
    gives exactly its embedding; padding acts like absent tokens."""
    from lopd_core.composer import QFormer

    torch.manual_seed(0)
    d, k, length = 16, 4, 6
    qformer = QFormer(d, n_heads=2, n_queries=k, n_layers=2, values="tokens").double()
    states = torch.randn(2, length, d, dtype=torch.float64)
    tokens = torch.eye(d, dtype=torch.float64)[:length].expand(2, -1, -1)  # token i's embedding: the i-th unit vector
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, 4:] = 0
    out = qformer(states, mask, tokens)
    assert out.shape == (2, k, d)
    assert (out >= 0).all() and torch.allclose(out.sum(-1), torch.ones(2, k, dtype=torch.float64))
    assert (out[0, :, 4:] == 0).all()  # no weight on padding
    alone = qformer(states[:1, :4], torch.ones(1, 4, dtype=torch.long), tokens[:1, :4])
    torch.testing.assert_close(out[:1, :, :4], alone[:, :, :4], rtol=1e-10, atol=1e-10)
    one = qformer(states[:1, :1], torch.ones(1, 1, dtype=torch.long), tokens[:1, :1])
    torch.testing.assert_close(one, tokens[:1, :1].expand(1, k, d))
    with pytest.raises(ValueError, match="token embeddings"):
        qformer(states, mask)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_a_run_starts_from_a_trained_student_and_nothing_else(mode):
    """`load_student_weights` (a re-train from a trained student, TrainSpec.init_student): the student's weights
    arrive exactly; the composer and the teacher's reader keep their own; a student of the other mode is refused."""
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import load_student_weights, model_tensors

    cfg = CFG.model_copy(update={"student_mode": mode, "teacher_reader": True})
    trained = build_models(*load_backbone("tiny"), cfg)
    with torch.no_grad():
        for p in [*trained.student_parameters(), *trained.composer.qformer.parameters()]:
            p.add_(0.01 * torch.randn_like(p))
        randomize_lora(trained.backbone, trained.teacher_adapter, seed=1)
    tensors = model_tensors(trained)
    fresh = build_models(*load_backbone("tiny"), cfg)
    before_qformer = {n: p.clone() for n, p in fresh.composer.qformer.named_parameters()}
    before_reader = {n: p.clone() for n, p in fresh.backbone.named_parameters() if f".{fresh.teacher_adapter}." in n}
    assert load_student_weights(fresh, tensors) > 0
    for a, b in zip(trained.student_parameters(), fresh.student_parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(p, before_qformer[n]) for n, p in fresh.composer.qformer.named_parameters())
    assert all(torch.equal(p, before_reader[n]) for n, p in fresh.backbone.named_parameters() if n in before_reader)
    other = build_models(*load_backbone("tiny"), cfg.model_copy(update={"student_mode": "full" if mode == "lora"
                                                                        else "lora"}))  # fmt: skip
    with pytest.raises(ValueError, match=r"does not fit|holds no fully fine-tuned student"):
        load_student_weights(other, tensors)
