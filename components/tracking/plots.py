"""Curves: training metrics against steps or generations, one panel per metric group."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from components.tracking.names import DEFAULT_PANELS, MARGIN_TARGET, CurveX, train_metric
from components.tracking.query import RunSeries, _load_series
from components.tracking.store import RetryPolicy, connect
from lopd_core.evaluation.study import Band, seed_band

logger = logging.getLogger(__name__)

_LINESTYLES = ("-", "--", ":", "-.")
UNIT_INTERVAL = (train_metric("reward_mean"), train_metric("success_rate"))  # in [0, 1]: +-1 sd bands clipped there


@dataclass
class SeedMean:
    """The runs of one arm over several seeds: each metric's mean curve with a +-1 sd band (`seed_band`)."""

    label: str
    runs: list[RunSeries]

    def band(self, key: str, x: CurveX) -> Band | None:
        curves = [c for c in (s.xy(key, x) for s in self.runs) if c[0]]
        return seed_band(curves) if curves else None

    def xy(self, key: str, x: CurveX) -> tuple[list[float], list[float]]:
        band = self.band(key, x)
        return (band.x, band.mean) if band else ([], [])


def by_arm(series: Sequence[RunSeries]) -> list[RunSeries | SeedMean]:
    """Runs whose labels differ only in `seed=N` become one SeedMean (in first-seen order); a lone run stays."""
    arms: dict[str, list[RunSeries]] = {}
    for s in series:
        arms.setdefault(re.sub(r"\s*\bseed=\S+", "", s.label).strip() or s.label, []).append(s)
    return [
        runs[0] if len(runs) == 1 else SeedMean(f"{arm} (mean ± sd, {len(runs)} seeds)", runs)
        for arm, runs in arms.items()
    ]


def render_curves(
    series: Sequence[RunSeries | SeedMean],
    panels: Sequence[Sequence[str]],
    x: CurveX,
    out: Path,
    *,
    title: str | None = None,
    budget: float | None = None,
) -> Path:
    """One panel per group of metrics, stacked on a shared x axis (step, or cumulative generations), written as PNG.

    One run: a colour per metric. Several runs: a colour per run, a line style per metric of the panel. A SeedMean
    is drawn as its mean with a shaded +-1 sd band.
    The margin target m (`train/margin_target`, a metric of LOPD runs) is dashed, labelled "target m"; `budget`
    draws a labelled vertical line (generations). The bands of rewards and success rates are clipped to [0, 1].
    """
    if x not in ("step", "generations"):
        raise ValueError(f"x must be 'step' or 'generations', got {x!r}")
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend (Agg canvas)

    fig = Figure(figsize=(8.0, 2.4 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    colors = [f"C{i % 10}" for i in range(max(len(series), max(len(p) for p in panels)))]
    for ax, keys in zip(axes, panels, strict=True):
        drawn = False
        for i, s in enumerate(series):
            for j, key in enumerate(keys):
                xs, ys = s.xy(key, x)
                if not xs:
                    continue
                name = "target m" if key == MARGIN_TARGET else key.rsplit("/", 1)[-1]
                if len(series) == 1:
                    color, style, label = colors[j], "--" if key == MARGIN_TARGET else "-", name
                else:
                    color, style = colors[i], "--" if key == MARGIN_TARGET else _LINESTYLES[j % len(_LINESTYLES)]
                    label = s.label if len(keys) == 1 else f"{s.label}: {name}"
                ax.plot(xs, ys, color=color, linestyle=style, marker="." if len(xs) <= 50 else None, label=label)
                band = s.band(key, x) if isinstance(s, SeedMean) else None
                if band is not None and key in UNIT_INTERVAL:
                    band = band.clipped()
                if band is not None:
                    ax.fill_between(band.x, band.lo, band.hi, color=color, alpha=0.15, linewidth=0)
                drawn = True
        if budget is not None and x == "generations":
            ax.axvline(budget, color="gray", linestyle=":", linewidth=1, label=f"equal budget ({budget:g} generations)")
        ax.set_ylabel(" / ".join(k.rsplit("/", 1)[-1] for k in keys if k != MARGIN_TARGET))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small", loc="best")
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")
    axes[-1].set_xlabel("cumulative generations (rollout budget)" if x == "generations" else "step")
    if title:
        fig.suptitle(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def plot_runs(
    tracking_uri: str,
    run_ids: Sequence[str],
    out: str | Path,
    *,
    panels: Sequence[Sequence[str]] = DEFAULT_PANELS,
    x: CurveX = "generations",
    labels: Mapping[str, str] | None = None,
    budget: float | None = None,
    title: str | None = None,
    retry: RetryPolicy | None = None,
    seed_mean: bool = True,
) -> Path:
    """Per-step curves of several runs on shared axes (x = cumulative generations or step) as a PNG at `out`.

    Labels default to "<method> seed=<seed> <benchmark>" from the run tags; `budget` marks the equal-budget line.
    With `seed_mean`, the seeds of an arm are drawn as their mean with a +-1 sd band (`by_arm`), not a line each.
    """
    retry = retry or RetryPolicy()
    client = connect(tracking_uri, retry)
    series = [_load_series(client, rid, panels, retry, tracking_uri, (labels or {}).get(rid)) for rid in run_ids]
    return render_curves(by_arm(series) if seed_mean else series, panels, x, Path(out), title=title, budget=budget)
