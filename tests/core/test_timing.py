"""Timing sections (lopd_core.timing) count each section's time exclusive of the sections inside it, and
bench/study_profile.py adds the stages' timing files up into its categories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lopd_core import timing
from lopd_core.timing import Sections


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_nested_sections_are_exclusive(clock: list[float]) -> None:
    s = Sections()
    with s.section("step"):  # 0 .. 10: 3 s inside "teacher", 2 s inside "student" (twice), 5 s its own
        clock[0] += 1
        with s.section("teacher"):
            clock[0] += 3
        with s.section("student"):
            clock[0] += 1
        with s.section("student"):
            clock[0] += 1
        clock[0] += 4
    with s.section("step"):  # another 2 s of its own
        clock[0] += 2
    assert s.totals() == {"teacher": 3.0, "student": 2.0, "step": 7.0}
    assert s.calls() == {"teacher": 1, "student": 2, "step": 2}
    assert sum(s.totals().values()) == clock[0]  # nothing counted twice
    s.reset()
    assert s.totals() == {}


def test_each_thread_counts_its_own_sections(clock: list[float]) -> None:
    """Stages run in-process side by side on Prefect's threads: one stage's sections (and its reset) must not
    reach another's totals or stack."""
    import threading

    s = Sections()
    inside, resume = threading.Event(), threading.Event()
    seen = {}

    def other() -> None:
        with s.section("other"):
            inside.set()
            resume.wait()
        seen.update(s.totals())

    with s.section("mine"):
        thread = threading.Thread(target=other)
        thread.start()
        inside.wait()  # the other thread's section is open while this one's is
        clock[0] += 3
        s.reset()  # another stage starting: only its own totals go
        resume.set()
        thread.join()
    assert s.totals() == {"mine": 3.0}
    assert seen == {"other": 3.0}


def test_a_section_counts_when_its_body_raises(clock: list[float]) -> None:
    s = Sections()
    with pytest.raises(RuntimeError), s.section("outer"), s.section("inner"):
        clock[0] += 2
        raise RuntimeError
    assert s.totals() == {"inner": 2.0, "outer": 0.0}


def _bench():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[2] / "bench" / "study_profile.py"
    spec = importlib.util.spec_from_file_location("study_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_study_profile_adds_up_the_stages(tmp_path: Path) -> None:
    def write(folder: str, doc: dict) -> None:
        (tmp_path / "stages" / folder).mkdir(parents=True)
        (tmp_path / "stages" / folder / "timing.json").write_text(json.dumps(doc))

    write("sft/a", {"stage": "sft", "stage_s": 50.0, "process_s": 56.0, "sections": {"stage/load": 1.0}})
    write(
        "train/b",
        {
            "stage": "train",
            "stage_s": 100.0,
            "process_s": 104.0,
            "sections": {
                "rollout/generate": 40.0,
                "rollout/environment": 10.0,
                "rollout": 5.0,
                "step/teacher": 8.0,
                "step/student": 6.0,
                "step/backward": 12.0,
                "stage/tracking": 2.0,
                "stage/cache": 1.0,
            },
        },
    )
    write("evaluate/c", {"stage": "evaluate", "stage_s": 30.0, "sections": {"rollout/generate": 20.0}})
    result = _bench().profile(tmp_path, wall_s=200.0)
    cats = result["categories_s"]
    assert cats["rollout generate (train)"] == 40.0
    assert cats["environment and sandbox (train)"] == 10.0
    assert cats["teacher forward"] == 8.0 and cats["student forward"] == 6.0 and cats["backward"] == 12.0
    assert cats["evaluation"] == 30.0  # its sections and the rest of the stage
    assert cats["warm start (sft)"] == 49.0
    assert cats["train other"] == 100.0 - 84.0
    assert cats["stage start-up"] == 1.0 + 6.0 + 4.0  # the load, and what the processes took beyond the stages
    assert cats["stage cache and tracking"] == 3.0
    assert cats["orchestration (Prefect, the flow)"] == 200.0 - 56.0 - 104.0 - 30.0
    assert sum(cats.values()) == pytest.approx(200.0)
    assert result["share"]["rollout generate (train)"] == 0.2


def test_study_profile_with_stages_side_by_side(tmp_path: Path) -> None:
    for folder, seconds in (("train/a", 100.0), ("train/b", 80.0)):
        (tmp_path / "stages" / folder).mkdir(parents=True)
        doc = {"stage": "train", "stage_s": seconds, "process_s": seconds + 5, "sections": {"step/backward": 50.0}}
        (tmp_path / "stages" / folder / "timing.json").write_text(json.dumps(doc))
    result = _bench().profile(tmp_path, wall_s=120.0)  # 190 s of stages in 120 s: they overlapped
    assert result["stages_overlapped"] is True
    assert "orchestration (Prefect, the flow)" not in result["categories_s"]
    assert result["categories_s"]["backward"] == 100.0
    assert sum(result["share"].values()) == pytest.approx(1.0, abs=1e-3)  # shares of the stages' summed time
