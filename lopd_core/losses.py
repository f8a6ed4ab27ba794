"""LOPD's objective, term by term (paper §3.3, eq. 9-13), as readable logits-level functions.

Every function takes logits already aligned with the token they score: `logits[b, t]` is the distribution
for `tokens[b, t]`. Masks are 0/1 over supervised action tokens. These are the reference definitions; the
train step computes the same quantities from hidden states in chunks (`lopd_core.loss_head`), and a test
checks that both agree in values and gradients.
"""

from __future__ import annotations

import math

import torch


def topm_bucket_logprobs(
    logits: torch.Tensor, support: torch.Tensor, tail_floor: float | None = None, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """Log-probabilities of the M+1 buckets (eq. 9): the M support ids, then one tail bucket with the rest.
    (When S covers the whole vocabulary there is no tail and M buckets are returned.)

    The tail is `logsumexp(logits outside S) - logsumexp(all logits)`: finite whenever any mass lies outside
    S, with no log of a difference and no clamp. `logits` [..., V], `support` [..., M] -> [..., M+1].
    `tail_floor` (a log-mass < 0, e.g. -1e-7) reproduces the reference code, which caps the support's log-mass
    at it, i.e. floors the tail at log(1 - exp(tail_floor)) (about -16.1 nats for -1e-7, no gradient there).
    `lse` [..., 1]: the logits' logsumexp when the caller already has it (the fused head computes it once a side).
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True) if lse is None else lse
    inside = logits.gather(-1, support) - lse
    if support.shape[-1] >= logits.shape[-1]:  # the support is the whole vocabulary: no tail bucket
        return inside
    outside = logits.scatter(-1, support, float("-inf"))
    tail = torch.logsumexp(outside, dim=-1, keepdim=True) - lse
    if tail_floor is not None:
        if not tail_floor < 0:
            raise ValueError(f"tail_floor is a log-mass and must be < 0, got {tail_floor}")
        tail = tail.clamp_min(math.log(-math.expm1(tail_floor)))
    return torch.cat([inside, tail], dim=-1)


def bucket_kl(student_buckets: torch.Tensor, teacher_buckets: torch.Tensor) -> torch.Tensor:
    """KL(p̃S || p̃T) = sum_b pS_b (log pS_b - log pT_b) over the last dim; empty buckets contribute 0."""
    return _kl(student_buckets, teacher_buckets)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_b p_b (log p_b - log q_b) over the last dim, from log-probabilities; p_b = 0 adds 0."""
    p = p_log.exp()
    diff = p_log - q_log
    return (p * torch.where(p > 0, diff, torch.zeros_like(diff))).sum(-1)


DIVERGENCES = ("reverse_kl", "forward_kl", "jsd", "mix")


def bucket_divergence(
    student_buckets: torch.Tensor, teacher_buckets: torch.Tensor, divergence: str = "reverse_kl", coef: float = 0.5
) -> torch.Tensor:
    """The distillation divergence D(p̃S, p̃T) between bucket distributions (log-probabilities, last dim).

    - reverse_kl: KL(p̃S || p̃T), the paper's (eq. 10): mode-seeking, the student's own mass decides.
    - forward_kl: KL(p̃T || p̃S): mass-covering (supervised KD, GKD with beta = 0).
    - jsd: the generalised Jensen-Shannon divergence of GKD (Agarwal et al. 2024, arXiv 2306.13649) with
      `coef` = beta in (0, 1): beta KL(p̃T || M) + (1 - beta) KL(p̃S || M), M = beta p̃T + (1 - beta) p̃S; bounded
      by the binary entropy of beta (log 2 at beta = 1/2). TRL's GKD writes the same mixture.
    - mix: `coef` = lambda in [0, 1]: lambda KL(p̃T || p̃S) + (1 - lambda) KL(p̃S || p̃T).
    Every form is exact with the tail bucket: it is one more category of both distributions.
    """
    if divergence == "reverse_kl":
        return _kl(student_buckets, teacher_buckets)
    if divergence == "forward_kl":
        return _kl(teacher_buckets, student_buckets)
    if divergence == "jsd":
        if not 0 < coef < 1:
            raise ValueError(f"jsd's beta (divergence_coef) must lie in (0, 1), got {coef}")
        # a bucket empty on both sides stays empty in M; logaddexp(-inf, -inf)'s backward would be NaN
        empty = torch.isneginf(teacher_buckets) & torch.isneginf(student_buckets)
        t, st = (torch.where(empty, torch.zeros_like(x), x) for x in (teacher_buckets, student_buckets))
        mixture = torch.logaddexp(t + math.log(coef), st + math.log1p(-coef))
        mixture = torch.where(empty, torch.full_like(mixture, float("-inf")), mixture)
        return coef * _kl(teacher_buckets, mixture) + (1 - coef) * _kl(student_buckets, mixture)
    if divergence == "mix":
        if not 0 <= coef <= 1:
            raise ValueError(f"mix's lambda (divergence_coef) must lie in [0, 1], got {coef}")
        forward = _kl(teacher_buckets, student_buckets)
        reverse = _kl(student_buckets, teacher_buckets)
        return coef * forward + (1 - coef) * reverse
    raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-weighted mean over the whole batch: sum(mask * v) / sum(mask); 0 when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def topm_tail_reverse_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    top_m: int = 20,
    support: str = "teacher",
    tail_floor: float | None = None,
) -> torch.Tensor:
    """Distillation loss (eq. 9-10): reverse KL(p̃S || p̃T) on the top-M support plus a tail bucket.

    The support S is the teacher's top-M ids at each position (detached); `support="student"` uses the
    student's instead. Token-weighted mean over masked positions of the whole batch. Gradient reaches the
    student through p̃S and the teacher's inputs (the composer's latents) through p̃T.
    """
    return topm_tail_divergence(student_logits, teacher_logits, mask, top_m, support, tail_floor)


def topm_tail_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    top_m: int = 20,
    support: str = "teacher",
    tail_floor: float | None = None,
    divergence: str = "reverse_kl",
    coef: float = 0.5,
) -> torch.Tensor:
    """`topm_tail_reverse_kl` with any `bucket_divergence` on the same top-M + tail buckets (eq. 9)."""
    if support not in ("teacher", "student"):
        raise ValueError(f"support must be 'teacher' or 'student', got {support!r}")
    if top_m < 1:
        raise ValueError(f"top_m must be >= 1, got {top_m}")
    source = teacher_logits if support == "teacher" else student_logits
    ids = source.detach().topk(min(top_m, source.shape[-1]), dim=-1).indices
    buckets_s = topm_bucket_logprobs(student_logits, ids, tail_floor)
    buckets_t = topm_bucket_logprobs(teacher_logits, ids, tail_floor)
    return masked_mean(bucket_divergence(buckets_s, buckets_t, divergence, coef), mask)


def opd_policy_gradient(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, baseline: torch.Tensor | None = None
) -> torch.Tensor:
    """OPD as a policy gradient (vOPD, seed 004), per token: -(r - b) log pS(a) with the per-token reward
    r = log pT(a) - log pS(a) and a baseline b, both detached (`baseline` None: b = 0, plain single-sample OPD).

    Sampling a ~ pS, the expected gradient is that of -E[r] = KL(pS || pT) for any b that does not depend on a,
    so b only lowers the variance; vOPD's b is the value -KL(pS || pT) of the position, here on the top-M buckets.
    The teacher gets no gradient: this form distils into the student only.
    """
    reward = (teacher_logp - student_logp).detach()
    advantage = reward if baseline is None else reward - baseline.detach()
    return -advantage * student_logp


def opd_sign(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL-free OPD (seed 004), per token: -sign(log pT(a) - log pS(a)) log pS(a): raise the sampled token where the
    teacher gives it more probability than the student, lower it where less, by the direction alone."""
    return -torch.sign((teacher_logp - student_logp).detach()) * student_logp


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary log p(tokens) from aligned logits: [B, T, V], [B, T] -> [B, T]."""
    return logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_privilege(teacher_logits: torch.Tensor, student_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Privilege (eq. 11): delta = log pT(a) - stopgrad(log pS(a)) on the sampled token a, full vocabulary."""
    return token_logprob(teacher_logits, tokens) - token_logprob(student_logits, tokens).detach()


def advantages_from_rewards(rewards: torch.Tensor | list[float]) -> torch.Tensor:
    """Trajectory verdict A = 2r - 1 in [-1, 1]; rewards outside [0, 1] are an error."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.numel() and (not torch.isfinite(r).all() or r.min() < 0 or r.max() > 1):
        raise ValueError(f"rewards must lie in [0, 1], got {r.tolist()}")
    return 2.0 * r - 1.0


def batch_margin(privilege: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Margin (eq. 12): Delta = sum(mask * A * delta) / sum(mask); `advantages` [B] broadcast over tokens."""
    return masked_mean(advantages.to(privilege.dtype).unsqueeze(-1) * privilege, mask)


def balanced_margin(
    privilege: torch.Tensor,
    rows: torch.Tensor,
    advantages: torch.Tensor,
    n_success: int | None = None,
    n_failure: int | None = None,
) -> torch.Tensor | None:
    """Order-consistent margin (ours, after Uni-OPD's criterion, seed 004): with d_r the mean privilege delta over
    record r's tokens, Delta = 1/2 mean_{A_r > 0} d_r - 1/2 mean_{A_r < 0} d_r (A = 0: neither).

    A uniform shift of the teacher's log-probabilities moves every d_r alike and cancels, so a teacher that is
    merely worse (or better) everywhere cannot meet it: only ranking successes above failures can. Successes and
    failures weigh one half each whatever the success rate. None when the batch holds no success or no failure
    (nothing to rank). `privilege` [N], `rows` [N] record index per token, `advantages` [B]. Data-parallel:
    `n_success`, `n_failure` are the step's counts over every rank, and the result is this rank's share.
    """
    n_records = advantages.shape[0]  # records without tokens count as neither (the step collates none)
    sums = privilege.new_zeros(n_records).index_add(0, rows, privilege)
    counts = privilege.new_zeros(n_records).index_add(0, rows, torch.ones_like(privilege))
    per_record = sums / counts.clamp_min(1.0)
    success, failure = (advantages > 0) & (counts > 0), (advantages < 0) & (counts > 0)
    n_s = int(success.sum()) if n_success is None else n_success
    n_f = int(failure.sum()) if n_failure is None else n_failure
    if n_s == 0 or n_f == 0:
        return None
    return 0.5 * per_record[success].sum() / n_s - 0.5 * per_record[failure].sum() / n_f


def misaligned_records(privilege: torch.Tensor, rows: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """RA-OPD's test (Reward-Aligned OPD, seed 004), per record [B] (bool): whether its distillation direction
    disagrees with its verdict.

    A record's distillation return is the sum of its tokens' delta = log pT(a) - log pS(a) (detached): distilling
    raises the record's likelihood when it is > 0 and lowers it when it is < 0. It agrees with a success (A > 0)
    when > 0 and with a failure (A < 0) when < 0; a return of 0, or A = 0, counts as aligned (nothing to disagree).
    """
    returns = privilege.detach().new_zeros(advantages.shape[0]).index_add(0, rows, privilege.detach())
    return returns * advantages.to(returns.dtype) < 0


def reward_aligned_weights(
    privilege: torch.Tensor, rows: torch.Tensor, advantages: torch.Tensor, misaligned_weight: float = 0.0
) -> torch.Tensor:
    """RA-OPD's filter per record [B]: 1 where aligned, `misaligned_weight` (0 = drop) where `misaligned_records`."""
    if not 0 <= misaligned_weight <= 1:
        raise ValueError(f"misaligned_weight must lie in [0, 1], got {misaligned_weight}")
    misaligned = misaligned_records(privilege, rows, advantages)
    ones = torch.ones(advantages.shape[0], dtype=privilege.dtype, device=privilege.device)
    return torch.where(misaligned, torch.full_like(ones, misaligned_weight), ones)


def record_means(values: torch.Tensor, rows: torch.Tensor, n_records: int) -> torch.Tensor:
    """The mean of `values` [N] over each record's tokens, per record [n_records] (0 for a record without tokens)."""
    sums = values.new_zeros(n_records).index_add(0, rows, values)
    counts = values.new_zeros(n_records).index_add(0, rows, torch.ones_like(values))
    return sums / counts.clamp_min(1.0)


def smooth_bound(values: torch.Tensor, bound: float) -> torch.Tensor:
    """DiffGate's bounded guidance (seed 004; the form is ours): b * tanh(d / b), near d for |d| << b and never
    past b, so a token where teacher and student disagree wildly cannot dominate; its gradient is sech^2(d / b)
    times d's. `bound` = 0: d unchanged."""
    if bound < 0:
        raise ValueError(f"bound must be >= 0, got {bound}")
    return values if bound == 0 else bound * torch.tanh(values / bound)


def group_failure_rate(advantages: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per record [B]: the share of failures (A < 0) among the rollouts of its group (its task): DiffGate's scale
    of teacher guidance by the group's difficulty."""
    failed = (advantages < 0).to(advantages.dtype)
    out = torch.zeros_like(failed)
    for g in groups.unique():
        idx = groups == g
        out[idx] = failed[idx].mean()
    return out


def group_normalised(scores: torch.Tensor, groups: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """SCOPE's group-level normalisation (seed 004; the form is ours): per record [B], its score divided by the
    mean score of its group's `members` (bool [B]), so each group's members average weight 1 whatever the task's
    difficulty; 0 for non-members. `scores` must be > 0 (detached: a weight, not a path for the gradient)."""
    scores = scores.detach()
    out = torch.zeros_like(scores)
    for g in groups.unique():
        idx = (groups == g) & members
        if idx.any():
            out[idx] = scores[idx] / scores[idx].mean()
    return out


def anchor_penalty(latents: torch.Tensor, cold_start_latents: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Anchor (eq. 13): ||c_phi - sg(c_phi0)||^2 per task, averaged over the batch.

    `latents` [B, J*K, d]. `reduction="sum"` is the paper's squared L2 norm over all J*K*d entries; "mean"
    divides by J*K*d, as the reference code does (only for reproduction studies: it weakens lambda by J*K*d).
    """
    if latents.shape != cold_start_latents.shape:
        raise ValueError(f"anchor: latents {tuple(latents.shape)} vs cold-start {tuple(cold_start_latents.shape)}")
    sq = (latents - cold_start_latents.detach()).pow(2).flatten(1)
    if reduction == "sum":
        return sq.sum(-1).mean()
    if reduction == "mean":
        return sq.mean(-1).mean()
    raise ValueError(f"anchor reduction must be 'sum' or 'mean', got {reduction!r}")


def lagrangian(
    distill: torch.Tensor, margin: torch.Tensor, anchor: torch.Tensor, beta: float, target: float, lam: float
) -> torch.Tensor:
    """Objective (eq. 13): L = distill + beta * (m - Delta) + lambda * anchor."""
    return distill + beta * (target - margin) + lam * anchor


def dual_step(beta: float, margin: float, target: float, lr: float) -> float:
    """Projected dual ascent on beta (eq. 13): beta <- max(0, beta + eta * (m - Delta))."""
    return max(0.0, float(beta) + lr * (target - float(margin)))
