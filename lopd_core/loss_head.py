"""The loss head from hidden states, in position chunks, recomputed in backward: full logits are never held.

For N supervised tokens the naive head materialises two [N, V] logit matrices (plus softmax temporaries);
at T = 16k and V = 49k that is gigabytes per side. Here the lm-head projection, the top-M bucket divergence
(eq. 9-10) and the sampled-token log-probabilities (eq. 11) are computed chunk by chunk (the fused linear + loss
idea of Liger Kernel):
- the forward runs without a graph, one side's [chunk, V] logits at a time, and keeps per-token values, the
  support ids [N, M] and both sides' bucket log-probabilities [N, M+1];
- the backward takes the divergence's gradient to the buckets from those saved values, then rebuilds one
  chunk's logits at a time, one side at a time, back-propagates that chunk's share of the output gradients and
  frees it before the next: nothing of size chunk x V outlives its chunk, whichever outputs the loss uses
  (activation checkpointing kept a chunk's rebuilt logits until the whole backward ended when one output, e.g.
  the stopped student side of eq. 11, got no gradient);
- each side's logsumexp is computed once, and a teacher that takes no gradient (OPSD, SDFT, SDPO, Skill-SD,
  GRPO's reference) is not rebuilt at all.
`lopd_core.losses` holds the readable logits-level definitions; tests check that both give the same values and
gradients, and that the head's peak memory does not grow with N.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from lopd_core.losses import bucket_divergence, topm_bucket_logprobs


@dataclass
class HeadOutputs:
    student_logp: torch.Tensor  # [N] log pS(a), full vocabulary; grad to student hidden states (policy gradient)
    kl: torch.Tensor | None = None  # [N] bucket divergence (reverse KL(p̃S || p̃T) by default); grad to both sides
    teacher_logp: torch.Tensor | None = None  # [N] log pT(a), full vocabulary; grad to teacher hidden states
    teacher_topm_mass: torch.Tensor | None = None  # [N] teacher probability mass on the support S, detached

    @property
    def privilege(self) -> torch.Tensor:
        """delta = log pT(a) - sg(log pS(a)) (eq. 11)."""
        if self.teacher_logp is None:
            raise ValueError("no teacher side in these head outputs")
        return self.teacher_logp - self.student_logp.detach()


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits are upcast for the softmax statistics; fp32/fp64 stay as they are."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = _at_least_fp32(h @ w.T)
    # GRPO at its sampling temperature; the distillation methods skip a pass over [chunk, V]
    return logits / temperature if temperature != 1.0 else logits


def _side_of(
    h: torch.Tensor, spec: _Spec, w: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _side(_logits(h, w, spec.temperature), ids, targets, spec.tail_floor)


def _side(
    logits: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, tail_floor: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One side's bucket log-probabilities on the support `ids` [c, M+1] and log p(targets) [c], one logsumexp."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    buckets = topm_bucket_logprobs(logits, ids, tail_floor, lse=lse)
    return buckets, logits.gather(-1, targets[:, None]).squeeze(-1) - lse.squeeze(-1)


@dataclass(frozen=True)
class _Spec:
    top_m: int
    support: str
    tail_floor: float | None
    temperature: float
    divergence: str
    divergence_coef: float
    chunk_size: int


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(start, start + size) for start in range(0, n, size)]


def _leaf(x: torch.Tensor, grad: bool) -> torch.Tensor:
    return x.detach().requires_grad_(grad)


def _distill_chunks(
    spec: _Spec, h_s: torch.Tensor, h_t: torch.Tensor, targets: torch.Tensor, w_s: torch.Tensor, w_t: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The head's values chunk by chunk: (kl, log pT(a), log pS(a), top-M mass, support ids, student buckets,
    teacher buckets). Call it without a graph: each chunk's logits are dropped before the next chunk."""
    kls, t_logps, s_logps, masses, all_ids, all_bs, all_bt = [], [], [], [], [], [], []
    for sl in _chunks(targets.shape[0], spec.chunk_size):
        # one side's [chunk, V] logits at a time: the side that chooses the support first
        first, second = ((h_t, w_t), (h_s, w_s)) if spec.support == "teacher" else ((h_s, w_s), (h_t, w_t))
        logits = _logits(first[0][sl], first[1], spec.temperature)
        ids = logits.topk(min(spec.top_m, logits.shape[-1]), dim=-1).indices
        b_first, logp_first = _side(logits, ids, targets[sl], spec.tail_floor)
        del logits
        b_second, logp_second = _side(_logits(second[0][sl], second[1], spec.temperature), ids, targets[sl],
                                      spec.tail_floor)  # fmt: skip
        if spec.support == "teacher":
            (b_t, t_logp), (b_s, s_logp) = (b_first, logp_first), (b_second, logp_second)
        else:
            (b_s, s_logp), (b_t, t_logp) = (b_first, logp_first), (b_second, logp_second)
        kls.append(bucket_divergence(b_s, b_t, spec.divergence, spec.divergence_coef))
        t_logps.append(t_logp)
        s_logps.append(s_logp)
        masses.append(b_t[:, : ids.shape[-1]].exp().sum(-1))
        all_ids.append(ids)
        all_bs.append(b_s)
        all_bt.append(b_t)
    return tuple(torch.cat(x) for x in (kls, t_logps, s_logps, masses, all_ids, all_bs, all_bt))


def _keep(ctx: Any, *inputs: torch.Tensor) -> None:
    """Hold the inputs for backward on `ctx` itself, not through `save_for_backward`, whose buffers a first
    backward frees: like activation checkpointing, the head answers a second `autograd.grad` over other outputs
    (e.g. the privilege after the loss). The in-place check that `save_for_backward` makes is made by `_kept`."""
    ctx.kept, ctx.versions = inputs, [t._version for t in inputs]


def _kept(ctx: Any) -> tuple[torch.Tensor, ...]:
    for i, (t, version) in enumerate(zip(ctx.kept, ctx.versions, strict=True)):
        if t._version != version:
            raise RuntimeError(
                f"input {i} of the fused loss head was modified in place after its forward (version {version} -> "
                f"{t._version}); its backward recomputes from it: clone it before modifying it"
            )
    return ctx.kept


class _FusedDistillHead(torch.autograd.Function):
    """(kl, log pT(a), log pS(a), top-M mass) [N] each; backward recomputes chunk by chunk, one side at a time:
    the divergence's gradient to both sides' bucket log-probabilities ([c, M+1], from the values saved in
    forward), then the teacher's logits (only when it takes a gradient) and the student's, each freed before the
    next, so one [chunk, V] graph is alive at a time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, spec: _Spec, h_s: torch.Tensor, h_t: torch.Tensor, targets: torch.Tensor,
        w_s: torch.Tensor, w_t: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        kl, t_logp, s_logp, mass, ids, b_s, b_t = _distill_chunks(spec, h_s, h_t, targets, w_s, w_t)
        ctx.spec, ctx.ids, ctx.buckets = spec, ids, (b_s, b_t)
        _keep(ctx, h_s, h_t, targets, w_s, w_t)
        ctx.mark_non_differentiable(mass)
        ctx.set_materialize_grads(False)
        return kl, t_logp, s_logp, mass

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_kl: torch.Tensor | None, g_t: torch.Tensor | None, g_s: torch.Tensor | None, _: Any
    ) -> tuple[Any, ...]:
        spec: _Spec = ctx.spec
        h_s, h_t, targets, w_s, w_t = _kept(ctx)
        need = ctx.needs_input_grad
        grad_h_s = torch.zeros_like(h_s) if need[1] else None
        grad_h_t = torch.zeros_like(h_t) if need[2] else None
        w_s_leaf, w_t_leaf = _leaf(w_s, need[4]), _leaf(w_t, need[5])
        for sl in _chunks(targets.shape[0], spec.chunk_size):
            g_bs = g_bt = None
            if g_kl is not None:  # d kl / d buckets, both sides, from the saved bucket values
                b_s, b_t = (_leaf(b[sl], True) for b in ctx.buckets)
                with torch.enable_grad():
                    kl = bucket_divergence(b_s, b_t, spec.divergence, spec.divergence_coef)
                g_bs, g_bt = torch.autograd.grad(kl, (b_s, b_t), g_kl[sl])
            side = partial(_side_of, spec=spec, ids=ctx.ids[sl], targets=targets[sl])
            if need[2] or need[5]:  # the teacher's side, then the student's: one [chunk, V] graph at a time
                _backward_chunk(partial(side, w=w_t_leaf), h_t, sl, grad_h_t, (g_bt, _at(g_t, sl)))
            if need[1] or need[4]:
                _backward_chunk(partial(side, w=w_s_leaf), h_s, sl, grad_h_s, (g_bs, _at(g_s, sl)))
        return None, grad_h_s, grad_h_t, None, w_s_leaf.grad, w_t_leaf.grad


def _at(g: torch.Tensor | None, sl: slice) -> torch.Tensor | None:
    return None if g is None else g[sl]


def _backward_chunk(
    values_of: Callable[[torch.Tensor], tuple[torch.Tensor, ...]], h: torch.Tensor, sl: slice,
    grad_h: torch.Tensor | None, grads: tuple[torch.Tensor | None, ...],
) -> None:  # fmt: skip
    """Rebuild `values_of(h[sl])` with a graph and back-propagate `grads` (one per value, None: none) into
    grad_h[sl] and the leaves `values_of` reads (the lm-head weight); the chunk's graph is freed on return."""
    pairs = [(i, g) for i, g in enumerate(grads) if g is not None]
    if not pairs:
        return
    h_leaf = _leaf(h[sl], grad_h is not None)
    with torch.enable_grad():
        values = values_of(h_leaf)
    torch.autograd.backward([values[i] for i, _ in pairs], [g for _, g in pairs])
    if grad_h is not None:
        grad_h[sl] = h_leaf.grad


class _FusedLogp(torch.autograd.Function):
    """log p(targets) [N] from hidden states, chunk by chunk; backward recomputes one chunk at a time."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, temperature: float, chunk_size: int
    ) -> torch.Tensor:
        parts = [_logp(h[sl], targets[sl], w, temperature) for sl in _chunks(targets.shape[0], chunk_size)]
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        _keep(ctx, h, targets, w)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h, targets, w = _kept(ctx)
        need = ctx.needs_input_grad
        grad_h = torch.zeros_like(h) if need[0] else None
        w_leaf = _leaf(w, need[2])
        for sl in _chunks(targets.shape[0], ctx.chunk_size):
            values_of = partial(_logp_of, targets=targets[sl], w=w_leaf, temperature=ctx.temperature)
            _backward_chunk(values_of, h, sl, grad_h, (grad[sl],))
        return grad_h, None, w_leaf.grad, None, None


def _logp_of(h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, temperature: float) -> tuple[torch.Tensor]:
    return (_logp(h, targets, w, temperature),)


def _logp(h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = _logits(h, w, temperature)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def distill_head(
    h_student: torch.Tensor,
    h_teacher: torch.Tensor,
    targets: torch.Tensor,
    w_student: torch.Tensor,
    w_teacher: torch.Tensor,
    top_m: int = 20,
    support: str = "teacher",
    chunk_size: int = 1024,
    tail_floor: float | None = None,
    temperature: float = 1.0,
    divergence: str = "reverse_kl",
    divergence_coef: float = 0.5,
) -> HeadOutputs:
    """Per-token divergence (`lopd_core.losses.bucket_divergence`, reverse KL by default), log pT(a), log pS(a)
    and top-M mass for N aligned positions.

    h_student, h_teacher [N, d] are the final hidden states that predict `targets` [N]; w_student, w_teacher
    [V, d] are the lm-head weights (the same tensor when the student is a LoRA over the teacher's backbone).
    Every distribution is softmax(logits / temperature) (1.0: the models' own; GRPO: the sampling temperature).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if support not in ("teacher", "student"):
        raise ValueError(f"support must be 'teacher' or 'student', got {support!r}")
    if h_student.shape != h_teacher.shape or h_student.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: {tuple(h_student.shape)}, {tuple(h_teacher.shape)}, {tuple(targets.shape)}")
    spec = _Spec(top_m, support, tail_floor, temperature, divergence, divergence_coef, chunk_size)
    if targets.shape[0] == 0:
        empty = h_student.new_zeros(0, dtype=torch.float32)
        return HeadOutputs(empty, empty, empty, empty)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (h_student, h_teacher, w_student, w_teacher)):
        kl, teacher_logp, student_logp, mass = _FusedDistillHead.apply(
            spec, h_student, h_teacher, targets, w_student, w_teacher
        )
    else:
        with torch.no_grad():
            kl, teacher_logp, student_logp, mass, *_ = _distill_chunks(
                spec, h_student, h_teacher, targets, w_student, w_teacher
            )
    return HeadOutputs(student_logp=student_logp, kl=kl, teacher_logp=teacher_logp, teacher_topm_mass=mass)


def token_logprobs(
    h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, chunk_size: int = 1024, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets) [N] from hidden states [N, d] and an lm-head weight [V, d], chunked like `distill_head`;
    p = softmax(logits / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if targets.shape[0] == 0:
        return h.new_zeros(0, dtype=torch.float32)
    if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
        return _FusedLogp.apply(h, targets, w, temperature, chunk_size)
    return torch.cat([_logp(h[sl], targets[sl], w, temperature) for sl in _chunks(targets.shape[0], chunk_size)])
