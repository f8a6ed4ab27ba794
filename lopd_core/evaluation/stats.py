"""Estimates with 95% intervals, the pass@k estimator, and per-episode records aggregated into metric blocks.

Every score is reported on the paper's 0-100 scale (mean reward x 100, success rate and accuracy in percent,
pass@k in percent) as an `Estimate`: value, interval, n, and the interval's method:

* rates (success rate, BFCL accuracy, pass@1 from one sample per task): the Wilson score interval;
* means of bounded values (mean reward, pass@k from n > 1 samples, averaged over tasks): Student's t interval
  over the per-task values (t quantiles from a table up to 30 degrees of freedom, the normal quantile above);
* means of several independent estimates (the BFCL aggregate: the unweighted mean of its subsets' accuracies;
  task-weighted means across benchmarks): a normal interval whose variance adds the parts' variances, each
  recovered from its interval's half-width (`weighted_mean`).

A rollout that errored (the environment or the verifier broke) counts as reward 0 in evaluation and is
counted in `failed`: evaluation must never look better because episodes crashed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

Z95 = 1.959963984540054
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (standard table values).
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t_quantile_95(df: int) -> float:
    """The two-sided 95% quantile of Student's t with `df` degrees of freedom (normal beyond 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return _T95[df - 1] if df <= len(_T95) else Z95


@dataclass(frozen=True)
class Estimate:
    """A score with its 95% interval, all on the same scale (0-100 for scores)."""

    value: float
    lo: float
    hi: float
    n: int
    method: str  # "wilson" | "t" | "normal" | "none"

    def __post_init__(self) -> None:  # 4 decimals: stable JSON, no 99.99999999999999
        for name in ("value", "lo", "hi"):
            object.__setattr__(self, name, round(float(getattr(self, name)), 4))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Estimate:
        return cls(**data)

    def format(self, digits: int = 1, interval: bool = True) -> str:
        text = f"{self.value:.{digits}f}"
        return f"{text} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]" if interval and self.n > 0 else text


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def wilson(successes: int, n: int, scale: float = 100.0) -> Estimate:
    """Wilson score interval for a binomial rate (successes of n), scaled (default: percent)."""
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return Estimate(0.0, 0.0, 0.0, 0, "none")
    p = successes / n
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    lo, hi = _clip(centre - half, 0.0, 1.0), _clip(centre + half, 0.0, 1.0)
    return Estimate(p * scale, lo * scale, hi * scale, n, "wilson")


def mean_interval(values: Sequence[float], scale: float = 100.0, bounds: tuple[float, float] = (0.0, 1.0)) -> Estimate:
    """Mean of `values` with a Student's t interval (clipped to `bounds`), scaled (default: percent)."""
    n = len(values)
    if n == 0:
        return Estimate(0.0, 0.0, 0.0, 0, "none")
    mean = math.fsum(values) / n
    if n == 1:
        return Estimate(mean * scale, mean * scale, mean * scale, 1, "t")
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = t_quantile_95(n - 1) * math.sqrt(var / n)
    lo, hi = _clip(mean - half, *bounds), _clip(mean + half, *bounds)
    return Estimate(mean * scale, lo * scale, hi * scale, n, "t")


def weighted_mean(parts: Sequence[Estimate], weights: Sequence[float] | None = None) -> Estimate:
    """A weighted mean of independent estimates (default weights: their n, i.e. task-weighted).

    The interval is normal with the parts' variances recovered from their half-widths (each part's interval
    taken as +-1.96 standard errors); with equal weights it is the mean over subsets (the BFCL aggregate).
    """
    parts = [p for p in parts if p.n > 0]
    if not parts:
        return Estimate(0.0, 0.0, 0.0, 0, "none")
    w = [float(p.n) for p in parts] if weights is None else [float(x) for x in weights]
    if len(w) != len(parts) or sum(w) <= 0:
        raise ValueError("weights must match the parts and sum to a positive number")
    total = sum(w)
    value = math.fsum(wi * p.value for wi, p in zip(w, parts, strict=True)) / total
    var = math.fsum((wi / total) ** 2 * ((p.hi - p.lo) / (2 * Z95)) ** 2 for wi, p in zip(w, parts, strict=True))
    half = Z95 * math.sqrt(var)
    return Estimate(value, max(value - half, 0.0), min(value + half, 100.0), sum(p.n for p in parts), "normal")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task from n samples of which c pass: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    # prod_{i=n-c+1}^{n} (1 - k / i), numerically stable
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# ------------------------------------------------------------------------------------------ episode records


@dataclass
class EpisodeRecord:
    """One evaluated episode, flat and JSON-able (the unit every aggregate is computed from)."""

    benchmark: str
    task_id: str
    reward: float  # [0, 1]; 0 for a failed rollout
    success: bool  # reward == 1
    subset: str = ""  # BFCL subset, LiveCodeBench platform, ...
    env_id: str = ""
    difficulty: int | None = None
    sample: int = 0  # sample index (pass@k draws several per task)
    n_steps: int = 0  # assistant turns
    n_calls: int = 0  # tool calls executed
    n_errors: int = 0  # error observations (parse errors, unknown tools, bad arguments, tool errors)
    finish_reason: str = ""
    failed: bool = False  # the rollout errored (counted as reward 0)
    error: str | None = None
    # under a house rule (toolworld-rules): its state-changing calls, whether all carried the right code, and the
    # reward the episode's other checks gave (what it scores with the rule set aside); None without a house rule
    rule_calls: int | None = None
    rule_passed: bool | None = None
    reward_without_rule: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EpisodeRecord:
        return cls(**data)


def behaviour(records: Sequence[EpisodeRecord]) -> dict[str, Any]:
    """Tab. 3 statistics: steps per task, tool calls per step (total calls / total steps), errors per episode."""
    n = len(records)
    steps = sum(r.n_steps for r in records)
    calls = sum(r.n_calls for r in records)
    return {
        "episodes": n,
        "steps_per_task": round(steps / n, 4) if n else 0.0,
        "calls_per_step": round(calls / steps, 4) if steps else 0.0,
        "calls_per_task": round(calls / n, 4) if n else 0.0,
        "errors_per_episode": round(sum(r.n_errors for r in records) / n, 4) if n else 0.0,
        "failed": sum(r.failed for r in records),
        "finish_reasons": dict(sorted(Counter(r.finish_reason for r in records).items())),
    }


def score_block(records: Sequence[EpisodeRecord]) -> dict[str, Any]:
    """Mean reward (t interval) and success rate (Wilson) in percent, plus the behaviour statistics."""
    rewards = [0.0 if r.failed else float(r.reward) for r in records]
    successes = sum(1 for r in records if r.success and not r.failed)
    out = {
        "n": len(records),
        "mean_reward": mean_interval(rewards).to_dict(),
        "success_rate": wilson(successes, len(records)).to_dict(),
        **behaviour(records),
    }
    ruled = [r for r in records if r.rule_calls]  # episodes that made at least one state-changing call
    if ruled:  # the house rule measured directly: the right code on every such call (Wilson)
        out["rule_pass_rate"] = wilson(sum(1 for r in ruled if r.rule_passed), len(ruled)).to_dict()
    return out


def pass_block(records: Sequence[EpisodeRecord], ks: Iterable[int] = (1,)) -> dict[str, Any]:
    """pass@k per k over tasks (records grouped by task_id, each sample a record), in percent.

    One sample per task: pass@1 is a rate with a Wilson interval. Several: the unbiased estimator per task,
    averaged, with a t interval over tasks. A k above the samples per task is left out.
    """
    by_task: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        by_task.setdefault(r.task_id, []).append(r)
    counts = [(len(rs), sum(1 for r in rs if r.success and not r.failed)) for rs in by_task.values()]
    out: dict[str, Any] = {"tasks": len(counts), "samples_per_task": min((n for n, _ in counts), default=0)}
    for k in sorted(set(ks)):
        if not counts or k > out["samples_per_task"]:
            continue
        if out["samples_per_task"] == 1 and all(n == 1 for n, _ in counts):
            est = wilson(sum(c for _, c in counts), len(counts))
        else:
            est = mean_interval([pass_at_k(n, c, k) for n, c in counts])
        out[f"pass@{k}"] = est.to_dict()
    return out


def group_by(records: Sequence[EpisodeRecord], key: str) -> dict[str, list[EpisodeRecord]]:
    """Records grouped by an attribute (difficulty levels as strings, missing as '?'), in sorted key order."""
    groups: dict[str, list[EpisodeRecord]] = {}
    for r in records:
        value = getattr(r, key)
        groups.setdefault("?" if value in (None, "") else str(value), []).append(r)

    def order(item: tuple[str, list[EpisodeRecord]]) -> tuple[int, int, str]:
        name = item[0]
        return (0, int(name), "") if name.isdigit() else (1, 0, name)

    return dict(sorted(groups.items(), key=order))
