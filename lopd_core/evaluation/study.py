"""The study's statistics: arms x seeds on one held-out task set, compared at an equal generation budget.

    row = arm_summary({0: rewards_s0, 1: rewards_s1, 2: rewards_s2}, baseline=vanilla_rewards)
    curve = seed_band([curve_s0, curve_s1, curve_s2], window=5)        # training reward vs generations
    generations_to_reach(curve.x, curve.mean, target=0.6)              # the sample-efficiency figure

Per-task rewards are in [0, 1] (a task's success is reward == 1). Two kinds of 95% interval, as the paper's
readers need both: over tasks (each task's reward averaged over the seeds, Student's t over the tasks: how sure
the score is given this task set) and over seeds (the seeds' mean scores, t with n_seeds - 1 degrees of freedom:
how much a re-run moves it). The paired difference to the baseline (the warm start) is per task, seed-averaged,
with a t interval over tasks: an improvement is claimed only when its lower end is above 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from lopd_core.evaluation.stats import Estimate, mean_interval


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def arm_summary(
    per_seed: Mapping[int | None, Mapping[str, float]], baseline: Mapping[str, float] | None = None
) -> dict[str, Estimate | int | None]:
    """Held-out mean reward and success (0-100) over tasks and over seeds, and the paired difference to
    `baseline` (per-task rewards of the reference model). Only tasks every seed (and the baseline) scored count."""
    if not per_seed:
        raise ValueError("arm_summary needs at least one seed's rewards")
    tasks = set.intersection(*(set(r) for r in per_seed.values()))
    if baseline is not None:
        tasks &= set(baseline)
    if not tasks:
        raise ValueError("no task was scored by every seed (and the baseline)")
    order = sorted(tasks)
    seeds = list(per_seed.values())
    reward = [_mean([s[t] for s in seeds]) for t in order]
    success = [_mean([float(s[t] >= 1.0) for s in seeds]) for t in order]
    out: dict[str, Estimate | int | None] = {
        "n_tasks": len(order),
        "n_seeds": len(seeds),
        "reward_tasks": mean_interval(reward),
        "success_tasks": mean_interval(success),
        "reward_seeds": mean_interval([_mean([s[t] for t in order]) for s in seeds]),
        "success_seeds": mean_interval([_mean([float(s[t] >= 1.0) for t in order]) for s in seeds]),
        "delta_reward": None,
        "delta_success": None,
    }
    if baseline is not None:
        out["delta_reward"] = mean_interval([r - baseline[t] for r, t in zip(reward, order, strict=True)],
                                            bounds=(-1.0, 1.0))  # fmt: skip
        out["delta_success"] = mean_interval(
            [s - float(baseline[t] >= 1.0) for s, t in zip(success, order, strict=True)], bounds=(-1.0, 1.0)
        )
    return out


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` points (the first points average what there is)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


@dataclass
class Band:
    x: list[float]  # cumulative generations (the first seed's; seeds of an arm share the schedule)
    mean: list[float]
    lo: list[float]  # mean - sd over seeds (mean when one seed)
    hi: list[float]

    def to_dict(self) -> dict[str, list[float]]:
        return asdict(self)

    def clipped(self, low: float = 0.0, high: float = 1.0) -> Band:
        """The band as drawn for a quantity that lives in [low, high] (a reward, a success rate): mean +- sd can
        leave that range, the values cannot."""
        return Band(self.x, self.mean, [max(low, v) for v in self.lo], [min(high, v) for v in self.hi])


def seed_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], window: int = 1) -> Band:
    """Mean over seeds of (x, y) curves, each smoothed over `window` steps, with a +-1 sd band; the curves are
    cut to the shortest."""
    if not curves:
        raise ValueError("seed_band needs at least one curve")
    n = min(len(y) for _, y in curves)
    ys = [smooth(list(y)[:n], window) for _, y in curves]
    x = [float(v) for v in list(curves[0][0])[:n]]
    mean = [_mean([y[i] for y in ys]) for i in range(n)]
    if len(ys) > 1:
        sd = [math.sqrt(math.fsum((y[i] - mean[i]) ** 2 for y in ys) / (len(ys) - 1)) for i in range(n)]
    else:
        sd = [0.0] * n
    return Band(x, mean, [m - s for m, s in zip(mean, sd, strict=True)], [m + s for m, s in zip(mean, sd, strict=True)])


def final_value(band: Band, tail: float = 0.1) -> float:
    """The end of a curve: the mean over its last `tail` fraction of points (at least one)."""
    k = max(1, round(tail * len(band.mean)))
    return _mean(band.mean[-k:])


def generations_to_reach(x: Sequence[float], y: Sequence[float], target: float) -> float | None:
    """The first x at which y >= target (None if never)."""
    return next((float(a) for a, b in zip(x, y, strict=True) if b >= target), None)
