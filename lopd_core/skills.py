"""Privileged text for the baselines, built from the run's own trajectories (no external model).

* `solutions`: task id -> a successful trajectory's compact trace (OPSD / SDFT), falling back to the suite
  generator's reference solution when the base model never solved the task; the source is recorded.
* `skill_notes`: env id -> a short note of the workflows that succeeded and the mistakes that recurred in that
  environment (Skill-SD). The paper writes skills with an LLM; ours counts tool-call patterns instead.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lopd_core.conversation import Trajectory
from lopd_core.envs.actions import parse_action


def call_names(trajectory: Trajectory) -> list[str]:
    names = []
    for m in trajectory.messages:
        if m.role == "assistant":
            names.extend(c.name for c in parse_action(m.content).calls)
    return names


def format_reference(calls: Sequence[Mapping[str, Any]]) -> str:
    return "\n".join(f"{c['name']}({json.dumps(c.get('arguments', {}), sort_keys=True)})" for c in calls)


def solutions(
    trajectories: Iterable[Trajectory], references: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
) -> dict[str, tuple[str, str]]:
    """task id -> (solution text, source) with source "rollout" (the model's own success) or "reference"."""
    out: dict[str, tuple[str, str]] = {}
    for t in trajectories:
        if t.reward >= 1.0 and not t.failed and t.trace and t.task_id not in out:
            out[t.task_id] = (t.trace, "rollout")
    for task_id, calls in (references or {}).items():
        if task_id not in out and calls:
            out[task_id] = (format_reference(calls), "reference")
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
