"""Stopping a run safely, with real processes: `lopd run` on the tiny backbone with its stages in child processes,
against a Prefect server of this test session (flows.lifecycle).

* SIGTERM mid-training: the run and its child stage exit within Kubernetes' grace period (30 s), the run says how to
  resume, and a rerun resumes from the checkpoint with every metric step logged once;
* SIGKILL of the parent alone: its child stage is gone within seconds (the parent-death signal);
* a second run on the same run directory is refused while the first lives, and nothing is corrupted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.flows.presets import LEAN

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds
STEPS = 100  # long enough that SIGTERM lands mid-training on a fast machine (40 steps did not, in CI)


@pytest.fixture(scope="module")
def api_url(harness):
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def start(run_dir: Path, api_url: str, *extra: str) -> subprocess.Popen[str]:
    args = [*LEAN, f"run_dir={run_dir}", "methods=[grpo]", "train.schedule.samples_per_task=2",
            f"train.schedule.steps={STEPS}", "train.schedule.checkpoint_every=5", "train.rollout.max_new_tokens=24",
            "execution.mode=subprocess",
            "execution.retry_delay_s=0.2", *extra]  # fmt: skip
    cmd = [sys.executable, "-c", "from flows.cli import app; app()", "run", str(ROOT / "configs" / "tiny.yaml")]
    for item in args:
        cmd += ["-s", item]
    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stage_processes(run_dir: Path) -> list[int]:
    """PIDs of live child stages of this run directory (`python -m flows.stages ... <run_dir>/...`)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if "flows.stages" in cmdline and str(run_dir) in cmdline and "zombie" not in state:
            pids.append(int(entry.name))
    return pids


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen[str] | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {what}:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def checkpoint(run_dir: Path) -> Path | None:
    found = list(run_dir.glob("stages/train/*/**/last/state.json"))
    return found[0] if found else None


def test_sigterm_stops_the_run_and_its_stage_then_a_rerun_resumes_logging_each_step_once(tmp_path, api_url):
    import json

    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    proc = start(run_dir, api_url)
    try:
        wait_for(lambda: checkpoint(run_dir), 300, "the first training checkpoint", proc)
        stages = stage_processes(run_dir)
        assert stages, "the train stage runs in a child process"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=GRACE_S)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM" in out and "run the same command again to resume" in out
    wait_for(lambda: not stage_processes(run_dir), 5, "the child stage to exit")
    print(f"stopped {len(stages)} stage process(es) and the run in {stopped_in:.1f} s")
    assert stopped_in < GRACE_S
    done_at_stop = json.loads(checkpoint(run_dir).read_text())["step"]
    assert 0 < done_at_stop < STEPS

    again = start(run_dir, api_url)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lopd").experiment_id], "tags.stage = 'train'")
    assert len(runs) == 1, "the rerun continues the same MLflow run"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/reward_mean")]
    assert sorted(steps) == list(range(STEPS)), "every step logged exactly once"


def test_a_killed_parent_takes_its_stage_with_it(tmp_path, api_url):
    run_dir = tmp_path / "run"
    proc = start(run_dir, api_url)
    try:
        stages = wait_for(lambda: checkpoint(run_dir) and stage_processes(run_dir), 300, "the train stage", proc)
        proc.kill()  # SIGKILL: no handler runs in the parent
        proc.wait(timeout=10)
        t0 = time.monotonic()
        wait_for(lambda: not stage_processes(run_dir), 10, f"the orphaned stage {stages} to exit")
        print(f"the stage exited {time.monotonic() - t0:.1f} s after its parent was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in stage_processes(run_dir):
            os.kill(pid, signal.SIGKILL)


def test_a_second_run_on_the_same_run_directory_is_refused(tmp_path, api_url):
    run_dir = tmp_path / "run"
    first = start(run_dir, api_url)
    try:
        wait_for(lambda: (run_dir / ".lock").exists() and (run_dir / ".lock").read_text(), 120, "the lock", first)
        second = start(run_dir, api_url)
        out, _ = second.communicate(timeout=120)
        assert second.returncode == 1, out[-3000:]
        assert f"is in use by PID {first.pid}" in out and "one writer per directory" in out
        assert first.poll() is None, "the first run goes on"
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=GRACE_S)
    finally:
        if first.poll() is None:
            first.kill()
    # the lock went with its holder: a new run takes it and finishes from the first one's stages
    third = start(run_dir, api_url)
    out, _ = third.communicate(timeout=600)
    assert third.returncode == 0, out[-3000:]
