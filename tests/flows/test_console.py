"""Log lines and progress bars on one terminal (issue 16): a log line never continues a bar's line."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tqdm import tqdm

from flows.console import logs_above_bars

ROOT = Path(__file__).resolve().parents[2]


def _log_during_a_bar(wrapped: bool) -> str:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("lopd-test-console")
    logger.handlers, logger.propagate = [handler], False
    context = logs_above_bars([logger]) if wrapped else contextlib.nullcontext()
    with context, tqdm(total=3, file=stream, desc="lopd steps", mininterval=0, ascii=True) as bar:
        bar.update(1)
        logger.warning("composer loaded")
        bar.update(2)
    assert logger.handlers == [handler]  # restored after the block
    return stream.getvalue()


def test_a_log_line_clears_the_bar_first_and_the_bar_comes_back():
    text = _log_during_a_bar(wrapped=True)
    (line,) = [part for part in text.split("\n") if "composer loaded" in part]
    assert line.split("\r")[-1] == "WARNING composer loaded"  # on a cleared line of its own
    assert "3/3" in text.split("composer loaded", 1)[1]  # the bar is drawn again below it


def test_without_it_the_line_is_glued_to_the_bar():  # the failure this guards against
    text = _log_during_a_bar(wrapped=False)
    (line,) = [part for part in text.split("\n") if "composer loaded" in part]
    assert line.split("\r")[-1].startswith("lopd steps:")


@pytest.mark.slow
def test_an_unreachable_mlflow_ends_the_run_with_its_message_and_no_traceback(tmp_path):
    """Issue 16: the message, how long it tried, and none of the ~170 traceback lines Prefect and Python print."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": ""}
    command = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir",
               str(tmp_path / "run"), "-s", "tracking_uri=http://127.0.0.1:9", "-s", "execution.retries=1",
               "-s", "execution.retry_delay_s=1"]  # fmt: skip
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: MLflow tracking server at http://127.0.0.1:9 is unreachable" in out.stderr
    assert "retries included" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_a_two_by_two_sweep_names_every_run_by_arm_seed_and_stage(tmp_path):
    """Issue 16: in MLflow's compare view each run of a 2 x 2 sweep says what it is; evaluations carry the seed of
    the model they score (not the task-sampling seed, which is 0 for all of them)."""
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": ""}
    command = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir",
               str(tmp_path / "run"), "-s", "methods=[lopd, grpo]", "-s", "seeds=[0, 1]",
               "-s", "overrides={grpo: {train.schedule.samples_per_task: 2}}"]  # fmt: skip
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lopd").experiment_id], max_results=100)
    names = sorted(r.info.run_name for r in runs if r.info.run_name.endswith(("train", "evaluate")))
    expected = [f"{m} s{s} · {stage}" for m in ("lopd", "grpo") for s in (0, 1) for stage in ("train", "evaluate")]
    assert names == sorted([*expected, "base · evaluate"]), names
    # the stage CLIs read this run directory's results (components.inputs): one collect, two cold starts
    from components.bank import BankSpec
    from components.train import TrainSpec

    dataset = BankSpec(dataset=str(tmp_path / "run")).dataset
    assert dataset.kind == "dataset" and Path(dataset.uri).is_file()
    with pytest.raises(ValueError, match="2 different cold_start results; pass one of these files"):
        TrainSpec(dataset=str(tmp_path / "run"), bank_snapshot=str(tmp_path / "run"), composer=str(tmp_path / "run"))
