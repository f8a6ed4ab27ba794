"""Privileged text for the baselines, built from the run's own trajectories (no external model).

* `solutions`: task id -> a successful trajectory's compact trace (OPSD / SDFT), falling back to the trace of the
  suite generator's reference solution, replayed, when the base model never solved the task; the source is recorded.
* `skill_notes`: env id -> a short note of the workflows that succeeded and the mistakes that recurred in that
  environment (Skill-SD). The paper writes skills with an LLM; ours counts tool-call patterns instead.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

from lopd_core.conversation import Trajectory
from lopd_core.envs.actions import parse_action


def call_names(trajectory: Trajectory) -> list[str]:
    names = []
    for m in trajectory.messages:
        if m.role == "assistant":
            names.extend(c.name for c in parse_action(m.content).calls)
    return names


def solutions(
    trajectories: Iterable[Trajectory], references: Mapping[str, str] | None = None
) -> dict[str, tuple[str, str]]:
    """task id -> (solution text, source) with source "rollout" (the model's own success) or "reference" (the
    trace of the task's reference solution replayed through its episode, `lopd_core.sft.reference_traces`: the
    same form as a rollout's trace)."""
    out: dict[str, tuple[str, str]] = {}
    for t in trajectories:
        if t.reward >= 1.0 and not t.failed and t.trace and t.task_id not in out:
            out[t.task_id] = (t.trace, "rollout")
    for task_id, trace in (references or {}).items():
        if task_id not in out and trace:
            out[task_id] = (trace, "reference")
    return out


def skill_notes(trajectories: Iterable[Trajectory], top: int = 3) -> dict[str, str]:
    """env id -> note: the most frequent successful call sequences and the most frequent error observations."""
    workflows: dict[str, Counter[str]] = defaultdict(Counter)
    mistakes: dict[str, Counter[str]] = defaultdict(Counter)
    for t in trajectories:
        if t.failed:
            continue
        if t.reward >= 1.0:
            names = call_names(t)
            if names:
                workflows[t.env_id][" -> ".join(names)] += 1
        for m in t.messages:
            if m.role == "tool" and m.content.lower().startswith(("error", "invalid", "unknown")):
                mistakes[t.env_id][m.content.splitlines()[0][:120]] += 1
    notes = {}
    for env in sorted(set(workflows) | set(mistakes)):
        lines = []
        if workflows[env]:
            lines.append("Workflows that solved tasks here:")
            lines += [f"- {w} (x{n})" for w, n in workflows[env].most_common(top)]
        if mistakes[env]:
            lines.append("Mistakes to avoid:")
            lines += [f"- {e} (x{n})" for e, n in mistakes[env].most_common(top)]
        notes[env] = "\n".join(lines)
    return notes
