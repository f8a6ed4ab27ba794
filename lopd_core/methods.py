"""Methods: a teacher-context strategy x an objective. LOPD and the five baselines share everything else.

| method   | teacher reads (first user message)                               | teacher weights | objective        |
|----------|------------------------------------------------------------------|-----------------|------------------|
| lopd     | J*K latents composed from the top-J retrieved successes (§3.2)    | frozen backbone | eq. 13           |
| opsd     | a successful trajectory of the same task, as text                | frozen backbone | top-M reverse KL |
| sdft     | the same task's demonstration, framed as an in-context example   | EMA of student  | top-M reverse KL |
| sdpo     | feedback on the student's own attempt + a successful sibling     | EMA of student  | top-M reverse KL |
| skill_sd | a skill note distilled from successes in the same environment    | EMA of student  | top-M reverse KL |
| grpo     | nothing (no teacher; a k3 KL to the base model if kl_coef > 0)   | base (reference)| clipped PG       |

What each paper leaves open, and what we chose, is in each class's docstring. Common choices: every
distillation baseline uses the same top-M reverse KL as LOPD (eq. 9-10), so the comparison isolates the
teacher's context (`lopd.opd` changes the divergence or its form for all of them alike: docs/methods.md); a
record whose strategy has no privileged context for it (no known solution, no feedback) is left out of the loss
and counted (`n_no_context`); the "EMA of student" teacher is an EMA over the LoRA factors (a "teacher" adapter),
an approximation of an EMA over merged weights, and needs a LoRA student.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lopd_core.adapters import add_lora, copy_adapter
from lopd_core.batch import DistillBatch, TeacherInputs
from lopd_core.composer import Composer
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Trajectory
from lopd_core.distributed import full_tensor, shard_like
from lopd_core.loss_head import HeadOutputs
from lopd_core.losses import (
    anchor_penalty,
    balanced_margin,
    dual_step,
    group_failure_rate,
    group_normalised,
    lagrangian,
    misaligned_records,
    opd_policy_gradient,
    opd_sign,
    record_means,
    reward_aligned_weights,
    smooth_bound,
)
from lopd_core.method_rules import METHOD_RULES, MethodRules
from lopd_core.models import latent_teacher_adapter
from lopd_core.serialization import TeacherContext

if TYPE_CHECKING:
    from lopd_core.models import LOPDModels

Retriever = Callable[[str, str], list[str]]  # (task text, task id) -> up to J experience texts, never the task's own
SourceEnv = Callable[[str], str | None]  # a retrieved experience text -> the environment it came from
SolutionLookup = Callable[[str], str | None]  # task id -> a successful trajectory of that task, as text
SkillLookup = Callable[[str], str | None]  # env id -> a skill note for that environment

PRIVILEGED_HEADER = "Privileged information for this task (you will not see it at test time):\n"


# ------------------------------------------------------------------------------------ strategies


class ContextStrategy:
    """What the teacher reads, per record (a method's first half). This base gives it nothing: the teacher view
    equals the student view."""

    teacher_requires_grad = False
    teacher_adapter: str | None = None
    requires_context = False

    def contexts(self, trajectories: Sequence[Trajectory]) -> list[TeacherContext | None]:
        return [None] * len(trajectories)

    def inputs(self, trajectories: Sequence[Trajectory]) -> TeacherInputs:
        return TeacherInputs()

    def metrics(self) -> dict[str, float]:
        """Step metrics about the contexts of the last `inputs` call."""
        return {}

    def after_step(self) -> None:
        pass


class NoContext(ContextStrategy):
    """GRPO's: no privileged context (its reference model, when kl_coef > 0, reads what the student reads)."""


class LatentContext(ContextStrategy):
    """LOPD: the teacher reads J*K latents composed from the top-J retrieved successes (§3.2)."""

    teacher_requires_grad = True
    requires_context = True

    def __init__(
        self, composer: Composer, retrieve: Retriever, cfg: LOPDConfig, source_env: SourceEnv | None = None
    ) -> None:
        self.composer = composer
        self.retrieve = retrieve
        self.cfg = cfg
        self.source_env = source_env  # for the diagnostic `retrieval_same_env`, when the retriever can tell
        self.same_env: float | None = None
        self.teacher_requires_grad = not cfg.freeze_composer  # a frozen composer needs no teacher backward
        self.teacher_adapter = latent_teacher_adapter(cfg)  # the cold start's reader, if any
        self.n_placeholder = 0

    def contexts(self, trajectories: Sequence[Trajectory]) -> list[TeacherContext | None]:
        return [TeacherContext.latent(self.cfg.n_latents)] * len(trajectories)

    def inputs(self, trajectories: Sequence[Trajectory]) -> TeacherInputs:
        tasks = [t.task for t in trajectories]
        retrieved = [self.retrieve(t.task, t.task_id)[: self.cfg.n_retrieved] for t in trajectories]
        # retrieval slots the composer fills with its "no past trajectory" item (a small or empty bank)
        self.n_placeholder = sum(self.cfg.n_retrieved - len(items) for items in retrieved)
        if self.source_env is not None:  # the share of the retrieved experiences from the task's own environment
            own = [
                self.source_env(doc) == t.env_id
                for t, items in zip(trajectories, retrieved, strict=True)
                for doc in items
            ]
            self.same_env = sum(own) / len(own) if own else None
        latents = self.composer(tasks, retrieved)
        return TeacherInputs(latents, self.composer.anchor_latents(tasks, retrieved))

    def metrics(self) -> dict[str, float]:
        out = {"n_placeholder_experiences": float(self.n_placeholder)}
        if self.same_env is not None:
            out["retrieval_same_env"] = self.same_env
        return out


class TextContext(ContextStrategy):
    """A text context per record, built by `describe(trajectory, batch)`; None = no privileged info for it."""

    requires_context = True
    default_sync = "ema"  # the teacher's weights unless `baseline.teacher_sync` says: "frozen" or "ema"

    def __init__(self, models: LOPDModels, cfg: LOPDConfig) -> None:
        sync = cfg.baseline.teacher_sync if cfg.baseline.teacher_sync != "default" else self.default_sync
        self.models = models
        self.rate = cfg.baseline.teacher_ema_rate
        self.teacher_adapter = None
        if sync == "ema" and cfg.student_mode == "full":  # the teacher is the backbone: its weights follow
            models.ema_teacher = True
        elif sync == "ema":
            if "teacher" not in {n.split(".")[-2] for n, _ in models.backbone.named_parameters() if "lora_A" in n}:
                add_lora(models.backbone, "teacher", cfg.student_lora)
                models.switch.refresh()
            copy_adapter(models.backbone, "student", "teacher")
            for n, p in models.backbone.named_parameters():
                if ".teacher." in n and "lora_" in n:
                    p.requires_grad_(False)
            self.teacher_adapter = "teacher"

    def describe(self, trajectory: Trajectory, batch: Sequence[Trajectory]) -> str | None:
        raise NotImplementedError

    def contexts(self, trajectories: Sequence[Trajectory]) -> list[TeacherContext | None]:
        out: list[TeacherContext | None] = []
        for t in trajectories:
            text = self.describe(t, trajectories)
            out.append(TeacherContext.text(privileged_text(text)) if text else None)
        return out

    @torch.no_grad()
    def after_step(self) -> None:
        """EMA teacher: teacher <- (1 - a) teacher + a student, over the LoRA factors (LoRA student) or over every
        weight of the backbone (full fine-tuning; under FSDP each weight is gathered whole, a collective on every rank,
        and laid out as the teacher's shard)."""
        if self.models.ema_teacher:
            for _, teacher, student in self.models.teacher_student_pairs():
                teacher.lerp_(shard_like(full_tensor(student.detach()).to(teacher.dtype), teacher), self.rate)
            return
        if self.teacher_adapter is None:
            return
        params = dict(self.models.backbone.named_parameters())
        for n, p in params.items():
            if ".student." in n and "lora_" in n:
                params[n.replace(".student.", ".teacher.")].lerp_(p, self.rate)


def solution_text(solution: str) -> str:
    """What OPSD's teacher is told about a task (under PRIVILEGED_HEADER): a verified solution of it."""
    return f"A verified successful solution of this task:\n{solution}"


def privileged_text(text: str) -> str:
    """A text context as the teacher reads it, in front of the first user message."""
    return PRIVILEGED_HEADER + text + "\n\n"


class SolutionContext(TextContext):
    """OPSD (arXiv 2601.18734): the teacher sees a verified solution of the same task.

    The paper conditions on ground-truth reasoning traces and keeps the teacher frozen. Ours: the solution is a
    successful trajectory of the same task (from the base model's pool, or the suite generator's reference
    solution when there is none — the lookup records which), as a compact action-result trace.
    """

    default_sync = "frozen"

    def __init__(self, models: LOPDModels, cfg: LOPDConfig, solutions: SolutionLookup) -> None:
        super().__init__(models, cfg)
        self.solutions = solutions

    def describe(self, trajectory: Trajectory, batch: Sequence[Trajectory]) -> str | None:
        solution = self.solutions(trajectory.task_id)
        return solution_text(solution) if solution else None


class DemonstrationContext(SolutionContext):
    """SDFT (arXiv 2601.19897): the teacher is the model conditioned on a demonstration, in context.

    The paper shows the example's own expert demonstration as an in-context example and keeps the teacher as an
    EMA of the student. Its analytic per-token KL is reverse KL in the paper's derivation (some public
    recipes use forward KL); we use the shared top-M reverse KL.
    """

    default_sync = "ema"

    def describe(self, trajectory: Trajectory, batch: Sequence[Trajectory]) -> str | None:
        demo = self.solutions(trajectory.task_id)
        return f"Here is an example of how this task is done well:\n{demo}\nNow do the task." if demo else None


class FeedbackContext(TextContext):
    """SDPO (arXiv 2601.20802): the teacher re-reads the student's own attempt with the environment's feedback.

    Feedback = the failed checks and the error observations of this attempt, plus a successful sibling attempt
    of the same task from the same batch (the group of G rollouts) when there is one; the teacher is an EMA of
    the student. The paper also blends a GRPO advantage (lambda); we keep pure self-distillation. A successful
    attempt with no successful sibling carries no feedback: it is left out (the paper does not reprompt a
    rollout with itself).
    """

    def describe(self, trajectory: Trajectory, batch: Sequence[Trajectory]) -> str | None:
        parts = []
        failed = [c for c in trajectory.checks if not c.get("passed", False)]
        if failed:
            lines = "\n".join(f"- {c.get('name', 'check')}: {c.get('detail', 'failed')}" for c in failed)
            parts.append(f"Your previous attempt scored {trajectory.reward:.2f}. Checks it failed:\n{lines}")
        errors = [m.content for m in trajectory.messages if m.role == "tool" and _is_error(m.content)]
        if errors:
            parts.append("Errors it ran into:\n" + "\n".join(f"- {e[:300]}" for e in errors[:5]))
        if parts and trajectory.trace:
            parts.insert(0, f"Your previous attempt:\n{trajectory.trace}")
        sibling = next(
            (s for s in batch if s.task_id == trajectory.task_id and s is not trajectory and s.reward >= 1.0), None
        )
        if sibling is not None:
            parts.append(f"A successful attempt at this task:\n{sibling.trace}")
        return "\n\n".join(parts) if parts else None


class SkillContext(TextContext):
    """Skill-SD (arXiv 2604.10674): the teacher reads a skill note distilled from the environment's trajectories.

    The paper summarises completed trajectories into natural-language skills with an LLM, during training,
    and adds an importance-weighted reverse KL. Ours builds each environment's note once, before training,
    from the collect stage's successful trajectories (lopd_core.skills: workflows and frequent mistakes, no
    LLM call); the notes stay fixed while the student trains (a static choice, stated in the README). It uses
    the shared top-M reverse KL; the teacher is an EMA of the student ("synchronised with the improving
    student").
    """

    def __init__(self, models: LOPDModels, cfg: LOPDConfig, skills: SkillLookup) -> None:
        super().__init__(models, cfg)
        self.skills = skills

    def describe(self, trajectory: Trajectory, batch: Sequence[Trajectory]) -> str | None:
        note = self.skills(trajectory.env_id)
        return f"Skills for this environment:\n{note}" if note else None


def _is_error(text: str) -> bool:
    head = text[:200].lower()
    return any(k in head for k in ("error", "invalid", "unknown tool", "exception", "failed"))


# ------------------------------------------------------------------------------------ objectives

Stats = dict[str, float]


class Objective:
    """What a step minimises (a method's second half): `loss(head, batch)` -> (loss, stats), then `after_step`
    with the stats summed over ranks. This base holds the shared plumbing and no loss."""

    needs_teacher = True
    trains_teacher = True  # the loss may reach the teacher's trainable side (LOPD's composer); False: it stays put
    epochs = 1
    temperature = 1.0  # the loss head's softmax(logits / temperature): the models' own distributions

    def __init__(self, cfg: LOPDConfig) -> None:
        self.cfg = cfg

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss, stats). Data-parallel, both are this rank's shares of the global values: the step sums them over
        ranks (every stat but `beta_loss`, which every rank holds) before `after_step` sees them."""
        raise NotImplementedError

    def after_step(self, stats: Mapping[str, float]) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """The objective's own state, logged after each step (none here)."""
        return {}

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        pass


def distill_tokens(head: HeadOutputs, form: str) -> torch.Tensor:
    """The per-token distillation term by `opd.distill_form`: the divergence itself, or a policy-gradient surrogate
    whose gradient distils (its value is not a divergence: `distill_kl` still logs the divergence, weighed by
    RA-OPD's filter when `reward_aligned` is on). Shared by distillation and the hybrids' guidance."""
    assert head.kl is not None and head.teacher_logp is not None
    if form == "divergence":
        return head.kl
    if form == "sign":
        return opd_sign(head.student_logp, head.teacher_logp)
    baseline = -head.kl if form == "vopd" else None
    return opd_policy_gradient(head.student_logp, head.teacher_logp, baseline)


class DistillObjective(Objective):
    """The distillation term on the student's own tokens: top-M reverse KL (eq. 9-10) by default, or another
    divergence or form of `lopd.opd`; the margin is logged, not optimised."""

    def terms(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, torch.Tensor, float | None, Stats]:
        """(distill, margin Delta in the loss, eq. 12's token-weighted Delta for the dual step and the logs, and
        the distillation term's stats: its value, and RA-OPD's misaligned share when `reward_aligned` is on).

        The first two follow `loss_normalization` ("token" = eq. 10 and 12); the third is always token-weighted.
        `margin_advantage: balanced` gives the order-consistent margin in both places (per-record means by
        definition), and None as the third when the batch has nothing to rank (no success or no failure).
        """
        if head.kl is None or head.teacher_logp is None:
            raise ValueError(f"{type(self).__name__} needs the teacher's side of the loss head")
        norm = self.cfg.loss_normalization
        kl, per_token, stats = head.kl, distill_tokens(head, self.cfg.opd.distill_form), {}
        if self.cfg.opd.reward_aligned:  # RA-OPD: records whose distillation direction disagrees with their verdict
            weights = reward_aligned_weights(
                head.privilege, batch.rows, batch.advantages, self.cfg.opd.misaligned_weight
            )
            kl, per_token = kl * weights[batch.rows], per_token * weights[batch.rows]
            misaligned = misaligned_records(head.privilege, batch.rows, batch.advantages).sum().item()
            stats["ra_misaligned"] = misaligned / max(batch.n_records_global or batch.n_records, 1)
        distill = batch.reduce(per_token, norm)
        stats["distill_kl"] = batch.reduce(kl.detach(), norm).item()
        return (distill, *self._margin(head, batch), stats)

    def _margin(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, float | None]:
        """(Delta in the loss, Delta for the dual step and the logs; None when undefined), by `margin_advantage`."""
        if self.cfg.margin_advantage == "balanced":
            margin = balanced_margin(head.privilege, batch.rows, batch.advantages, batch.n_success_global,
                                     batch.n_failure_global)  # fmt: skip
            return (head.privilege.new_zeros(()), None) if margin is None else (margin, margin.item())
        adv = batch.advantages
        if self.cfg.margin_advantage == "centered":  # a uniform shift of the teacher's log-probs leaves Delta at 0
            adv = adv - (adv.mean() if batch.advantage_mean_global is None else batch.advantage_mean_global)
        weighted = adv[batch.rows] * head.privilege
        norm = self.cfg.loss_normalization
        margin = batch.reduce(weighted, norm)
        return margin, margin.item() if norm != "record" else batch.reduce(weighted.detach(), "token").item()

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        distill, _, margin, stats = self.terms(head, batch)  # the margin is a diagnostic here
        return distill, {**stats, **_margin_stat(margin)}


def _margin_stat(margin: float | None) -> dict[str, float]:
    """The margin as a logged stat; an undefined one (no success or no failure to rank) is left out, not 0."""
    return {} if margin is None else {"margin": margin}


class LOPDObjective(DistillObjective):
    """L = distill + beta (m - Delta) + lambda anchor (eq. 13), then beta <- max(0, beta + eta (m - Delta))."""

    def __init__(self, cfg: LOPDConfig) -> None:
        super().__init__(cfg)
        self.beta = cfg.beta_init

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        distill, margin, margin_token, stats = self.terms(head, batch)
        t = batch.teacher
        if t.latents is None or t.cold_start_latents is None:
            raise ValueError("LOPDObjective needs latents and cold-start latents from the context strategy")
        anchor = anchor_penalty(t.latents, t.cold_start_latents, self.cfg.anchor_reduction)
        if batch.world_size > 1:  # this rank's shares: the sum over ranks is the global Lagrangian
            anchor = anchor * batch.record_share()
        target = self.cfg.margin_target / batch.world_size
        loss = lagrangian(distill, margin, anchor, self.beta, target, self.cfg.anchor_weight)
        stats = {**stats, **_margin_stat(margin_token), "anchor": anchor.item()}
        return loss, {**stats, "beta_loss": self.beta}

    def after_step(self, stats: Mapping[str, float]) -> None:
        if "margin" in stats:  # an undefined balanced margin (nothing to rank) holds beta
            self.beta = dual_step(self.beta, stats["margin"], self.cfg.margin_target, self.cfg.dual_lr)

    def metrics(self) -> dict[str, float]:
        """beta and the target m it steers the margin to (logged beside the margin: why beta moved)."""
        return {"beta": float(self.beta), "margin_target": float(self.cfg.margin_target)}

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.beta = float(state["beta"])


class GRPOObjective(Objective):
    """GRPO (DeepSeekMath, arXiv 2402.03300): group-normalised advantages, clipped ratio, optional k3 KL.

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps) over the G rollouts of a task; per token
    -min(rho A, clip(rho, 1 - e, 1 + e) A) + kl_coef * (exp(ref - logp) - (ref - logp) - 1), averaged per
    sequence then over sequences (the paper's normalisation; `loss_normalization="token"` gives the token
    mean). rho = p / p_old with p_old the policy that sampled; with ppo_epochs = 1 it is exactly 1 (the clip
    acts from the second epoch). The reference for the KL is the base model (adapters off, no context).
    p is softmax(logits / T) with T = `baseline.policy_temperature`, the temperature the rollouts were sampled at,
    so that the gradient is that of the policy that sampled them (TRL's and verl's GRPO divide the logits too).
    """

    def __init__(self, cfg: LOPDConfig) -> None:
        super().__init__(cfg)
        self.needs_teacher = cfg.baseline.kl_coef > 0
        self.epochs = cfg.baseline.ppo_epochs
        self.temperature = cfg.baseline.policy_temperature or 1.0

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        b = self.cfg.baseline
        per_token, stats = clipped_policy_gradient(head, batch, b.clip_eps)
        if self.needs_teacher:
            assert head.teacher_logp is not None
            log_r = head.teacher_logp.detach() - head.student_logp
            kl = torch.exp(log_r) - log_r - 1
            per_token = per_token + b.kl_coef * kl
            stats["kl_ref"] = batch.reduce(kl.detach(), "token").item()
        norm = "record" if self.cfg.loss_normalization == "record" else "token"
        loss = batch.reduce(per_token, norm)
        stats["pg_loss"] = loss.item()
        return loss, stats


def clipped_policy_gradient(head: HeadOutputs, batch: DistillBatch, clip_eps: float) -> tuple[torch.Tensor, Stats]:
    """GRPO's per-token clipped surrogate -min(rho A, clip(rho, 1 - e, 1 + e) A) with group-normalised A, and the
    share of clipped tokens."""
    adv = group_advantages(batch.rewards, batch.groups)[batch.rows]
    old = batch.old_logp if batch.old_logp is not None else head.student_logp.detach()
    ratio = torch.exp(head.student_logp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return pg, {"clip_fraction": (clipped.mean() if batch.world_size == 1 else batch.reduce(clipped, "token")).item()}


class DiffGateObjective(Objective):
    """GRPO plus bounded teacher guidance on failed rollouts only (DiffGate, seed 004; the forms are ours):

        per token: pg + gamma * 1[A_i < 0] * f_g(i) * b tanh(d_t / b)

    pg is GRPO's clipped surrogate (`clipped_policy_gradient`); d_t the distillation term of `lopd.opd` (top-M
    reverse KL by default); f_g the failure rate of record i's group (its task's difficulty); gamma, b =
    `opd.guidance_coef`, `opd.guidance_bound`. The verifier decides which rollouts get guidance, the teacher gives
    its direction inside them. The teacher does not train (`trains_teacher`): a latent teacher stays the
    cold-started composer. Both terms use the policy temperature, as GRPO does.
    """

    trains_teacher = False

    def __init__(self, cfg: LOPDConfig) -> None:
        super().__init__(cfg)
        if cfg.baseline.kl_coef > 0:
            raise ValueError(
                "baseline.kl_coef: a hybrid's teacher is its privileged one, not the base policy that GRPO's KL "
                "needs; set baseline.kl_coef: 0"
            )
        self.epochs = cfg.baseline.ppo_epochs
        self.temperature = cfg.baseline.policy_temperature or 1.0

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        o = self.cfg.opd
        pg, stats = clipped_policy_gradient(head, batch, self.cfg.baseline.clip_eps)
        adv = batch.advantages.to(pg.dtype)
        gate = (adv < 0).to(pg.dtype) * group_failure_rate(adv, batch.groups)
        guide = smooth_bound(distill_tokens(head, o.distill_form), o.guidance_bound) * gate[batch.rows]
        norm = "record" if self.cfg.loss_normalization == "record" else "token"
        pg_loss, guidance = batch.reduce(pg, norm), batch.reduce(guide, norm)
        assert head.kl is not None
        stats |= {"pg_loss": pg_loss.item(), "guidance": guidance.item(),
                  "guided_share": float((gate > 0).float().mean()),
                  "distill_kl": batch.reduce(head.kl.detach(), norm).item()}  # fmt: skip
        return pg_loss + o.guidance_coef * guidance, stats


class SCOPEObjective(Objective):
    """SCOPE's dual path (seed 004; the weights' forms are ours): rollouts routed by their verdict.

        failures (A < 0): gamma * w_T(i) * d_t   with w_T prop. to 1 / PPL_teacher(i) = exp(mean_t log pT)
        successes (A > 0): w_S(i) * (-log pS(a_t))   with w_S prop. to PPL_student(i) = exp(-mean_t log pS)

    Each path's weights are normalised within the task's group (`group_normalised`: the members average 1): the
    teacher's guidance counts most where it is confident of the student's tokens, the likelihood where the student
    is least sure of a success it found. d_t is the distillation term of `lopd.opd`; gamma = `opd.guidance_coef`.
    The teacher does not train.
    """

    trains_teacher = False

    def __init__(self, cfg: LOPDConfig) -> None:
        super().__init__(cfg)

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        if head.kl is None or head.teacher_logp is None:
            raise ValueError("SCOPEObjective needs the teacher's side of the loss head")
        adv, n = batch.advantages, batch.n_records
        teacher_conf = record_means(head.teacher_logp.detach(), batch.rows, n).exp()
        student_ppl = (-record_means(head.student_logp.detach(), batch.rows, n)).exp()
        w_fail = group_normalised(teacher_conf, batch.groups, adv < 0).to(head.kl.dtype)
        w_success = group_normalised(student_ppl, batch.groups, adv > 0).to(head.kl.dtype)
        guide = distill_tokens(head, self.cfg.opd.distill_form) * w_fail[batch.rows]
        likelihood = -head.student_logp * w_success[batch.rows]
        norm = "record" if self.cfg.loss_normalization == "record" else "token"
        guidance, mle = batch.reduce(guide, norm), batch.reduce(likelihood, norm)
        stats = {"guidance": guidance.item(), "likelihood": mle.item(),
                 "distill_kl": batch.reduce(head.kl.detach(), norm).item()}  # fmt: skip
        return self.cfg.opd.guidance_coef * guidance + mle, stats


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean_g) / (std_g + eps) within each group of equal `groups` ids (population std, as in GRPO)."""
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        idx = groups == g
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv


# ------------------------------------------------------------------------------------ registry


@dataclass(frozen=True)
class Method:
    """A method = a teacher-context strategy + an objective, with the rules the rest of the platform reads
    (`lopd_core.method_rules`: configs, specs and stages ask those by name, without loading a model)."""

    strategy: Callable[..., ContextStrategy]  # (models, cfg, inputs) -> strategy
    context: type[ContextStrategy]  # the strategy's class: what the teacher reads
    objective: type[Objective]
    rules: MethodRules


def _latent(m: LOPDModels, c: LOPDConfig, i: dict[str, Any]) -> LatentContext:
    return LatentContext(m.composer, i["retrieve"], c, i["source_env"])


def _solution(m: LOPDModels, c: LOPDConfig, i: dict[str, Any]) -> SolutionContext:
    return SolutionContext(m, c, i["solutions"])


METHODS: dict[str, Method] = {  # every method, once (its name is config.MethodName)
    "lopd": Method(_latent, LatentContext, LOPDObjective, METHOD_RULES["lopd"]),
    "opsd": Method(_solution, SolutionContext, DistillObjective, METHOD_RULES["opsd"]),
    "sdft": Method(
        lambda m, c, i: DemonstrationContext(m, c, i["solutions"]),
        DemonstrationContext,
        DistillObjective,
        METHOD_RULES["sdft"],
    ),
    "sdpo": Method(lambda m, c, i: FeedbackContext(m, c), FeedbackContext, DistillObjective, METHOD_RULES["sdpo"]),
    "skill_sd": Method(
        lambda m, c, i: SkillContext(m, c, i["skills"]), SkillContext, DistillObjective, METHOD_RULES["skill_sd"]
    ),
    "grpo": Method(lambda m, c, i: NoContext(), NoContext, GRPOObjective, METHOD_RULES["grpo"]),
    # the hybrids: an RL term and a teacher's guidance on failures; any context strategy can be the teacher
    "diffgate": Method(_solution, SolutionContext, DiffGateObjective, METHOD_RULES["diffgate"]),
    "diffgate_latent": Method(_latent, LatentContext, DiffGateObjective, METHOD_RULES["diffgate_latent"]),
    "scope": Method(_solution, SolutionContext, SCOPEObjective, METHOD_RULES["scope"]),
}


def teacher_sync(cfg: LOPDConfig) -> str | None:
    """A text teacher's weights for `cfg`: "frozen" or "ema" (`baseline.teacher_sync`, else the method's default);
    None when the method's teacher reads no text context (LOPD, GRPO)."""
    context = METHODS[cfg.method].context
    if not issubclass(context, TextContext):
        return None
    return context.default_sync if cfg.baseline.teacher_sync == "default" else cfg.baseline.teacher_sync


def build_method(
    models: LOPDModels,
    cfg: LOPDConfig,
    retrieve: Retriever | None = None,
    solutions: SolutionLookup | None = None,
    skills: SkillLookup | None = None,
    source_env: SourceEnv | None = None,
) -> tuple[ContextStrategy, Objective]:
    """(strategy, objective) for `cfg.method`; names the missing input when a method needs one. `source_env`
    (optional) tells the environment of a retrieved experience, for LOPD's diagnostic `retrieval_same_env`."""
    if cfg.method not in METHODS:
        raise ValueError(f"unknown method {cfg.method!r} (known: {', '.join(METHODS)})")
    method = METHODS[cfg.method]
    inputs = {"retrieve": retrieve, "solutions": solutions, "skills": skills, "source_env": source_env}
    for name in method.rules.needs:
        if inputs[name] is None:
            raise ValueError(f"method {cfg.method!r} needs `{name}`")
    return method.strategy(models, cfg, inputs), method.objective(cfg)
