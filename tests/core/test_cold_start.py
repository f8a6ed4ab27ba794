from __future__ import annotations

import pytest
import torch

from lopd_core.cold_start import cold_start, latent_nll
from lopd_core.config import ColdStartConfig, LOPDConfig
from lopd_core.conversation import experience_document
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from tests.core.test_step import make_batch

CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64)


def retrieve(task, task_id):
    return [f"Task: list /q{task_id}\nTrace: ls(/q) -> a.txt b.txt", "Task: read\nTrace: read(a.txt) -> hello"]


def test_cold_start_lowers_nll_trains_only_the_composer_and_fills_the_anchor_cache(tiny):
    model, tok = tiny
    models = build_models(model, tok, CFG)
    ser = ChatSerializer(tok)
    successes = make_batch((1.0, 1.0, 1.0))
    for t in successes:
        t.trace = f"ls(/f{t.task_id}) -> a.txt b.txt"
    student_before = [p.clone() for p in models.student_parameters()]
    with torch.no_grad():
        before = latent_nll(models, ser, successes, [retrieve(t.task, t.task_id) for t in successes]).item()
    losses = cold_start(models, ser, successes, retrieve, CFG, ColdStartConfig(steps=8, batch_size=3, lr=3e-3))
    with torch.no_grad():
        after = latent_nll(models, ser, successes, [retrieve(t.task, t.task_id) for t in successes]).item()
    assert after < before and losses[-1] < losses[0]
    assert all(torch.equal(a, b) for a, b in zip(student_before, models.student_parameters(), strict=True))
    assert len(models.composer.anchor_cache) == 3
    # the anchor is the trained composer: c_phi equals c_phi0 right after cold-start
    tasks = [t.task for t in successes]
    sets = [retrieve(t.task, t.task_id) for t in successes]
    with torch.no_grad():
        assert torch.allclose(models.composer(tasks, sets), models.composer.anchor_latents(tasks, sets), atol=1e-5)


def test_teacher_reader_is_trained_by_the_cold_start_and_frozen_in_training(tiny):
    """teacher_reader (ours): the cold start trains a "reader" LoRA on the teacher's backbone with the composer;
    the latent teacher runs with it on; a training step leaves it as the cold start left it."""
    from lopd_core.step import TrainStep, build_method

    model, tok = tiny
    cfg = CFG.model_copy(update={"teacher_reader": True})
    models = build_models(model, tok, cfg)
    reader = models.reader_parameters()
    assert reader and not any(p.requires_grad for p in reader)
    assert not build_models(*_fresh_tiny(), CFG).reader_parameters()  # off by default: the paper's teacher
    ser = ChatSerializer(tok)
    successes = make_batch((1.0, 1.0, 1.0))
    for t in successes:
        t.trace = f"ls(/f{t.task_id}) -> a.txt b.txt"
    before = [p.clone() for p in reader]
    cold_start(models, ser, successes, retrieve, cfg, ColdStartConfig(steps=4, batch_size=3, lr=3e-3))
    trained = [p.clone() for p in reader]
    assert any(not torch.equal(a, b) for a, b in zip(before, trained, strict=True))  # lora_B leaves zero
    assert not any(p.requires_grad for p in reader)
    strategy, objective = build_method(models, cfg, retrieve=retrieve)
    assert strategy.teacher_adapter == "reader" and models.teacher_adapter == "reader"
    step = TrainStep(models, ser, strategy, objective, cfg)
    out = step(make_batch((1.0, 0.0, 1.0)))
    assert out["updated"] == 1.0 and out["grad_norm_composer"] > 0  # the composer learns through the teacher
    assert all(torch.equal(a, b) for a, b in zip(trained, reader, strict=True))


def _fresh_tiny():
    from lopd_core.backbone import load_backbone

    return load_backbone("tiny")


def test_cold_start_refuses_self_retrieval_and_empty_input(tiny):
    model, tok = tiny
    models = build_models(model, tok, CFG)
    ser = ChatSerializer(tok)
    successes = make_batch((1.0,))
    successes[0].trace = "ls(/f0) -> a.txt"
    own = experience_document(successes[0].task, "ls(/f0) -> a.txt")  # as the bank returns it
    with pytest.raises(ValueError, match="own trajectory"):
        cold_start(models, ser, successes, lambda t, i: [own], CFG, ColdStartConfig())
    # another task whose trace contains this one's is not its own entry, nor is one whose task text also contains
    # this one's (toolworld: "Do the following: 1. ... 2. <this task>" on the same ids)
    other = "Task: list /f0 and /f1\nTrace:\nls(/f0) -> a.txt\nls(/f1) -> b.txt"
    longer = f"Task: Do the following:\n1. list /f1\n2. {successes[0].task}\nTrace:\nls(/f1) -> b.txt\nls(/f0) -> a.txt"
    assert successes[0].task in longer and successes[0].trace in longer
    cold_start(models, ser, successes, lambda t, i: [other, longer], CFG, ColdStartConfig(steps=1))
    with pytest.raises(ValueError, match="successful"):
        cold_start(models, ser, make_batch((0.0,)), retrieve, CFG, ColdStartConfig())
