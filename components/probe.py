"""The latent-dependence probe of a stage's models (lopd_core.latent_probe), on the suite's house rules: what the
cold start and the train stage call, with the bank snapshot they hold open.

    probe = latent_probe_for(spec.suite, spec.validation_fraction, spec.difficulties, n, seed, bank, J)
    result = probe(models, serializer)      # None for a suite without house rules or n = 0

Targets: the validation slice's tasks at the stage's levels (the training split's when there is no slice), their
verified reference replays; never held-out tasks. Experiences: the bank's top-J successes of one environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from components.common import open_suite
from lopd_core.latent_probe import Experiences, LatentProbe, latent_probe, probe_targets

if TYPE_CHECKING:
    from lopd_core.envs.toolworld.rules import HouseRules

Probe = Callable[[Any, Any], LatentProbe]  # (models, serializer) -> the probe's figures


def house_rules(suite: str) -> HouseRules | None:
    """The suite's house rules (toolworld-rules...), None for a suite without."""
    from lopd_core.envs.toolworld.rules import parse_rules_name

    return parse_rules_name(suite)


def bank_experiences(bank: Any, k: int) -> Experiences:
    """The probe's documents: the top-k successes of one environment for a task, never the task's own."""
    return lambda task, task_id, env_id: [e.document for e in bank.retrieve(task, task_id, k=k, env_id=env_id)]


def latent_probe_for(
    suite_name: str,
    validation_fraction: float,
    difficulties: list[int] | None,
    n: int,
    seed: int,
    bank: Any,
    k: int,
) -> Probe | None:
    """The probe for this suite and bank, its targets drawn once (None without house rules or with n = 0)."""
    rules = house_rules(suite_name)
    if rules is None or n <= 0:
        return None
    suite = open_suite(suite_name, validation_fraction)
    tasks = suite.tasks("validation" if validation_fraction > 0 else "train")
    tasks = [t for t in tasks if difficulties is None or t.difficulty in difficulties]
    targets = probe_targets(suite, tasks, n, seed)
    experiences = bank_experiences(bank, k)
    return lambda models, serializer: latent_probe(models, serializer, rules, targets, experiences)
