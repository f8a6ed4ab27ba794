"""Baselines in the shared harness: contexts, objectives (hand-checked), EMA teacher, one step each."""

from __future__ import annotations

import pytest
import torch

from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.loss_head import HeadOutputs
from lopd_core.methods import (
    FeedbackContext,
    GRPOObjective,
    TeacherInputs,
    build_method,
    group_advantages,
)
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.step import DistillBatch, TrainStep
from tests.core.test_step import make_batch, retrieve

CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64, student_lr=3e-3)


def test_group_advantages_hand_checked():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0])
    g = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(r, g)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0]), atol=1e-5)


def grpo_batch(rewards, groups, rows, old=None):
    return DistillBatch(
        rows=torch.tensor(rows), n_records=len(rewards), rewards=torch.tensor(rewards),
        groups=torch.tensor(groups), teacher=TeacherInputs(), old_logp=old,
    )  # fmt: skip


def test_grpo_loss_and_gradient_hand_checked():
    obj = GRPOObjective(CFG.model_copy(update={"loss_normalization": "record"}))
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)  # record 0 has 2 tokens, record 1 has 1
    batch = grpo_batch([1.0, 0.0], [0, 0], [0, 0, 1])
    loss, stats = obj.loss(HeadOutputs(student_logp=logp), batch)
    # advantages +1 / -1; ratio = 1: loss = mean over records of mean over tokens of (-A) = (-1 + 1) / 2 = 0
    assert loss.item() == pytest.approx(0.0)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, torch.tensor([-0.25, -0.25, 0.5]))  # -A / n_tokens(record) / n_records
    assert stats["clip_fraction"] == 0.0


def test_grpo_clip_stops_gradient_outside_the_trust_region():
    obj = GRPOObjective(CFG)
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-1.0, 0.0])  # token 0: ratio e = 2.7 > 1.2, positive advantage -> clipped
    loss, stats = obj.loss(HeadOutputs(student_logp=logp), grpo_batch([1.0, 0.0], [0, 0], [0, 1], old))
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0] == 0 and g[1] != 0 and stats["clip_fraction"] == 0.5


def test_grpo_k3_kl_is_zero_at_the_reference_and_positive_away():
    cfg = CFG.model_copy(update={"baseline": CFG.baseline.model_copy(update={"kl_coef": 0.1})})
    obj = GRPOObjective(cfg)
    assert obj.needs_teacher
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    head = HeadOutputs(student_logp=logp, kl=torch.zeros(2), teacher_logp=logp.detach().clone())
    _, stats = obj.loss(head, grpo_batch([1.0], [0], [0, 0]))
    assert stats["kl_ref"] == pytest.approx(0.0)
    head.teacher_logp = torch.tensor([-1.5, -1.0])
    _, stats = obj.loss(head, grpo_batch([1.0], [0], [0, 0]))
    expected = sum(torch.exp(torch.tensor(d)) - d - 1 for d in (-0.5, 1.0)) / 2
    assert stats["kl_ref"] == pytest.approx(float(expected), rel=1e-5)


def _feedback_traj(task_id, reward, checks=(), tool="ok", trace="ls(/a) -> ok"):
    msgs = [Message("system", "s"), Message("user", "task"), Message("assistant", "x"), Message("tool", tool)]
    return Trajectory(task_id, "files", "task", msgs, reward=reward, checks=list(checks), trace=trace)


def test_sdpo_feedback_context(tiny):
    model, tok = tiny
    models = build_models(model, tok, CFG.model_copy(update={"method": "sdpo"}))
    ctx = FeedbackContext(models, CFG)
    failed = _feedback_traj("a", 0.5, [{"name": "file_created", "passed": False, "detail": "b.txt missing"}],
                            tool="Error: unknown tool 'mk'")  # fmt: skip
    good = _feedback_traj("a", 1.0, trace="mk(b.txt) -> ok")
    lone = _feedback_traj("b", 1.0)
    text = ctx.describe(failed, [failed, good, lone])
    assert "b.txt missing" in text and "unknown tool" in text and "mk(b.txt) -> ok" in text
    assert ctx.describe(lone, [failed, good, lone]) is None  # success, no sibling: nothing to add
    assert ctx.describe(good, [failed, good]) is None  # its only sibling failed: nothing privileged to show


def make(tiny, method, **kw):
    model, tok = tiny
    cfg = CFG.model_copy(update={"method": method, **kw})
    models = build_models(model, tok, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in models.backbone.named_parameters():
            if ".student." in n and "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    solutions = {"t0": "ls(/f0) -> a.txt b.txt", "t2": "ls(/f2) -> a.txt b.txt"}.get
    strategy, objective = build_method(
        models, cfg, retrieve=retrieve, solutions=solutions, skills=lambda env: "Use ls before answering."
    )
    return TrainStep(models, ChatSerializer(tok), strategy, objective, cfg)


@pytest.mark.parametrize("method", ["opsd", "sdft", "skill_sd", "sdpo"])
def test_text_baselines_take_a_step(tiny, method):
    step = make(tiny, method)
    batch = make_batch()
    batch[1].checks = [{"name": "answer", "passed": False, "detail": "wrong listing"}]
    out = step(batch)
    assert out["updated"] == 1.0 and out["distill_kl"] >= 0 and "anchor" not in out
    if method in ("opsd", "sdft"):
        assert out["n_no_context"] == 1.0  # t1 has no known solution
    assert all(p.grad is None for p in step.models.composer.qformer.parameters())  # no composer in baselines


def test_ema_teacher_follows_the_student(tiny):
    step = make(tiny, "sdft")
    assert step.strategy.teacher_adapter == "teacher"
    params = dict(step.models.backbone.named_parameters())
    name = next(n for n in params if ".teacher." in n and "lora_B" in n)
    before = params[name].detach().clone()
    step(make_batch())
    student = params[name.replace(".teacher.", ".student.")].detach()
    assert torch.allclose(params[name], 0.99 * before + 0.01 * student, atol=1e-6)
    assert not params[name].requires_grad


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_takes_a_step_without_a_teacher_unless_kl(tiny, kl_coef):
    step = make(tiny, "grpo", baseline=CFG.baseline.model_copy(update={"kl_coef": kl_coef, "ppo_epochs": 2}))
    batch = make_batch((1.0, 0.0, 1.0)) + make_batch((0.0, 0.0, 1.0))  # two rollouts per task
    out = step(batch)
    assert out["updated"] == 1.0 and "pg_loss" in out
    assert ("kl_ref" in out) == (kl_coef > 0) and ("teacher_topm_mass" in out) == (kl_coef > 0)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_grpo_scores_tokens_under_the_policy_that_sampled_them(tiny, temperature):
    """The step's GRPO log-probs are log softmax(logits / T)[a] of the student (T = the sampling temperature),
    computed here by a plain forward of each conversation alone (no padding, no chunked head)."""
    step = make(tiny, "grpo", baseline=CFG.baseline.model_copy(update={"policy_temperature": temperature}))
    assert step.objective.temperature == temperature
    batch = make_batch((1.0, 0.0, 1.0)) + make_batch((0.0, 0.0, 1.0))
    expected = []
    with torch.no_grad(), step.models.acting_student() as student:
        for traj in batch:
            view = step.serializer.student_view(traj)
            logits = student(input_ids=torch.tensor([view.input_ids])).logits[0].double() / temperature
            for pos, supervised in enumerate(view.action_mask):
                if supervised:
                    expected.append(logits[pos - 1].log_softmax(-1)[view.input_ids[pos]])
    seen = []
    loss = step.objective.loss
    step.objective.loss = lambda head, b: (seen.append(head.student_logp.detach()), loss(head, b))[1]
    step(batch)
    assert torch.allclose(seen[0].double(), torch.stack(expected), atol=1e-5)


def test_build_method_names_missing_inputs(tiny):
    model, tok = tiny
    cfg = CFG.model_copy(update={"method": "opsd"})
    models = build_models(model, tok, cfg)
    with pytest.raises(ValueError, match="solutions"):
        build_method(models, cfg)


def test_every_method_name_has_one_registry_entry():
    from typing import get_args

    from lopd_core.config import MethodName
    from lopd_core.method_rules import METHOD_RULES
    from lopd_core.methods import METHODS

    assert list(METHODS) == list(get_args(MethodName)) == list(METHOD_RULES)
    assert all(METHODS[name].rules is METHOD_RULES[name] for name in METHODS)
    with pytest.raises(ValueError, match="needs `skills`"):
        build_method(None, LOPDConfig(method="skill_sd"))  # type: ignore[arg-type]


def test_the_registry_carries_each_methods_rules():
    from lopd_core.method_rules import METHOD_RULES
    from lopd_core.methods import METHODS, DiffGateObjective, GRPOObjective, SCOPEObjective, TextContext

    rules = {name: (m.reads_bank, m.reads_notes, m.acting_teacher, m.min_group) for name, m in METHOD_RULES.items()}
    assert rules == {
        "lopd": (True, False, False, 1),  # the bank through the composer; its teacher acts through latent_eval
        "opsd": (False, False, True, 1),
        "sdft": (False, False, True, 1),
        "sdpo": (False, False, False, 2),  # its context needs the student's own attempt and a sibling
        "skill_sd": (False, True, True, 1),
        "grpo": (False, False, False, 2),
        "diffgate": (False, False, True, 2),  # GRPO's groups; OPSD's teacher acts with the task's solution
        "diffgate_latent": (True, False, False, 2),  # LOPD's latent teacher (the cold-started composer)
        "scope": (False, False, True, 2),  # its weights are normalised within a task's group
    }
    for name, m in METHODS.items():  # an acting teacher reads a text context built from the task
        assert not m.rules.acting_teacher or issubclass(m.context, TextContext), name
        assert m.rules.text_teacher == issubclass(m.context, TextContext), name  # the params it logs follow these
        assert m.rules.policy_gradient == (m.objective in (GRPOObjective, DiffGateObjective, SCOPEObjective)), name
    METHOD_RULES["sdpo"].check_group("sdpo", 2)
    with pytest.raises(ValueError, match=r"'grpo' needs schedule\.samples_per_task >= 2: the group size G"):
        METHOD_RULES["grpo"].check_group("grpo", 1)


def test_full_fine_tuning_ema_teacher_follows_the_student_and_survives_a_checkpoint(tmp_path):
    """Full fine-tuning: SDFT's EMA teacher is the backbone, whose every base weight moves a = 0.01 toward the
    student after a step (hand-checked lerp); a checkpoint holds it and `load_student` restores it."""
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import load_student, save_checkpoint

    model, tok = load_backbone("tiny")
    cfg = CFG.model_copy(update={"method": "sdft", "student_mode": "full", "student_lr": 1e-2})
    models = build_models(model, tok, cfg)
    strategy, objective = build_method(models, cfg, solutions={"t0": "ls(/f0) -> a.txt", "t1": "ls(/f1)"}.get)
    assert models.ema_teacher and strategy.teacher_adapter is None
    step = TrainStep(models, ChatSerializer(tok), strategy, objective, cfg)
    pairs = models.teacher_student_pairs()
    assert len(pairs) == len(list(models.student.parameters()))  # every weight, the tied embedding once
    before = {n: t.detach().clone() for n, t, _ in pairs}
    assert step(make_batch())["updated"] == 1.0
    moved = 0
    for n, teacher, student in pairs:
        expected = 0.99 * before[n] + 0.01 * student.detach()
        assert torch.allclose(teacher, expected, atol=1e-7), n
        moved += int(not torch.equal(teacher, before[n]))
    assert moved > 0 and not any(t.requires_grad for _, t, _ in pairs)

    state = {"config": cfg.model_dump(mode="json"), "backbone": "tiny", "step": 1}
    save_checkpoint(tmp_path / "ck", models, None, state)
    again = load_student(tmp_path / "ck")
    assert again.ema_teacher
    for (n, teacher, _), (m, restored, _) in zip(pairs, again.teacher_student_pairs(), strict=True):
        assert n == m and torch.equal(teacher.detach(), restored.detach())


def test_shuffled_rewards_permute_what_grpo_sees_and_nothing_else(tiny):
    """The control arm (`baseline.shuffle_rewards`): the objective gets the step's rewards permuted by the seeded
    generator, and its update equals that of a plain GRPO step on the same trajectories carrying those permuted
    rewards (on a fresh copy of the same weights); the logged reward stays the true one."""
    from dataclasses import replace

    from lopd_core.backbone import load_backbone
    from lopd_core.step import shuffled

    perm = shuffled(torch.arange(6.0), seed=CFG.seed, step=0).long().tolist()
    assert sorted(perm) == list(range(6)) and perm != list(range(6))
    assert shuffled(torch.arange(6.0), CFG.seed, 0).long().tolist() == perm  # seeded: the same again
    rewards = (1.0, 0.0, 1.0, 0.0, 0.0, 1.0)
    batch = make_batch(rewards[:3]) + make_batch(rewards[3:])
    torch.manual_seed(0)  # the LoRA's A matrices draw from the global generator
    control = make(tiny, "grpo", baseline=CFG.baseline.model_copy(update={"shuffle_rewards": True}))
    order, seen = [], []
    collate, loss = control._collate, control.objective.loss
    control._collate = lambda views: (order.extend(v[0] for v in views), collate(views))[1]
    control.objective.loss = lambda head, b: (seen.extend(b.rewards.tolist()), loss(head, b))[1]
    out = control(batch)
    true = [t.reward for t in order]
    assert seen == [true[i] for i in perm] != true and out["reward_mean"] == pytest.approx(sum(rewards) / 6)
    given = {id(t): r for t, r in zip(order, seen, strict=True)}
    torch.manual_seed(0)
    by_hand = make(load_backbone("tiny"), "grpo")  # a fresh backbone: the same initial weights
    by_hand([replace(t, reward=given[id(t)]) for t in batch])
    for a, b in zip(control.models.student_parameters(), by_hand.models.student_parameters(), strict=True):
        assert a is not b and torch.allclose(a, b, atol=1e-6)
