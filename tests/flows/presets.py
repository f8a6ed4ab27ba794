"""Overrides of configs/tiny.yaml that make a pipeline run as small as it can be (shared by the flow tests)."""

LEAN = [
    "collect.n_tasks=2",
    "collect.samples_per_task=1",
    "lopd.min_bank_size=0",  # a bank of 2 trajectories is smaller than J=3: allowed here, not by default
    "collect.rollout.max_new_tokens=8",
    "collect.rollout.max_turns=1",
    "cold_start.steps=1",
    "train.schedule.steps=1",
    "train.schedule.tasks_per_step=1",
    "train.rollout.max_new_tokens=8",
    "train.rollout.max_turns=1",
    "evaluate.rollout.max_new_tokens=8",
    "evaluate.rollout.max_turns=1",
    "evaluate.benchmarks=[{name: toolworld, sample: 2}]",
]
