"""The hybrids (RL + a teacher's guidance on failures): DiffGate and SCOPE against float64 brute force over the full
vocabulary (values and gradients on both sides), their helpers hand-checked, and one train step each."""

from __future__ import annotations

import math

import pytest
import torch

from lopd_core import losses as L
from lopd_core.config import LOPDConfig
from lopd_core.loss_head import distill_head
from lopd_core.methods import DiffGateObjective, SCOPEObjective, TeacherInputs
from lopd_core.step import DistillBatch

V = 7
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # group 0: 2 of 3 fail; group 1: 2 of 3 fail
GROUPS = [0, 0, 0, 1, 1, 1]
ROWS = [0, 0, 1, 1, 1, 2, 3, 3, 4, 5, 5, 5]  # 12 tokens over 6 records of 1-3 tokens


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    n = len(ROWS)
    h_s = (torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    h_t = (torch.randn(n, V, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    targets = torch.randint(0, V, (n,), generator=g)
    return h_s, h_t, targets


def _head(h_s, h_t, targets, temperature):
    eye = torch.eye(V, dtype=torch.float64)  # logits = hidden states: the head's softmax is over all V tokens
    return distill_head(h_s, h_t, targets, eye, eye, top_m=V, temperature=temperature)


def _batch():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    return DistillBatch(rows=torch.tensor(ROWS), n_records=len(REWARDS), rewards=rewards, groups=torch.tensor(GROUPS),
                        teacher=TeacherInputs())  # fmt: skip


def _per_record_mean(values_by_token, normalization):
    """Brute force of the batch reduction: the token mean, or the mean over records of each record's token mean."""
    if normalization == "token":
        return sum(values_by_token) / len(values_by_token)
    records = sorted(set(ROWS))
    means = [
        sum(v for v, r in zip(values_by_token, ROWS, strict=True) if r == rec) / ROWS.count(rec) for rec in records
    ]
    return sum(means) / len(means)


def _brute_tokens(h_s, h_t, targets, temperature):
    """Per token: log pS(a), log pT(a), KL(pS || pT), all over the full vocabulary, in float64."""
    out = []
    for i in range(len(ROWS)):
        ls = torch.log_softmax(h_s[i] / temperature, -1)
        lt = torch.log_softmax(h_t[i] / temperature, -1)
        kl = (ls.exp() * (ls - lt)).sum()
        out.append((ls[targets[i]], lt[targets[i]], kl))
    return out


def _group_z(rewards, groups):
    adv = {}
    for g in set(groups):
        rs = [r for r, gg in zip(rewards, groups, strict=True) if gg == g]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for i, (r, gg) in enumerate(zip(rewards, groups, strict=True)):
            if gg == g:
                adv[i] = (r - mean) / (std + 1e-6)
    return adv


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("normalization", ["token", "record"])
@pytest.mark.parametrize("bound", [0.0, 0.3])
def test_diffgate_matches_brute_force(seed, normalization, bound):
    temperature, gamma = 0.7, 0.8
    cfg = LOPDConfig(method="diffgate", loss_normalization=normalization,
                     opd={"guidance_coef": gamma, "guidance_bound": bound},
                     baseline={"policy_temperature": temperature})  # fmt: skip
    obj = DiffGateObjective(cfg)
    assert obj.temperature == temperature and not obj.trains_teacher
    h_s, h_t, targets = _inputs(seed)
    loss, stats = obj.loss(_head(h_s, h_t, targets, temperature), _batch())
    g_s, g_t = torch.autograd.grad(loss, (h_s, h_t))

    a, b = (x.detach().clone().requires_grad_() for x in (h_s, h_t))
    adv = _group_z(REWARDS, GROUPS)
    fail_rate = {
        g: sum(r < 0.5 for r, gg in zip(REWARDS, GROUPS, strict=True) if gg == g) / GROUPS.count(g) for g in set(GROUPS)
    }
    terms = []
    for (lps, _, kl), rec in zip(_brute_tokens(a, b, targets, temperature), ROWS, strict=True):
        pg = -torch.exp(lps - lps.detach()) * adv[rec]  # ratio 1: GRPO's surrogate, gradient -A grad log pS
        d = kl if bound == 0 else bound * torch.tanh(kl / bound)
        gate = fail_rate[GROUPS[rec]] if REWARDS[rec] < 0.5 else 0.0
        terms.append(pg + gamma * gate * d)
    expected = _per_record_mean(terms, normalization)
    e_s, e_t = torch.autograd.grad(expected, (a, b))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_s, e_s, rtol=1e-7, atol=1e-10) and torch.allclose(g_t, e_t, rtol=1e-7, atol=1e-10)
    assert stats["guided_share"] == pytest.approx(4 / 6)  # the four failed records carry guidance
    assert e_t.abs().sum() > 0  # the teacher side is reached here; the step keeps it frozen (trains_teacher)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("normalization", ["token", "record"])
def test_scope_matches_brute_force(seed, normalization):
    gamma = 0.6
    cfg = LOPDConfig(method="scope", loss_normalization=normalization, opd={"guidance_coef": gamma})
    obj = SCOPEObjective(cfg)
    h_s, h_t, targets = _inputs(seed)
    loss, stats = obj.loss(_head(h_s, h_t, targets, 1.0), _batch())
    g_s, g_t = torch.autograd.grad(loss, (h_s, h_t))

    a, b = (x.detach().clone().requires_grad_() for x in (h_s, h_t))
    tokens = _brute_tokens(a, b, targets, 1.0)
    n_rec = len(REWARDS)
    mean_t = [
        sum(t[1].item() for t, r in zip(tokens, ROWS, strict=True) if r == rec) / ROWS.count(rec)
        for rec in range(n_rec)
    ]
    mean_s = [
        sum(t[0].item() for t, r in zip(tokens, ROWS, strict=True) if r == rec) / ROWS.count(rec)
        for rec in range(n_rec)
    ]
    conf = [math.exp(m) for m in mean_t]  # 1 / teacher perplexity
    ppl = [math.exp(-m) for m in mean_s]  # student perplexity
    weight = []
    for rec in range(n_rec):
        fail = REWARDS[rec] < 0.5
        peers = [i for i in range(n_rec) if GROUPS[i] == GROUPS[rec] and (REWARDS[i] < 0.5) == fail]
        score = conf if fail else ppl
        weight.append(score[rec] / (sum(score[i] for i in peers) / len(peers)))
    terms = []
    for (lps, _, kl), rec in zip(tokens, ROWS, strict=True):
        terms.append(gamma * weight[rec] * kl if REWARDS[rec] < 0.5 else -weight[rec] * lps)
    expected = _per_record_mean(terms, normalization)
    e_s, e_t = torch.autograd.grad(expected, (a, b))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(g_s, e_s, rtol=1e-7, atol=1e-10) and torch.allclose(g_t, e_t, rtol=1e-7, atol=1e-10)
    assert stats["likelihood"] > 0


def test_hybrid_helpers_hand_checked():
    values = torch.tensor([1.0, 3.0, 2.0, 5.0])
    rows = torch.tensor([0, 0, 2, 2])
    assert L.record_means(values, rows, 3).tolist() == [2.0, 0.0, 3.5]
    assert L.smooth_bound(values, 0.0) is values
    assert torch.allclose(L.smooth_bound(torch.tensor([0.01, 100.0]), 2.0), torch.tensor([0.01, 2.0]), atol=1e-4)
    with pytest.raises(ValueError, match="bound"):
        L.smooth_bound(values, -1.0)
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    assert torch.allclose(L.group_failure_rate(adv, groups), torch.tensor([2 / 3, 2 / 3, 2 / 3, 0.5, 0.5]))
    scores = torch.tensor([1.0, 2.0, 6.0, 4.0, 9.0])
    members = adv < 0  # group 0's failures: scores 2, 6 (mean 4); group 1's: 4 alone
    assert L.group_normalised(scores, groups, members).tolist() == [0.0, 0.5, 1.5, 1.0, 0.0]


def test_diffgate_refuses_a_kl_to_the_base():
    with pytest.raises(ValueError, match=r"baseline\.kl_coef"):
        DiffGateObjective(LOPDConfig(method="diffgate", baseline={"kl_coef": 0.1}))


@pytest.mark.parametrize("method", ["diffgate", "scope", "diffgate_latent"])
def test_hybrids_take_a_step_and_leave_the_teacher_as_it_is(tiny, method):
    from tests.core.test_methods import make
    from tests.core.test_step import make_batch

    step = make(tiny, method)
    composer = [p.detach().clone() for p in step.models.composer_parameters()]
    batch = make_batch((1.0, 0.0, 0.0)) + make_batch((0.0, 0.0, 1.0))  # two rollouts per task
    out = step(batch)
    assert out["updated"] == 1.0 and out["guidance"] >= 0 and "anchor" not in out
    assert all(torch.equal(a, b.detach()) for a, b in zip(composer, step.models.composer_parameters(), strict=True))
    assert all(p.grad is None for p in step.models.composer_parameters())
