"""The chunked loss head equals the logits-level definitions, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from lopd_core import losses as L
from lopd_core.loss_head import distill_head, token_logprobs


def case(seed, N=23, d=8, V=41, shared_head=False):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    w_s = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    w_t = w_s if shared_head else torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    return h_s, h_t, w_s, w_t, targets


@pytest.mark.parametrize("chunk", [1, 5, 23, 100])
@pytest.mark.parametrize("support", ["teacher", "student"])
@pytest.mark.parametrize("top_m", [4, 20, 41])
def test_head_matches_logits_level_functions(chunk, support, top_m):
    h_s, h_t, w_s, w_t, targets = case(chunk + top_m)
    adv = torch.linspace(-1, 1, targets.numel(), dtype=torch.float64)
    head = distill_head(h_s, h_t, targets, w_s, w_t, top_m=top_m, support=support, chunk_size=chunk)
    got = head.kl.mean() + (adv * head.privilege).mean()

    ls, lt = (h_s @ w_s.T)[None], (h_t @ w_t.T)[None]  # [1, N, V]: full logits, the naive way
    mask = torch.ones(1, targets.numel(), dtype=torch.float64)
    ref = L.topm_tail_reverse_kl(ls, lt, mask, top_m, support) + (adv * L.token_privilege(lt, ls, targets[None])).mean()
    assert torch.allclose(got, ref, atol=1e-12)
    params = (h_s, h_t, w_s, w_t)
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params), strict=True):
        assert torch.allclose(a, b, atol=1e-12)

    probs_t = lt[0].softmax(-1)
    assert torch.allclose(head.student_logp, ls[0].log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1))
    top = probs_t.topk(min(top_m, 41), dim=-1).values.sum(-1) if support == "teacher" else None
    if top is not None:
        assert torch.allclose(head.teacher_topm_mass, top.detach())
    assert not head.teacher_topm_mass.requires_grad and head.privilege.grad_fn is not None
    # the privilege's student side is stopped: its gradient reaches the teacher only
    g_s = torch.autograd.grad(head.privilege.sum(), h_s, allow_unused=True)[0]
    assert g_s is None or g_s.abs().max() == 0


@pytest.mark.parametrize("chunk", [1, 23])
@pytest.mark.parametrize("divergence,coef", [("forward_kl", 0.5), ("jsd", 0.3), ("mix", 0.7)])
def test_head_divergences_match_logits_level_functions(chunk, divergence, coef):
    h_s, h_t, w_s, w_t, targets = case(chunk + 3)
    head = distill_head(h_s, h_t, targets, w_s, w_t, top_m=5, chunk_size=chunk, divergence=divergence,
                        divergence_coef=coef)  # fmt: skip
    ls, lt = (h_s @ w_s.T)[None], (h_t @ w_t.T)[None]
    mask = torch.ones(1, targets.numel(), dtype=torch.float64)
    ref = L.topm_tail_divergence(ls, lt, mask, 5, divergence=divergence, coef=coef)
    assert torch.allclose(head.kl.mean(), ref, atol=1e-12)
    params = (h_s, h_t, w_s, w_t)
    for a, b in zip(torch.autograd.grad(head.kl.mean(), params), torch.autograd.grad(ref, params), strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    reverse = distill_head(h_s, h_t, targets, w_s, w_t, top_m=5, chunk_size=chunk).kl
    assert not torch.allclose(head.kl, reverse)  # the option reaches the head


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_head_at_a_temperature_is_the_head_of_the_scaled_logits(temperature):
    """GRPO's head: every distribution is softmax(logits / T), values and gradients (full vocabulary, float64)."""
    h_s, h_t, w_s, w_t, targets = case(11)
    head = distill_head(h_s, h_t, targets, w_s, w_t, top_m=5, chunk_size=7, temperature=temperature)
    ls, lt = (h_s @ w_s.T) / temperature, (h_t @ w_t.T) / temperature
    pick = targets[:, None]
    ref_s, ref_t = ls.log_softmax(-1).gather(-1, pick).squeeze(-1), lt.log_softmax(-1).gather(-1, pick).squeeze(-1)
    mask = torch.ones(1, targets.numel(), dtype=torch.float64)
    ref_kl = L.topm_tail_reverse_kl(ls[None], lt[None], mask, 5, "teacher")
    assert torch.allclose(head.student_logp, ref_s, atol=1e-12) and torch.allclose(head.teacher_logp, ref_t, atol=1e-12)
    assert torch.allclose(head.kl.mean(), ref_kl, atol=1e-12)
    adv = torch.linspace(-1, 1, targets.numel(), dtype=torch.float64)
    got, ref = (adv * head.student_logp).sum() + head.teacher_logp.sum(), (adv * ref_s).sum() + ref_t.sum()
    params = (h_s, h_t, w_s, w_t)
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params, retain_graph=True), strict=True):
        assert torch.allclose(a, b, atol=1e-12)
    logp = token_logprobs(h_s, targets, w_s, chunk_size=4, temperature=temperature)
    assert torch.allclose(logp, ref_s, atol=1e-12)
    assert torch.allclose(torch.autograd.grad(logp.sum(), h_s)[0], torch.autograd.grad(ref_s.sum(), h_s)[0], atol=1e-12)
    # T = 1 is the plain head; T <= 0 is refused
    assert torch.equal(token_logprobs(h_s, targets, w_s, temperature=1.0), token_logprobs(h_s, targets, w_s))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(h_s, targets, w_s, temperature=0.0)


def test_token_logprobs_head():
    h_s, _, w_s, _, targets = case(3)
    got = token_logprobs(h_s, targets, w_s, chunk_size=4)
    ref = (h_s @ w_s.T).log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    assert torch.allclose(got, ref, atol=1e-12)
    assert torch.allclose(torch.autograd.grad(got.sum(), h_s)[0], torch.autograd.grad(ref.sum(), h_s)[0], atol=1e-12)


def test_shared_head_weight_gets_both_contributions():
    h_s, h_t, w, _, targets = case(0, shared_head=True)
    head = distill_head(h_s, h_t, targets, w, w, top_m=5, chunk_size=4)
    loss = head.kl.sum() - head.teacher_logp.sum()
    ls, lt = h_s @ w.T, h_t @ w.T
    ref = (
        L.topm_tail_reverse_kl(ls[None], lt[None], torch.ones(1, len(targets)), 5) * len(targets)
        - L.token_logprob(lt[None], targets[None]).sum()
    )
    g, r = torch.autograd.grad(loss, w)[0], torch.autograd.grad(ref, w)[0]
    assert torch.allclose(g, r, atol=1e-11)


def test_head_without_grad_and_empty_input():
    h_s, h_t, w_s, w_t, targets = case(1)
    with torch.no_grad():
        out = distill_head(h_s, h_t, targets, w_s, w_t)
    assert out.kl.shape == (23,) and not out.kl.requires_grad
    empty = distill_head(h_s[:0], h_t[:0], targets[:0], w_s, w_t)
    assert empty.kl.numel() == 0
    with pytest.raises(ValueError, match="shape"):
        distill_head(h_s, h_t[:3], targets, w_s, w_t)
