"""Child stages share the machine's cores (`execution.max_parallel`) by their threads: flows.stages.Slots."""

from __future__ import annotations

import threading
import time

import pytest
from pydantic import BaseModel

from flows.stages import Slots


class _Spec(BaseModel):
    threads: int = 1
    nproc: int = 1


def _concurrency(slots: Slots, units: list[int], hold_s: float = 0.15) -> int:
    """Run one thread per entry of `units`, each holding its units for `hold_s`; the most held at once."""
    lock, now, most = threading.Lock(), [0], [0]

    def job(n: int) -> None:
        with slots.take(n):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            time.sleep(hold_s)
            with lock:
                now[0] -= 1

    threads = [threading.Thread(target=job, args=(n,)) for n in units]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert slots.free == slots.capacity
    return most[0]


def test_one_thread_stages_run_side_by_side():
    slots = Slots(2)
    barrier = threading.Barrier(2, timeout=5)  # passes only when both stages hold their slot at the same time

    def job() -> None:
        with slots.take(1):
            barrier.wait()

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not barrier.broken
    assert slots.free == 2


def test_two_thread_stages_on_two_cores_run_one_at_a_time():
    """Three cold starts with warm_threads 2 and max_parallel 2: never four threads on two cores."""
    assert _concurrency(Slots(2), [2, 2, 2]) == 1
    assert _concurrency(Slots(4), [2, 2, 2]) == 2
    assert _concurrency(Slots(2), [1, 1, 1, 1]) == 2


def test_a_stage_wider_than_the_machine_still_runs_alone():
    assert _concurrency(Slots(1), [2, 1]) == 1  # units are capped at the capacity: no deadlock


@pytest.mark.parametrize(("threads", "nproc", "units"), [(1, 1, 1), (2, 1, 2), (2, 2, 4), (1, 3, 3)])
def test_units_are_threads_times_ranks(threads, nproc, units):
    assert Slots.units_of(_Spec(threads=threads, nproc=nproc)) == units


def test_a_spec_without_threads_takes_one_unit():
    class Bare(BaseModel):
        name: str = "report"

    assert Slots.units_of(Bare()) == 1
