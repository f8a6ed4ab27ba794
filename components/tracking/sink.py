"""The per-step metrics sink: batched `log_batch` of a train step's metrics, non-finite values counted, never
stopping training because of a metric value."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from mlflow.entities import Metric

from components.tracking.names import NONFINITE_METRICS, namespaced
from components.tracking.values import _now_ms, valid_metric_key

if TYPE_CHECKING:
    from components.tracking.run import TrackedRun


logger = logging.getLogger(__name__)


def _warn_once(warned: set[str], key: str, message: str, *args: Any) -> None:
    if key not in warned:
        warned.add(key)
        logger.warning(message, *args)


def _metric_points(
    metrics: Mapping[str, Any], step: int, ts: int, warned: set[str], namespace: str | None = None
) -> tuple[list[Metric], list[str]]:
    """Finite numeric values as MLflow metrics, named in `namespace` (`train/margin`); also the names of the
    non-finite ones (not logged)."""
    points: list[Metric] = []
    nonfinite: list[str] = []
    for bare, raw in metrics.items():
        key = namespaced(namespace, bare)
        if not valid_metric_key(key):
            _warn_once(warned, f"key:{key}", "metric name %r is not valid for MLflow; not logged", key)
            continue
        try:
            value = float(raw)
        except (TypeError, ValueError):
            _warn_once(warned, f"type:{key}", "metric %r has a non-numeric value %r; not logged", key, raw)
            continue
        if not math.isfinite(value):
            nonfinite.append(key)
            _warn_once(
                warned,
                f"nonfinite:{key}",
                "metric %r is %s at step %d; not logged (counted in %s)",
                key,
                value,
                step,
                NONFINITE_METRICS,
            )
            continue
        points.append(Metric(key, value, ts, step))
    return points, nonfinite


class MlflowMetricsSink:
    """`lopd_core.step.MetricsSink` over one MLflow run; create it with `TrackedRun.metrics_sink()`.

    Each `log(step, metrics)` adds the finite values plus `generations_cum` (running sum of `generations`) and,
    when some values were non-finite, `nonfinite_metrics`. Points are buffered and sent with `log_batch`.
    """

    def __init__(
        self,
        run: TrackedRun,
        cum_by_step: Mapping[int, float],
        flush_every: int,
        flush_seconds: float,
        logged: Mapping[str, set[int]] | None = None,
    ) -> None:
        self.run = run
        self._logged = {key: set(steps) for key, steps in (logged or {}).items()}
        self.flush_every = max(1, flush_every)
        self.flush_seconds = flush_seconds
        self._cum = dict(cum_by_step)
        self.last_step = max(self._cum, default=-1)
        self._resumed_at = self.last_step + 1
        self._buffer: list[Metric] = []
        self._buffered_steps = 0
        self._last_flush = time.monotonic()
        self._warned: set[str] = set()
        self._new_nonfinite: set[str] = set()

    @property
    def generations(self) -> float:
        """Generations spent up to the last logged step."""
        return self._cum.get(self.last_step, 0.0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        step = int(step)
        ts = _now_ms()
        ns = self.run.namespace
        points, nonfinite = _metric_points(metrics, step, ts, self._warned, ns)
        try:
            generations = float(metrics.get("generations", 0.0))
        except (TypeError, ValueError):
            generations = 0.0
        if not math.isfinite(generations):
            generations = 0.0
        if step > self.last_step:
            before = self._cum.get(self.last_step, 0.0)
        else:  # a replayed step (resumed from an earlier checkpoint): continue from the step before it
            before = max(((s, c) for s, c in self._cum.items() if s < step), default=(-1, 0.0))[1]
        self._cum[step] = before + generations
        self.last_step = max(self.last_step, step)
        points.append(Metric(self.run.cum_key, self._cum[step], ts, step))
        if nonfinite:
            points.append(Metric(namespaced(ns, NONFINITE_METRICS), float(len(nonfinite)), ts, step))
            self._new_nonfinite.update(nonfinite)
        if step < self._resumed_at:  # a replayed step (resumed from an earlier checkpoint): every step once
            kept = [p for p in points if step not in self._logged.get(p.key, ())]
            if len(kept) < len(points):
                logger.info(
                    "run %s: step %d is already in the tracking store (logged before the restart); its %d "
                    "stored values are kept and not logged again",
                    self.run.run_id,
                    step,
                    len(points) - len(kept),
                )
            points = kept
        self._buffer.extend(points)
        self._buffered_steps += 1
        if self._buffered_steps >= self.flush_every or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Send the buffered points (kept for the next flush if sending fails)."""
        if self._buffer:
            batch, self._buffer = self._buffer, []
            try:
                self.run._log_points(batch)
            except Exception:
                self._buffer = batch + self._buffer
                raise
        self._buffered_steps = 0
        self._last_flush = time.monotonic()
        if self._new_nonfinite:
            keys, self._new_nonfinite = set(self._new_nonfinite), set()
            self.run._add_nonfinite_keys(keys)

    def close(self) -> None:
        self.flush()
