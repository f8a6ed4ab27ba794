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
    "opsd": MethodRules(needs=("solutions",), acting_teacher=True),
    "sdft": MethodRules(needs=("solutions",), acting_teacher=True),
    "sdpo": MethodRules(  # its context is the student's own attempt: no acting teacher
        min_group=2,
        group_reason="its teacher reads a successful sibling attempt of the same task from the group (with 1 it "
        "would see feedback only)",
    ),
    "skill_sd": MethodRules(needs=("skills",), acting_teacher=True),
    "grpo": MethodRules(
        min_group=2, group_reason="the group size G: GRPO normalises each advantage within its task's G rollouts"
    ),
    # the hybrids (seed 004): an RL term plus a teacher's guidance on failed rollouts, with any context as teacher
    "diffgate": MethodRules(  # GRPO + OPSD's teacher (the verified solution) on failures
        needs=("solutions",),
        min_group=2,
        group_reason="the group size G: its GRPO term normalises advantages within a task's G rollouts, and its "
        "guidance scales with the group's failure rate",
        acting_teacher=True,
    ),
    "diffgate_latent": MethodRules(  # GRPO + LOPD's latent teacher (the cold-started composer, frozen) on failures
        needs=("retrieve",),
        min_group=2,
        group_reason="the group size G: its GRPO term normalises advantages within a task's G rollouts",
    ),
    "scope": MethodRules(  # SCOPE's dual path with OPSD's teacher
        needs=("solutions",),
        min_group=2,
        group_reason="SCOPE normalises each path's weights within a task's group of rollouts",
        acting_teacher=True,
    ),
}
