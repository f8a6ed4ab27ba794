"""A tiny study on the positive control, end to end: the warm start and the oracle warm start, the text and latent
teachers scored as policies, the teacher diagnostics in MLflow and in the study's report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_a_tiny_study_on_toolworld_rules_reports_the_oracle_and_the_teachers(tmp_path):
    from mlflow.tracking import MlflowClient

    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": ""}
    overrides = [
        "suite=toolworld-rules", "methods=[grpo, opsd, lopd]", "budget=8", "validation_fraction=0.2",
        "sft={steps: 2, batch_size: 4, pool_per_level: 0, n_demonstrations: 16}", "oracle=true",
        "collect.n_tasks=8", "collect.difficulties=[1]", "train.difficulties=[1]",
        "overrides={grpo: {train.schedule.samples_per_task: 2}}", "evaluate.teacher_eval=true",
        "evaluate.benchmarks=[{name: toolworld-rules, sample: 4, difficulties: [1]}]", "lopd.min_bank_size=0",
    ]  # fmt: skip
    command = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--run-dir",
               str(tmp_path / "run"), *[x for o in overrides for x in ("-s", o)]]  # fmt: skip
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stderr[-4000:]

    (study_file,) = (tmp_path / "run" / "artifacts" / "report").glob("*/report/study.json")
    study = json.loads(study_file.read_text())
    table = study["benchmarks"]["toolworld-rules"]
    assert {"vanilla", "oracle", "grpo", "opsd", "lopd"} <= set(table)  # the ceiling's calibration row
    diagnostics = study["diagnostics"]
    assert set(diagnostics) == {"opsd", "lopd"}  # GRPO has no privileged teacher
    for arm in ("opsd", "lopd"):
        assert "privilege_failure" in diagnostics[arm] and "teacher_success" in diagnostics[arm]
    assert "retrieval_same_env" in diagnostics["lopd"] and "retrieval_same_env" not in diagnostics["opsd"]
    report = study_file.with_name("report.md").read_text()
    assert "oracle warm start (ceiling)" in report and "### Teacher diagnostics" in report

    client = MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("lopd").experiment_id], max_results=100)
    names = {r.info.run_name: r for r in runs}
    opsd = names["opsd s0 · train"].data.metrics
    privilege = {"train/privilege_failure", "train/privilege", "train/privilege_other"}
    assert privilege <= set(opsd)  # the tiny model never succeeds
    evaluated = names["opsd s0 · evaluate"].data.metrics
    assert any(k.startswith("eval/teacher/toolworld-rules/") for k in evaluated)
    assert any(k.startswith("eval/latent/toolworld-rules/") for k in names["lopd s0 · evaluate"].data.metrics)
