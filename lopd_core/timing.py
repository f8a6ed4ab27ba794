"""Where a run's wall time goes: named sections, each counted exclusive of the sections opened inside it.

    from lopd_core.timing import SECTIONS, section

    with section("rollout/generate"):
        ...
    SECTIONS.totals()        # {"rollout/generate": 12.3, ...} seconds, exclusive; their sum is the time inside any
    SECTIONS.reset()

Sections nest: `step/teacher` opened inside `step` counts its own time, and `step` keeps only what its children
did not take, so the totals add up to the wall time spent inside sections, with nothing counted twice. Every stage
writes them beside its result (`timing.json` in the stage's folder, `flows.stages`); `bench/study_profile.py`
adds them up over a study. The cost is two clock reads per section. The totals are per thread: stages that run
in-process side by side (Prefect's thread pool) each count their own.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Sections(threading.local):  # each thread sees its own totals and stack
    def __init__(self) -> None:
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._calls: defaultdict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # per open section: [its start, the time its children took]

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self._seconds[name] += spent - frame[1]
            self._calls[name] += 1
            if self._stack:
                self._stack[-1][1] += spent

    def totals(self) -> dict[str, float]:
        """Seconds per section, exclusive of the sections inside it."""
        return dict(self._seconds)

    def calls(self) -> dict[str, int]:
        return dict(self._calls)

    def reset(self) -> None:
        self._seconds.clear()
        self._calls.clear()


SECTIONS = Sections()
section = SECTIONS.section
