"""What each method needs from the rest of the platform, by name, without loading a model: configs, flow specs and
stage specs ask `METHOD_RULES[name]` (this module imports nothing heavy, so validating a config stays fast). The
methods themselves, a context strategy and an objective, are `lopd_core.methods.METHODS`, one entry per name here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodRules:
    needs: tuple[str, ...] = ()  # inputs of the strategy: retrieve (the bank and the composer), solutions, skills
    min_group: int = 1  # rollouts per task that a step needs (schedule.samples_per_task)
    group_reason: str = ""  # why, for the error when the schedule has fewer
    acting_teacher: bool = False  # its teacher can act as a policy with a context built from the task alone
    text_teacher: bool = False  # its teacher reads a text context (a solution, feedback, a note): weights synced
    policy_gradient: bool = False  # a GRPO term (clip, KL, epochs, temperature)

    @property
    def reads_bank(self) -> bool:
        """Its teacher retrieves from the experience bank through the cold-started composer (LOPD)."""
        return "retrieve" in self.needs

    @property
    def reads_notes(self) -> bool:
        """Its teacher reads skill notes built from the collect stage's trajectories (Skill-SD)."""
        return "skills" in self.needs

    def check_group(self, name: str, samples_per_task: int, field: str = "schedule.samples_per_task") -> None:
        """A clear error when a step's groups are smaller than the method needs."""
        if samples_per_task < self.min_group:
            raise ValueError(f"method {name!r} needs {field} >= {self.min_group}: {self.group_reason}")


METHOD_RULES: dict[str, MethodRules] = {  # every method, once (its name is config.MethodName)
    "lopd": MethodRules(needs=("retrieve",)),  # its teacher acts through latent_eval, not teacher_eval
    "opsd": MethodRules(needs=("solutions",), acting_teacher=True, text_teacher=True),
    "sdft": MethodRules(needs=("solutions",), acting_teacher=True, text_teacher=True),
    "sdpo": MethodRules(  # its context is the student's own attempt: no acting teacher
        text_teacher=True,
        min_group=2,
        group_reason="its teacher reads a successful sibling attempt of the same task from the group (with 1 it "
        "would see feedback only)",
    ),
    "skill_sd": MethodRules(needs=("skills",), acting_teacher=True, text_teacher=True),
    "grpo": MethodRules(
        policy_gradient=True,
        min_group=2,
        group_reason="the group size G: GRPO normalises each advantage within its task's G rollouts",
    ),
    # the hybrids (seed 004): an RL term plus a teacher's guidance on failed rollouts, with any context as teacher
    "diffgate": MethodRules(  # GRPO + OPSD's teacher (the verified solution) on failures
        needs=("solutions",),
        text_teacher=True,
        policy_gradient=True,
        min_group=2,
        group_reason="the group size G: its GRPO term normalises advantages within a task's G rollouts, and its "
        "guidance scales with the group's failure rate",
        acting_teacher=True,
    ),
    "diffgate_latent": MethodRules(  # GRPO + LOPD's latent teacher (the cold-started composer, frozen) on failures
        needs=("retrieve",),
        policy_gradient=True,
        min_group=2,
        group_reason="the group size G: its GRPO term normalises advantages within a task's G rollouts",
    ),
    "scope": MethodRules(  # SCOPE's dual path with OPSD's teacher
        needs=("solutions",),
        text_teacher=True,
        policy_gradient=True,
        min_group=2,
        group_reason="SCOPE normalises each path's weights within a task's group of rollouts",
        acting_teacher=True,
    ),
}


# Which of LOPDConfig's fields a method reads, by group; a field in no group applies to every method. The tracking
# logs only the params that apply to a run's method (a GRPO run shows no margin target).
_COMPOSER = frozenset({  # the composer and its retrieval: methods whose teacher reads the bank
    "n_retrieved", "retrieval_scope", "min_bank_size", "n_queries", "qformer_layers", "qformer_ff_mult",
    "encoder_max_tokens", "encoder_layer", "latent_values", "encoder_lora", "freeze_composer", "teacher_reader",
    "composer_lr", "composer_clip", "grad_clip_composer", "grad_clip_lora", "grad_clip_qformer",
})  # fmt: skip
_CONSTRAINT = frozenset({"margin_target", "anchor_weight", "anchor_reduction", "dual_lr", "beta_init"})  # LOPD's
_DISTILL = frozenset({  # the teacher's top-M distillation and its diagnostic margin: every method with a teacher
    "top_m", "kl_support", "tail_floor", "margin_advantage", "opd.divergence", "opd.divergence_coef",
    "opd.distill_form", "opd.reward_aligned", "opd.misaligned_weight",
})  # fmt: skip
_POLICY_GRADIENT = frozenset({"baseline.clip_eps", "baseline.kl_coef", "baseline.ppo_epochs",
                              "baseline.policy_temperature"})  # fmt: skip
_GUIDANCE = frozenset({"opd.guidance_coef", "opd.guidance_bound"})  # the hybrids' guidance on failed rollouts
_TEXT_TEACHER = frozenset({"baseline.teacher_sync", "baseline.teacher_ema_rate"})  # a text teacher's weights


def composer_fields() -> frozenset[str]:
    """LOPDConfig's fields that decide the composer and the cold start (what two LOPD arms must share to share one
    cold-started composer)."""
    training = {"composer_lr", "composer_clip", "grad_clip_composer", "grad_clip_lora", "grad_clip_qformer",
                "freeze_composer", "min_bank_size"}  # fmt: skip
    return _COMPOSER - training


def applies(method: str, field: str) -> bool:
    """Whether LOPDConfig's `field` (flat key: "margin_target", "baseline.clip_eps", "encoder_lora.r") changes what
    `method` does."""
    rules = METHOD_RULES[method]
    head = field.split(".", 1)[0]
    key = field if head in ("opd", "baseline") else head
    has_teacher = rules.reads_bank or rules.text_teacher
    if key in _COMPOSER:
        return rules.reads_bank
    if key in _CONSTRAINT:
        return method == "lopd"
    if key in _DISTILL:
        return has_teacher
    if key in _POLICY_GRADIENT:
        return rules.policy_gradient
    if key in _GUIDANCE:
        return rules.policy_gradient and has_teacher
    if key in _TEXT_TEACHER:
        return rules.text_teacher
    return True
