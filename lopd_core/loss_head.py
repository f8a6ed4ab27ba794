"""The loss head from hidden states, in position chunks, recomputed in backward: full logits are never held.

For N supervised tokens the naive head materialises two [N, V] logit matrices (plus softmax temporaries);
at T = 16k and V = 49k that is gigabytes per side. Here the lm-head projection, the top-M bucket KL (eq. 9-10)
and the sampled-token log-probabilities (eq. 11) are computed chunk by chunk under activation
checkpointing: the forward keeps only per-token scalars, and the backward recomputes one chunk's logits at a
time (the fused linear + loss idea of Liger Kernel). `lopd_core.losses` holds the readable logits-level
definitions; tests check that both give the same values and gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

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


def _chunk(
    h_s: torch.Tensor,
    h_t: torch.Tensor,
    targets: torch.Tensor,
    w_s: torch.Tensor,
    w_t: torch.Tensor,
    top_m: int,
    support: str,
    tail_floor: float | None,
    temperature: float = 1.0,
    divergence: str = "reverse_kl",
    divergence_coef: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits_s, logits_t = _at_least_fp32(h_s @ w_s.T), _at_least_fp32(h_t @ w_t.T)
    if temperature != 1.0:  # GRPO at its sampling temperature; the distillation methods skip a pass over [N, V]
        logits_s, logits_t = logits_s / temperature, logits_t / temperature
    source = logits_t if support == "teacher" else logits_s
    ids = source.detach().topk(min(top_m, source.shape[-1]), dim=-1).indices
    buckets_t = topm_bucket_logprobs(logits_t, ids, tail_floor)
    kl = bucket_divergence(topm_bucket_logprobs(logits_s, ids, tail_floor), buckets_t, divergence, divergence_coef)
    teacher_logp = logits_t.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits_t, -1)
    student_logp = logits_s.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits_s, -1)
    with torch.no_grad():
        mass = buckets_t[:, : ids.shape[-1]].exp().sum(-1)
    return kl, teacher_logp, student_logp, mass


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
    fn = partial(_chunk, top_m=top_m, support=support, tail_floor=tail_floor, temperature=temperature,
                 divergence=divergence, divergence_coef=divergence_coef)  # fmt: skip
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (h_student, h_teacher, w_student, w_teacher))
    parts = []
    for start in range(0, targets.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        args = (h_student[sl], h_teacher[sl], targets[sl], w_student, w_teacher)
        parts.append(checkpoint(fn, *args, use_reentrant=False) if needs_grad else fn(*args))
    if not parts:
        empty = h_student.new_zeros(0, dtype=torch.float32)
        return HeadOutputs(empty, empty, empty, empty)
    kl, teacher_logp, student_logp, mass = (torch.cat(x) for x in zip(*parts, strict=True))
    return HeadOutputs(student_logp=student_logp, kl=kl, teacher_logp=teacher_logp, teacher_topm_mass=mass)


def _logp_chunk(h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logits = _at_least_fp32(h @ w.T)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def token_logprobs(
    h: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, chunk_size: int = 1024, temperature: float = 1.0
) -> torch.Tensor:
    """log p(targets) [N] from hidden states [N, d] and an lm-head weight [V, d], chunked like `distill_head`;
    p = softmax(logits / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    parts = []
    for start in range(0, targets.shape[0], chunk_size):
        args = (h[start : start + chunk_size], targets[start : start + chunk_size], w, temperature)
        parts.append(checkpoint(_logp_chunk, *args, use_reentrant=False) if needs_grad else _logp_chunk(*args))
    return torch.cat(parts) if parts else h.new_zeros(0, dtype=torch.float32)
