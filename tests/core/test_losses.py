"""Each loss term against an independent brute-force float64 reference over the full vocabulary.

The references loop over positions, sort with Python's `sorted`, and compute log-probabilities with an
explicit max-shifted log-sum-exp; gradients come from autograd through those loops.
"""

from __future__ import annotations

import math

import pytest
import torch

from lopd_core import losses as L

# ----------------------------------------------------------------------------------- references


def _lse(x: torch.Tensor) -> torch.Tensor:
    m = x.max().detach()
    return m + torch.log(torch.stack([torch.exp(v - m) for v in x]).sum())


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    return x - _lse(x)


def ref_buckets(logits: torch.Tensor, support: list[int]) -> torch.Tensor:
    logp = _log_softmax(logits)
    inside = [logp[i] for i in support]
    rest = [i for i in range(logits.shape[0]) if i not in set(support)]
    if not rest:
        return torch.stack(inside)
    tail = _lse(torch.stack([logits[i] for i in rest])) - _lse(logits)
    return torch.stack([*inside, tail])


def ref_reverse_kl(s, t, mask, top_m, support="teacher"):
    return ref_divergence(s, t, mask, top_m, "reverse_kl", 0.5, support)


def ref_privilege(t, s, tokens):
    B, T, _ = t.shape
    out = torch.zeros(B, T, dtype=t.dtype)
    rows = []
    for b in range(B):
        row = []
        for k in range(T):
            a = int(tokens[b, k])
            row.append(_log_softmax(t[b, k])[a] - _log_softmax(s[b, k])[a].detach())
        rows.append(torch.stack(row))
    out = torch.stack(rows)
    return out


def rand_case(seed, B=3, T=5, V=37, scale=3.0, empty_row=True):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).requires_grad_()
    t = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * scale).requires_grad_()
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    if empty_row:
        mask[0] = 0.0
    tokens = torch.randint(0, V, (B, T), generator=g)
    return s, t, mask, tokens


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("support", ["teacher", "student"])
@pytest.mark.parametrize("top_m", [1, 5, 20, 37, 50])
def test_reverse_kl_matches_reference(seed, support, top_m):
    s, t, mask, _ = rand_case(seed)
    got = L.topm_tail_reverse_kl(s, t, mask, top_m=top_m, support=support)
    ref = ref_reverse_kl(s, t, mask, top_m, support)
    assert torch.allclose(got, ref, atol=1e-12, rtol=1e-10)
    gs, gt = torch.autograd.grad(got, (s, t))
    rs, rt = torch.autograd.grad(ref, (s, t))
    assert torch.allclose(gs, rs, atol=1e-12) and torch.allclose(gt, rt, atol=1e-12)
    assert gs[0].abs().max() == 0 and gt[0].abs().max() == 0  # the empty-mask row gets no gradient
    assert gs.abs().sum() > 0 and gt.abs().sum() > 0  # both sides learn


def test_reverse_kl_extreme_logits_stay_finite_and_exact():
    s, t, mask, _ = rand_case(7, scale=1.0)
    with torch.no_grad():  # very peaked distributions: the tail's probability underflows to exactly 0
        s.mul_(2000.0)
        t.mul_(2000.0)
    got = L.topm_tail_reverse_kl(s, t, mask, top_m=3)
    ref = ref_reverse_kl(s, t, mask, 3)
    assert torch.isfinite(got) and torch.allclose(got, ref, rtol=1e-9)
    gs, gt = torch.autograd.grad(got, (s, t))
    assert torch.isfinite(gs).all() and torch.isfinite(gt).all()


def test_reverse_kl_hand_checked():
    # V = 3, M = 1: teacher top-1 is token 0. Student p = (1/2, 1/4, 1/4), teacher q = (1/4, 1/2, 1/4).
    s = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64))
    t = torch.log(torch.tensor([[[0.6, 0.2, 0.2]]], dtype=torch.float64))
    kl = L.topm_tail_reverse_kl(s, t, torch.ones(1, 1), top_m=1)
    # buckets: student (0.5, 0.5), teacher (0.6, 0.4)
    expected = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    assert kl.item() == pytest.approx(expected, abs=1e-12)
    assert L.topm_tail_reverse_kl(t, t, torch.ones(1, 1), top_m=1).item() == pytest.approx(0.0, abs=1e-15)


def test_reverse_kl_is_token_weighted_over_the_batch():
    s, t, mask, _ = rand_case(3, B=2, T=4)
    mask = torch.tensor([[1.0, 0, 0, 0], [1.0, 1, 1, 0]], dtype=torch.float64)
    per_pos = [L.topm_tail_reverse_kl(s[b : b + 1, k : k + 1], t[b : b + 1, k : k + 1], torch.ones(1, 1), 5)
               for b, k in [(0, 0), (1, 0), (1, 1), (1, 2)]]  # fmt: skip
    assert torch.allclose(L.topm_tail_reverse_kl(s, t, mask, 5), sum(per_pos) / 4)


def test_reverse_kl_rejects_bad_arguments():
    s, t, mask, _ = rand_case(0)
    with pytest.raises(ValueError, match="support"):
        L.topm_tail_reverse_kl(s, t, mask, support="both")
    with pytest.raises(ValueError, match="top_m"):
        L.topm_tail_reverse_kl(s, t, mask, top_m=0)


def _ref_divergence(ls, lt, divergence, coef):
    """One position's divergence between bucket log-probabilities, written out term by term."""
    n = len(ls)
    ps, pt = [torch.exp(ls[j]) for j in range(n)], [torch.exp(lt[j]) for j in range(n)]

    def kl(p, lp, lq):  # sum_j p_j (log p_j - log q_j)
        return sum(p[j] * (lp[j] - lq[j]) for j in range(n))

    if divergence == "reverse_kl":
        return kl(ps, ls, lt)
    if divergence == "forward_kl":
        return kl(pt, lt, ls)
    if divergence == "mix":
        return coef * kl(pt, lt, ls) + (1 - coef) * kl(ps, ls, lt)
    lm = [torch.log(coef * pt[j] + (1 - coef) * ps[j]) for j in range(n)]  # jsd
    return coef * kl(pt, lt, lm) + (1 - coef) * kl(ps, ls, lm)


def ref_divergence(s, t, mask, top_m, divergence, coef, support="teacher"):
    total, count = s.new_zeros(()), 0
    B, T, V = s.shape
    for b in range(B):
        for k in range(T):
            if mask[b, k] == 0:
                continue
            src = (t if support == "teacher" else s)[b, k].detach().tolist()
            S = sorted(range(V), key=lambda i: -src[i])[: min(top_m, V)]
            total = total + _ref_divergence(ref_buckets(s[b, k], S), ref_buckets(t[b, k], S), divergence, coef)
            count += 1
    return total / max(count, 1)


DIVERGENCE_CASES = [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.9),
                    ("mix", 0.0), ("mix", 0.3), ("mix", 1.0)]  # fmt: skip


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("support", ["teacher", "student"])
@pytest.mark.parametrize("top_m", [1, 5, 37])
@pytest.mark.parametrize("divergence,coef", DIVERGENCE_CASES)
def test_divergences_match_reference(seed, support, top_m, divergence, coef):
    s, t, mask, _ = rand_case(seed)
    got = L.topm_tail_divergence(s, t, mask, top_m, support, divergence=divergence, coef=coef)
    ref = ref_divergence(s, t, mask, top_m, divergence, coef, support)
    assert torch.allclose(got, ref, atol=1e-12, rtol=1e-10)
    gs, gt = torch.autograd.grad(got, (s, t))
    rs, rt = torch.autograd.grad(ref, (s, t))
    assert torch.allclose(gs, rs, atol=1e-12) and torch.allclose(gt, rt, atol=1e-12)
    assert gs[0].abs().max() == 0 and gt[0].abs().max() == 0
    assert gs.abs().sum() > 0 and gt.abs().sum() > 0


def test_divergences_hand_checked():
    # the buckets of test_reverse_kl_hand_checked: student (1/2, 1/2), teacher (0.6, 0.4)
    s = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]], dtype=torch.float64))
    t = torch.log(torch.tensor([[[0.6, 0.2, 0.2]]], dtype=torch.float64))
    one = torch.ones(1, 1)
    reverse = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    forward = 0.6 * math.log(0.6 / 0.5) + 0.4 * math.log(0.4 / 0.5)
    # jsd, beta = 1/2: M = (0.55, 0.45)
    jsd = 0.5 * (0.6 * math.log(0.6 / 0.55) + 0.4 * math.log(0.4 / 0.45)) + 0.5 * (
        0.5 * math.log(0.5 / 0.55) + 0.5 * math.log(0.5 / 0.45)
    )
    div = lambda kind, c=0.5: L.topm_tail_divergence(s, t, one, 1, divergence=kind, coef=c).item()  # noqa: E731
    assert div("reverse_kl") == pytest.approx(reverse, abs=1e-12)
    assert div("forward_kl") == pytest.approx(forward, abs=1e-12)
    assert div("jsd") == pytest.approx(jsd, abs=1e-12)
    assert div("mix", 0.25) == pytest.approx(0.25 * forward + 0.75 * reverse, abs=1e-12)
    assert forward != pytest.approx(reverse)  # the two directions are told apart
    for kind in ("reverse_kl", "forward_kl", "jsd", "mix"):  # every form is 0 at p = q
        assert L.topm_tail_divergence(t, t, one, 1, divergence=kind).item() == pytest.approx(0.0, abs=1e-15)


def test_divergences_stay_finite_on_peaked_logits():
    s, t, mask, _ = rand_case(7, scale=1.0)
    with torch.no_grad():
        s.mul_(2000.0)
        t.mul_(2000.0)
    for kind, coef in DIVERGENCE_CASES:
        got = L.topm_tail_divergence(s, t, mask, 3, divergence=kind, coef=coef)
        gs, gt = torch.autograd.grad(got, (s, t))
        assert torch.isfinite(got) and torch.isfinite(gs).all() and torch.isfinite(gt).all(), kind


def test_divergence_rejects_bad_arguments():
    s, t, mask, _ = rand_case(0)
    with pytest.raises(ValueError, match="divergence must be one of"):
        L.topm_tail_divergence(s, t, mask, divergence="hellinger")
    for coef in (0.0, 1.0):
        with pytest.raises(ValueError, match="jsd's beta"):
            L.topm_tail_divergence(s, t, mask, divergence="jsd", coef=coef)
    with pytest.raises(ValueError, match="mix's lambda"):
        L.topm_tail_divergence(s, t, mask, divergence="mix", coef=1.5)


@pytest.mark.parametrize("seed", range(3))
def test_privilege_matches_reference_and_stops_student_gradient(seed):
    s, t, _mask, tokens = rand_case(seed)
    got = L.token_privilege(t, s, tokens)
    ref = ref_privilege(t, s, tokens)
    assert torch.allclose(got, ref, atol=1e-12)
    w = torch.randn(got.shape, dtype=torch.float64)
    gt, gs = torch.autograd.grad((got * w).sum(), (t, s), allow_unused=True)
    rt = torch.autograd.grad((ref * w).sum(), t)[0]
    assert torch.allclose(gt, rt, atol=1e-12)
    assert gs is None or gs.abs().max() == 0


@pytest.mark.parametrize("seed", range(3))
def test_margin_matches_reference(seed):
    s, t, mask, tokens = rand_case(seed)
    rewards = torch.tensor([1.0, 0.0, 0.3])
    adv = L.advantages_from_rewards(rewards)
    priv = L.token_privilege(t, s, tokens)
    got = L.batch_margin(priv, adv, mask)
    num = sum(mask[b, k] * (2 * float(rewards[b]) - 1) * priv[b, k] for b in range(3) for k in range(5))
    ref = num / mask.sum()
    assert torch.allclose(got, ref, atol=1e-12)
    g_got = torch.autograd.grad(got, t, retain_graph=True)[0]
    assert torch.allclose(g_got, torch.autograd.grad(ref, t)[0], atol=1e-12)
    empty = L.batch_margin(priv, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0


def test_advantages():
    assert L.advantages_from_rewards([0.0, 0.25, 1.0]).tolist() == [-1.0, -0.5, 1.0]
    for bad in ([1.5], [-0.1], [float("nan")]):
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            L.advantages_from_rewards(bad)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_anchor_matches_reference(reduction):
    g = torch.Generator().manual_seed(0)
    c = torch.randn(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    got = L.anchor_penalty(c, c0, reduction)
    per_task = [sum((c[b, i, j] - c0[b, i, j]) ** 2 for i in range(6) for j in range(4)) for b in range(2)]
    if reduction == "mean":
        per_task = [x / 24 for x in per_task]
    ref = sum(per_task) / 2
    assert torch.allclose(got, ref, atol=1e-12)
    gc, gc0 = torch.autograd.grad(got, (c, c0), allow_unused=True)
    scale = 2 / 2 / (24 if reduction == "mean" else 1)
    assert torch.allclose(gc, scale * (c - c0).detach())
    assert gc0 is None or gc0.abs().max() == 0  # sg(c_phi0)


def test_anchor_hand_checked_and_errors():
    c = torch.zeros(1, 2, 2)
    c0 = torch.tensor([[[1.0, 2.0], [0.0, 2.0]]])
    assert L.anchor_penalty(c, c0, "sum").item() == 9.0
    assert L.anchor_penalty(c, c0, "mean").item() == 9.0 / 4
    with pytest.raises(ValueError, match="reduction"):
        L.anchor_penalty(c, c0, "max")
    with pytest.raises(ValueError, match="anchor"):
        L.anchor_penalty(c, c0[:, :1], "sum")


def test_dual_step_and_lagrangian_hand_checked():
    assert L.dual_step(0.0, margin=0.01, target=0.05, lr=0.5) == pytest.approx(0.02)
    assert L.dual_step(0.1, margin=0.5, target=0.05, lr=0.5) == 0.0  # projected onto beta >= 0
    assert L.dual_step(1.0, margin=0.05, target=0.05, lr=0.5) == 1.0
    out = L.lagrangian(torch.tensor(0.3), torch.tensor(0.01), torch.tensor(2.0), beta=0.5, target=0.05, lam=0.2)
    assert out.item() == pytest.approx(0.3 + 0.5 * 0.04 + 0.2 * 2.0)


def ref_balanced_margin(priv, rows, rewards):
    """1/2 mean over successes of their mean delta - 1/2 mean over failures, by loops over records."""
    records: dict[int, list] = {}
    for i, r in enumerate(rows.tolist()):
        records.setdefault(r, []).append(priv[i])
    means = {r: sum(v) / len(v) for r, v in records.items()}
    succ = [means[r] for r in means if rewards[r] > 0.5]
    fail = [means[r] for r in means if rewards[r] < 0.5]
    if not succ or not fail:
        return None
    return 0.5 * sum(succ) / len(succ) - 0.5 * sum(fail) / len(fail)


@pytest.mark.parametrize("seed", range(4))
def test_balanced_margin_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 4])  # unequal lengths; record 5 has no token
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])  # 0.5: A = 0, neither kind
    priv = torch.randn(rows.numel(), generator=g, dtype=torch.float64, requires_grad=True)
    got = L.balanced_margin(priv, rows, L.advantages_from_rewards(rewards).double())
    ref = ref_balanced_margin(priv, rows, rewards.tolist())
    assert torch.allclose(got, ref, atol=1e-12)
    g_got = torch.autograd.grad(got, priv)[0]
    g_ref = torch.autograd.grad(ref, priv)[0]
    assert torch.allclose(g_got, g_ref, atol=1e-12)
    assert g_got[rows == 4].abs().max() == 0  # A = 0 counts as neither
    # hand-checked weights: successes 0 (2 tokens), 3 (1): +1/2 * 1/2 * 1/n_r; failures 1 (1), 2 (3)
    expected = torch.tensor([1 / 8, 1 / 8, -1 / 4, -1 / 12, -1 / 12, -1 / 12, 1 / 4, 0, 0, 0, 0], dtype=torch.float64)
    assert torch.allclose(g_got, expected, atol=1e-12)


def test_balanced_margin_ignores_a_uniform_shift_and_needs_both_kinds():
    rows = torch.tensor([0, 1, 1, 2])
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    priv = torch.tensor([0.3, -0.2, 0.1, -0.4], dtype=torch.float64)
    base = L.balanced_margin(priv, rows, adv)
    assert base.item() == pytest.approx(0.5 * 0.3 - 0.5 * (-0.05 + -0.4) / 2, abs=1e-12)
    for shift in (-3.0, 0.7):
        assert L.balanced_margin(priv + shift, rows, adv).item() == pytest.approx(base.item(), abs=1e-12)
    assert L.balanced_margin(priv, rows, torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)) is None
    assert L.balanced_margin(priv, rows, -torch.ones(3, dtype=torch.float64)) is None


def test_balanced_margin_ranks_shares_sum_to_the_whole():
    """Data-parallel: each rank's share with the global counts sums to the margin of the whole batch."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4, 5])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, -0.5], dtype=torch.float64)
    priv = torch.randn(rows.numel(), generator=g, dtype=torch.float64)
    whole = L.balanced_margin(priv, rows, adv)
    split = rows < 3  # rank 0: records 0-2, rank 1: records 3-5 (renumbered)
    parts = [L.balanced_margin(priv[split], rows[split], adv[:3], n_success=2, n_failure=4),
             L.balanced_margin(priv[~split], rows[~split] - 3, adv[3:], n_success=2, n_failure=4)]  # fmt: skip
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-12)


def test_reward_aligned_weights_hand_checked():
    """Returns (sum of delta per record): +0.5, -0.3, +0.2, -0.1, +0.4; verdicts success, success, failure, failure,
    A = 0. Misaligned: record 1 (a success the teacher pushes down) and record 2 (a failure it pushes up)."""
    rows = torch.tensor([0, 0, 1, 2, 2, 3, 4])
    priv = torch.tensor([0.2, 0.3, -0.3, 0.5, -0.3, -0.1, 0.4], dtype=torch.float64, requires_grad=True)
    adv = L.advantages_from_rewards(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.5])).double()
    assert L.reward_aligned_weights(priv, rows, adv).tolist() == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert L.reward_aligned_weights(priv, rows, adv, 0.25).tolist() == [1.0, 0.25, 0.25, 1.0, 1.0]
    assert not L.reward_aligned_weights(priv, rows, adv).requires_grad
    assert L.misaligned_records(priv, rows, adv).tolist() == [False, True, True, False, False]
    with pytest.raises(ValueError, match="misaligned_weight"):
        L.reward_aligned_weights(priv, rows, adv, 1.5)


@pytest.mark.parametrize("seed", range(3))
def test_opd_policy_gradient_in_expectation_is_the_full_reverse_kl_gradient(seed):
    """Enumerate every token a of one position with weight pS(a): the expected gradient of -(r - b) log pS(a) is
    the gradient of the full-vocabulary KL(pS || pT), with or without a baseline (which then adds 0)."""
    g = torch.Generator().manual_seed(seed)
    V = 11
    s = (torch.randn(V, generator=g, dtype=torch.float64) * 2).requires_grad_()
    t = torch.randn(V, generator=g, dtype=torch.float64) * 2
    ls, lt = _log_softmax(s), _log_softmax(t)
    full_kl = sum(torch.exp(ls[a]) * (ls[a] - lt[a]) for a in range(V))
    want = torch.autograd.grad(full_kl, s)[0]
    for baseline in (None, torch.tensor(0.7, dtype=torch.float64), -full_kl.detach()):
        expected = torch.zeros(V, dtype=torch.float64)
        for a in range(V):
            logp_a = _log_softmax(s)[a]
            surrogate = L.opd_policy_gradient(logp_a, lt[a], baseline)
            expected += torch.exp(ls[a]).detach() * torch.autograd.grad(surrogate, s)[0]
        assert torch.allclose(expected, want, atol=1e-12)


def test_opd_policy_gradient_and_sign_hand_checked():
    student = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([-0.5, -2.5, -0.5], dtype=torch.float64, requires_grad=True)
    pg = L.opd_policy_gradient(student, teacher, torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64))
    # r = (0.5, -0.5, 0); the loss -(r - b) logp has d/dlogp = -(r - b)
    g_s, g_t = torch.autograd.grad(pg.sum(), (student, teacher), allow_unused=True)
    assert g_s.tolist() == pytest.approx([-0.4, 0.6, 0.1], abs=1e-12)
    assert g_t is None or g_t.abs().max() == 0  # the teacher is not trained by this form
    sign = L.opd_sign(student, teacher)
    assert torch.autograd.grad(sign.sum(), student)[0].tolist() == [-1.0, 1.0, 0.0]


def test_divergences_on_a_bucket_empty_on_both_sides():
    """A bucket with probability 0 for student and teacher (a masked token) adds 0 to every form, gradient included."""
    s = torch.tensor([0.0, -1.0, float("-inf")], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([-0.5, -0.2, float("-inf")], dtype=torch.float64, requires_grad=True)
    for kind, coef in DIVERGENCE_CASES:
        full = L.bucket_divergence(s.log_softmax(-1), t.log_softmax(-1), kind, coef)
        two = L.bucket_divergence(s[:2].log_softmax(-1), t[:2].log_softmax(-1), kind, coef)
        assert torch.allclose(full, two, atol=1e-12), kind
        gs, gt = torch.autograd.grad(full, (s, t))
        assert torch.isfinite(gs).all() and torch.isfinite(gt).all(), kind
