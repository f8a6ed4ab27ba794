"""The hierarchical bootstrap (lopd_core.evaluation.hierarchy) against hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lopd_core.evaluation.hierarchy import (
    bootstrap_draws,
    hierarchical_bootstrap,
    minimum_detectable,
    point_estimate,
    tasks_needed,
)


def test_two_clusters_of_one_task_enumerate_by_hand():
    """Clusters {0} and {1}: a draw of two clusters gives the mean 0 (1/4), 0.5 (1/2) or 1 (1/4); the standard error
    is sqrt(1/8) and the 95% percentile interval [0, 1]."""
    design = {"a": {"t1": [0.0]}, "b": {"t2": [1.0]}}
    draws = bootstrap_draws(design, n_boot=20000, seed=1)
    shares = {v: float(np.mean(draws == v)) for v in (0.0, 0.5, 1.0)}
    assert shares[0.0] == pytest.approx(0.25, abs=0.01) and shares[0.5] == pytest.approx(0.5, abs=0.01)
    est, se = hierarchical_bootstrap(design, n_boot=20000, seed=1)
    assert est.value == 0.5 and (est.lo, est.hi) == (0.0, 1.0) and est.n == 2
    assert se == pytest.approx(math.sqrt(1 / 8), rel=0.02)


def test_the_two_stage_variance_formula_of_a_balanced_design():
    """E clusters of n tasks, one seed: Var = S_b / E + S_w / (E n), with population variances (hand formula)."""
    rng = np.random.default_rng(0)
    E, n = 6, 5
    values = rng.normal(0, 1, (E, 1)) + rng.normal(0, 0.5, (E, n))
    design = {f"c{i}": {f"t{j}": [values[i, j]] for j in range(n)} for i in range(E)}
    s_b = values.mean(1).var()  # divisor E
    s_w = values.var(1).mean()  # divisor n, averaged over clusters
    _, se = hierarchical_bootstrap(design, n_boot=20000, seed=2)
    assert se == pytest.approx(math.sqrt(s_b / E + s_w / (E * n)), rel=0.03)
    assert point_estimate(design) == pytest.approx(values.mean())


def test_clustering_widens_the_interval_when_the_effect_is_per_cluster():
    """Tasks of a cluster alike, clusters apart: the cluster bootstrap's interval is wider than treating the 40
    tasks as independent (one cluster each)."""
    clustered = {f"c{i}": {f"t{i}-{j}": [float(i % 2)] for j in range(10)} for i in range(4)}
    flat = {f"t{i}-{j}": {"t": [float(i % 2)]} for i in range(4) for j in range(10)}
    wide, _ = hierarchical_bootstrap(clustered, seed=3)
    narrow, _ = hierarchical_bootstrap(flat, seed=3)
    assert wide.value == narrow.value == 0.5
    assert wide.hi - wide.lo > 2 * (narrow.hi - narrow.lo)


def test_seeds_are_resampled_within_their_task():
    """One cluster, one task, seeds 0 and 1: the task's resampled seed mean is 0, 0.5 or 1 with 1/4, 1/2, 1/4."""
    draws = bootstrap_draws({"c": {"t": [0.0, 1.0]}}, n_boot=20000, seed=4)
    assert float(np.mean(draws == 0.5)) == pytest.approx(0.5, abs=0.01)
    est, _ = hierarchical_bootstrap({"c": {"t": [0.0, 1.0]}}, scale=100)
    assert est.value == 50.0 and est.method == "cluster bootstrap"


def test_minimum_detectable_difference_and_tasks_needed_hand_checked():
    # z_0.975 + z_0.8 = 1.95996 + 0.84162 = 2.80158
    assert minimum_detectable(1.0) == pytest.approx(2.80158, abs=1e-4)
    assert minimum_detectable(2.0, power=0.5) == pytest.approx(2 * 1.95996, abs=1e-4)
    # an MDE of 10 points on 72 tasks: 5 points needs four times the tasks
    se = 10 / minimum_detectable(1.0)
    assert tasks_needed(se, 72, 5.0) == 288


def test_empty_designs_are_refused():
    with pytest.raises(ValueError, match="at least one cluster"):
        hierarchical_bootstrap({})
    with pytest.raises(ValueError, match="at least one seed"):
        hierarchical_bootstrap({"c": {"t": []}})
