"""`loss_normalization: reference` and `tail_floor` against a re-implementation of the reference code's losses.

The oracle below re-implements bingreeky/LOPD (50c3d7f) from its source, in float64 on full-vocabulary logits:
`loss.py` (top-M KL with the tail bucket, the support's log-mass clamped at -1e-7), `worker.py` `student_loss`
(token-weighted over the batch, teacher detached), `composer_loss` (per record: KL / n_i + beta (m - Delta_i) +
lambda mean((c - c0)^2), student detached) averaged over records by `_composer_phase`, and its dual step with
the token-weighted Delta. Records have unequal lengths; one teacher row is peaked so the clamp is active.
"""

from __future__ import annotations

import math

import pytest
import torch

from lopd_core.config import LOPDConfig
from lopd_core.loss_head import distill_head
from lopd_core.methods import LOPDObjective, TeacherInputs
from lopd_core.step import DistillBatch, teacher_side

LENGTHS = [2, 7, 4]  # tokens per record
REWARDS = [1.0, 0.0, 0.25]
V, D, M, JK = 40, 8, 5, 6
BETA, MARGIN, LAM, ETA = 0.7, 0.05, 0.2, 0.5


def _with_tail(lp: torch.Tensor) -> torch.Tensor:  # reference loss.py: clamp(max=-1e-7) on the top-M log-mass
    log_top = torch.logsumexp(lp, -1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([lp, torch.log(-torch.expm1(log_top))], -1)


def _kl_tokens(s_lp: torch.Tensor, t_lp: torch.Tensor) -> torch.Tensor:  # KL(S || T) per token, [T]
    s, t = _with_tail(s_lp), _with_tail(t_lp)
    return (s.exp() * (s - t)).sum(-1)


def reference_step(h_s, h_t, w, tokens, c, c0):  # type: ignore[no-untyped-def]
    """(student loss, composer loss, new beta) exactly as the reference computes them, one record at a time."""
    student_sum, composer, delta_weighted, n_total = 0.0, [], 0.0, 0
    start = 0
    for n, r in zip(LENGTHS, REWARDS, strict=True):
        sl = slice(start, start + n)
        start += n
        s_lp = (h_s[sl] @ w.T).log_softmax(-1)
        t_lp = (h_t[sl] @ w.T).log_softmax(-1)
        ids = t_lp.detach().topk(M, -1).indices  # the teacher's top-M ids
        student_sum = student_sum + _kl_tokens(s_lp.gather(-1, ids), t_lp.detach().gather(-1, ids)).sum()
        kl_i = _kl_tokens(s_lp.detach().gather(-1, ids), t_lp.gather(-1, ids)).sum() / n
        a = 2 * r - 1
        on_token = t_lp.gather(-1, tokens[sl, None]).squeeze(-1) - s_lp.detach().gather(-1, tokens[sl, None]).squeeze(
            -1
        )
        delta_i = a * on_token.mean()
        i = len(composer)
        anchor_i = ((c[i] - c0[i]) ** 2).mean()
        composer.append(kl_i + BETA * (MARGIN - delta_i) + LAM * anchor_i)
        delta_weighted += delta_i.item() * n
        n_total += n
    beta = max(0.0, BETA + ETA * (MARGIN - delta_weighted / n_total))
    return student_sum / n_total, torch.stack(composer).mean(), beta


@pytest.fixture
def inputs():
    torch.manual_seed(0)
    n = sum(LENGTHS)
    h_s = torch.randn(n, D, dtype=torch.float64)
    h_t = torch.randn(n, D, dtype=torch.float64)
    w = torch.randn(V, D, dtype=torch.float64)
    h_t[3] = 30.0 * w[7] / w[7].norm()  # a peaked teacher row: its top-M mass rounds to 1, the clamp acts
    tokens = torch.randint(0, V, (n,))
    c = torch.randn(len(LENGTHS), JK, D, dtype=torch.float64)
    c0 = torch.randn(len(LENGTHS), JK, D, dtype=torch.float64)
    return h_s, h_t, w, tokens, c, c0


def _leaves(*xs):  # type: ignore[no-untyped-def]
    return [x.clone().requires_grad_(True) for x in xs]


def test_reference_normalisation_matches_the_reference_code_in_gradients_and_beta(inputs):
    h_s, h_t, w, tokens, c, c0 = inputs
    rs, rt, rc = _leaves(h_s, h_t, c)
    student, composer, beta_ref = reference_step(rs, rt, w, tokens, rc, c0)
    (student + composer).backward()

    cfg = LOPDConfig(loss_normalization="reference", tail_floor=-1e-7, top_m=M, margin_target=MARGIN,
                     anchor_weight=LAM, anchor_reduction="mean", dual_lr=ETA)  # fmt: skip
    objective = LOPDObjective(cfg)
    objective.beta = BETA
    os_, ot, oc = _leaves(h_s, h_t, c)
    rows = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    teacher = teacher_side(ot, rows, len(LENGTHS), cfg.loss_normalization)
    head = distill_head(os_, teacher, tokens, w, w, M, tail_floor=cfg.tail_floor)
    batch = DistillBatch(rows, len(LENGTHS), torch.tensor(REWARDS, dtype=torch.float64), rows,
                         TeacherInputs(oc, c0))  # fmt: skip
    loss, stats = objective.loss(head, batch)
    loss.backward()
    objective.after_step(stats)

    torch.testing.assert_close(os_.grad, rs.grad, rtol=1e-9, atol=1e-12)  # student side: token-weighted
    torch.testing.assert_close(ot.grad, rt.grad, rtol=1e-9, atol=1e-12)  # composer side: per-record means
    torch.testing.assert_close(oc.grad, rc.grad, rtol=1e-9, atol=1e-12)  # the anchor, mean over J*K*d
    assert objective.beta == pytest.approx(beta_ref, rel=1e-12)  # the dual step, token-weighted Delta
    assert head.kl.max().item() < 20  # the clamp bounds the peaked row's KL (about 16 nats of tail at most)


def test_the_dual_step_uses_the_token_weighted_margin_whatever_the_normalisation(inputs):
    h_s, h_t, w, tokens, c, c0 = inputs
    rows = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    head = distill_head(h_s, h_t, tokens, w, w, M)
    weighted = (2 * rewards - 1)[rows] * head.privilege
    token_delta = (weighted.sum() / weighted.numel()).item()
    record_delta = torch.stack([weighted[rows == i].mean() for i in range(len(LENGTHS))]).mean().item()
    assert abs(token_delta - record_delta) > 1e-3  # the two reductions differ on these records
    for norm in ("token", "record", "reference"):
        objective = LOPDObjective(LOPDConfig(loss_normalization=norm, top_m=M, dual_lr=ETA, margin_target=MARGIN))
        objective.beta = BETA
        _, stats = objective.loss(head, DistillBatch(rows, 3, rewards, rows, TeacherInputs(c, c0)))
        objective.after_step(stats)
        assert stats["margin"] == pytest.approx(token_delta, rel=1e-12), norm
        assert objective.beta == pytest.approx(max(0.0, BETA + ETA * (MARGIN - token_delta)), rel=1e-12), norm


def test_tail_floor_is_the_reference_clamp():
    from lopd_core.losses import topm_bucket_logprobs

    logits = torch.tensor([[60.0, 0.0, 0.0, 0.0], [1.0, 0.5, 0.2, 0.1]], dtype=torch.float64)
    support = torch.tensor([[0, 1], [0, 1]])
    exact = topm_bucket_logprobs(logits, support)
    floored = topm_bucket_logprobs(logits, support, tail_floor=-1e-7)
    assert exact[0, -1].item() == pytest.approx(math.log(2) - 60, rel=1e-9)  # exact tail: log(2 e^0 / Z)
    assert floored[0, -1].item() == pytest.approx(math.log(-math.expm1(-1e-7)), rel=1e-12)  # about -16.1
    torch.testing.assert_close(floored[1], exact[1])  # an unpeaked row is untouched
    with pytest.raises(ValueError, match="tail_floor"):
        topm_bucket_logprobs(logits, support, tail_floor=0.5)


def test_a_uniformly_worse_teacher_meets_the_verdict_margin_but_not_the_centered_or_balanced_one():
    """Three failures and one success (A = -1, -1, -1, +1), one token each, delta = -0.5 on every token: the verdict
    margin is mean(A delta) = (0.5 * 3 - 0.5) / 4 = +0.25; centred (A - mean A = -0.5, -0.5, -0.5, +1.5) it is 0."""
    rows = torch.arange(4)
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    student = torch.tensor([-1.0, -2.0, -0.5, -1.5], dtype=torch.float64)
    from lopd_core.loss_head import HeadOutputs

    head = HeadOutputs(student_logp=student, kl=torch.zeros(4, dtype=torch.float64), teacher_logp=student - 0.5)
    batch = DistillBatch(rows, 4, rewards, rows, TeacherInputs())
    for advantage, expected in (("verdict", 0.25), ("centered", 0.0), ("balanced", 0.0)):
        objective = LOPDObjective(LOPDConfig(margin_advantage=advantage))
        _, margin, margin_token, _ = objective.terms(head, batch)
        assert margin.item() == pytest.approx(expected, abs=1e-12)
        assert margin_token == pytest.approx(expected, abs=1e-12)


def test_balanced_margin_in_the_objective_and_beta_held_when_nothing_ranks():
    """The success's token delta +0.4 and the failures' -0.2, -0.6 (one token each): Delta = 0.2 + 0.2 = 0.4, and
    beta moves by eta (m - Delta); with failures only there is nothing to rank: no margin stat, beta held."""
    from lopd_core.loss_head import HeadOutputs

    rows = torch.arange(3)
    student = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    delta = torch.tensor([0.4, -0.2, -0.6], dtype=torch.float64)
    head = HeadOutputs(student_logp=student, kl=torch.zeros(3, dtype=torch.float64), teacher_logp=student + delta)
    c = torch.zeros(3, 2, 4, dtype=torch.float64)
    cfg = LOPDConfig(margin_advantage="balanced", beta_init=1.0, dual_lr=0.5, margin_target=0.05)
    objective = LOPDObjective(cfg)
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    _, stats = objective.loss(head, DistillBatch(rows, 3, rewards, rows, TeacherInputs(c, c)))
    assert stats["margin"] == pytest.approx(0.5 * 0.4 - 0.5 * (-0.4), abs=1e-12)
    objective.after_step(stats)
    assert objective.beta == pytest.approx(1.0 + 0.5 * (0.05 - 0.4), abs=1e-12)
    failures = torch.zeros(3, dtype=torch.float64)
    _, stats = objective.loss(head, DistillBatch(rows, 3, failures, rows, TeacherInputs(c, c)))
    assert "margin" not in stats
    objective.after_step(stats)
    assert objective.beta == pytest.approx(0.825, abs=1e-12)


def test_reward_aligned_distillation_drops_the_misaligned_records():
    """Three records, one token each, KL 1, 2, 4: a success the teacher favours (aligned), a success it disfavours
    (misaligned), a failure it disfavours (aligned). Dropped: (1 + 4) / 3; weighed 1/2: (1 + 1 + 4) / 3."""
    from lopd_core.loss_head import HeadOutputs
    from lopd_core.methods import DistillObjective

    rows = torch.arange(3)
    student = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    kl = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    head = HeadOutputs(student, kl=kl, teacher_logp=student + torch.tensor([0.3, -0.2, -0.6], dtype=torch.float64))
    batch = DistillBatch(rows, 3, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), rows, TeacherInputs())
    for weight, expected in ((0.0, 5 / 3), (0.5, 6 / 3), (1.0, 7 / 3)):
        loss, stats = DistillObjective(LOPDConfig(opd={"reward_aligned": True, "misaligned_weight": weight})).loss(
            head, batch
        )
        assert loss.item() == pytest.approx(expected, abs=1e-12)
        assert stats["ra_misaligned"] == pytest.approx(1 / 3)
    loss, stats = DistillObjective(LOPDConfig()).loss(head, batch)
    assert loss.item() == pytest.approx(7 / 3) and "ra_misaligned" not in stats


@pytest.mark.parametrize("form", ["policy_gradient", "vopd", "sign"])
def test_distill_forms_in_the_objective(form):
    """Per token: delta = (0.3, -0.2, -0.6), bucket KL (1, 2, 4), token mean over 3. The student log-prob's
    gradient is -(delta)/3, -(delta + KL)/3 (vOPD's baseline -KL) or -sign(delta)/3; distill_kl logs the KL."""
    from lopd_core.loss_head import HeadOutputs
    from lopd_core.methods import DistillObjective

    rows = torch.arange(3)
    student = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    delta = torch.tensor([0.3, -0.2, -0.6], dtype=torch.float64)
    kl = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
    head = HeadOutputs(student, kl=kl, teacher_logp=student.detach() + delta)
    batch = DistillBatch(rows, 3, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64), rows, TeacherInputs())
    loss, stats = DistillObjective(LOPDConfig(opd={"distill_form": form})).loss(head, batch)
    expected = {"policy_gradient": -delta, "vopd": -(delta + kl), "sign": -torch.sign(delta)}[form] / 3
    assert torch.allclose(torch.autograd.grad(loss, student)[0], expected, atol=1e-12)
    assert stats["distill_kl"] == pytest.approx(7 / 3)


def test_vopd_needs_the_reverse_kl():
    with pytest.raises(ValueError, match="distill_form"):
        LOPDConfig(opd={"distill_form": "vopd", "divergence": "forward_kl"})
    LOPDConfig(opd={"distill_form": "policy_gradient", "divergence": "forward_kl"})


def test_balanced_margin_refuses_the_reference_normalisation():
    with pytest.raises(ValueError, match="margin_advantage: balanced"):
        LOPDConfig(margin_advantage="balanced", loss_normalization="reference")
