"""Intervals that respect the study's design, and the difference it can detect.

A house rule belongs to an environment (and to a rule draw): the tasks of one environment share it, so they are not
independent draws, and an interval over tasks alone is too narrow when the effect is per environment. The
hierarchical (cluster) bootstrap resamples the design's levels in turn:

    clusters (environments, or (draw, environment) pairs) with replacement
      -> within each drawn cluster, its tasks with replacement
        -> within each drawn task, its seeds with replacement

and recomputes the statistic, the mean over the drawn tasks of their seed means (the same per-task weighting as the
t interval over tasks). The 95% interval is the bootstrap distribution's 2.5% and 97.5% percentiles. For a paired
difference, pass each (task, seed)'s difference: arm minus reference on the same task and seed (or the reference's
seed mean when the reference has one run, like the warm start).

    est, se = hierarchical_bootstrap({"bank": {"t1": [0.0, 1.0], "t2": [1.0, 1.0]}, "shop": {...}}, scale=100)
    mde = minimum_detectable(se)          # the difference a paired test at 5% finds with 80% power: 2.80 x SE

The bootstrap's standard error, with one seed and E clusters of n tasks each, is sqrt(S_b / E + S_w / (E n)), S_b the
variance of the cluster means and S_w the mean within-cluster variance (both with divisor E and n): tested.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from statistics import NormalDist

import numpy as np

from lopd_core.evaluation.stats import Estimate

Design = Mapping[str, Mapping[str, Sequence[float]]]  # cluster -> task -> per-seed values


def _check(design: Design) -> list[list[np.ndarray]]:
    clusters = [[np.asarray(list(seeds), dtype=float) for seeds in tasks.values()] for tasks in design.values()]
    clusters = [c for c in clusters if c]
    if not clusters:
        raise ValueError("the bootstrap needs at least one cluster with one task")
    if any(len(seeds) == 0 for c in clusters for seeds in c):
        raise ValueError("every task needs at least one seed's value")
    return clusters


def point_estimate(design: Design) -> float:
    """The mean over tasks of each task's seed mean."""
    clusters = _check(design)
    return float(np.mean([seeds.mean() for c in clusters for seeds in c]))


def bootstrap_draws(design: Design, n_boot: int = 4000, seed: int = 0) -> np.ndarray:
    """`n_boot` draws of the statistic under the hierarchical resampling (module docstring)."""
    clusters = _check(design)
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot)
    n_clusters = len(clusters)
    for b in range(n_boot):
        total, count = 0.0, 0
        for ci in rng.integers(0, n_clusters, n_clusters):
            tasks = clusters[ci]
            for ti in rng.integers(0, len(tasks), len(tasks)):
                seeds = tasks[ti]
                total += seeds[rng.integers(0, len(seeds), len(seeds))].mean() if len(seeds) > 1 else seeds[0]
                count += 1
        out[b] = total / count
    return out


def hierarchical_bootstrap(
    design: Design, level: float = 0.95, n_boot: int = 4000, seed: int = 0, scale: float = 1.0
) -> tuple[Estimate, float]:
    """(the point estimate with the hierarchical bootstrap's percentile interval, the bootstrap standard error),
    both times `scale` (100: points); the estimate's `n` is the number of tasks."""
    draws = bootstrap_draws(design, n_boot, seed) * scale
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    n = sum(len(tasks) for tasks in design.values())
    return Estimate(point_estimate(design) * scale, float(low), float(high), n, "cluster bootstrap"), float(draws.std())


def minimum_detectable(se: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true difference a two-sided test at `alpha` detects with probability `power`, given the
    standard error of the estimated difference: (z_{1-alpha/2} + z_power) x se (2.80 x se at 5% and 80%)."""
    z = NormalDist()
    return (z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * se


def tasks_needed(se: float, n_tasks: int, target: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Tasks that would bring the minimum detectable difference down to `target` (the standard error falls as
    1/sqrt(tasks) when the design grows in the same proportions)."""
    mde = minimum_detectable(se, alpha, power)
    return math.ceil(n_tasks * (mde / target) ** 2)
