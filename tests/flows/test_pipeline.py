"""The lopd-pipeline DAG on the tiny backbone under prefect_test_harness (a real, temporary Prefect API).

One pipeline directory goes through: a first run (every stage runs; MLflow runs carry the Prefect flow run id;
the flow run gets its report artifacts), a re-run (every stage from the cache), a lost live bank (restored from
its snapshot: still cached), a changed training parameter (training, its evaluation and the report re-run; the
rest is cached), bank growth (bank-watch announces it once; the bank stage takes a new snapshot and everything
reading the bank re-runs, collect stays cached), and an unreachable MLflow server (the transient failure is
retried with back-off, then the flow fails). The tiny random model never succeeds: the bank takes every
trajectory (success_threshold 0).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.presets import LEAN as PRESET_LEAN

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

LEAN = [
    *PRESET_LEAN,
    "execution.retry_delay_s=0.2",
]


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


def config(run_dir: Path, *extra: str):
    from flows.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", [*LEAN, f"run_dir={run_dir}", *extra])


def ran(summary: dict) -> list[str]:
    return [s["label"] for s in summary["stages"] if not s["cached"]]


def cached(summary: dict) -> list[str]:
    return [s["label"] for s in summary["stages"] if s["cached"]]


@pytest.fixture(scope="module")
def first(harness, pipe_dir):
    from flows.pipeline import lopd_pipeline

    t0 = time.perf_counter()
    summary = lopd_pipeline(config=config(pipe_dir))
    return summary, time.perf_counter() - t0


def test_first_run_runs_every_stage_and_links_prefect_and_mlflow(first, pipe_dir):
    summary, _ = first
    assert ran(summary) == [
        "collect",
        "bank",
        "cold-start seed 0",
        "train lopd seed 0",
        "evaluate base",
        "evaluate lopd seed 0",
        "report",
    ]
    client = MlflowClient(f"sqlite:///{pipe_dir}/mlflow.db")
    pipe = client.get_run(summary["pipeline_run_id"])
    assert pipe.data.tags["prefect.flow_run_id"] == summary["flow_run_id"]
    assert pipe.data.tags["lopd.cached_stages"] == "0/7" and pipe.info.status == "FINISHED"
    for stage in summary["stages"]:
        run = client.get_run(stage["mlflow_run_id"])
        assert run.data.tags["prefect.flow_run_id"] == summary["flow_run_id"], stage
        if stage["stage"] != "report":
            assert run.data.tags["pipeline_run_id"] == summary["pipeline_run_id"], stage
    metrics = pipe.data.metrics  # what the compare view plots, on the top-level run
    assert {"lopd/eval/toolworld", "base/eval/toolworld", "lopd/train/generations"} <= set(metrics)
    assert {"lopd/train/margin", "lopd/train/beta"} <= set(metrics)
    assert "backbone" in pipe.data.params and "lopd.top_m" in pipe.data.params
    assert not [k for k in pipe.data.params if "metadata" in k or k.startswith("execution.")]
    artifacts = {a.path for a in client.list_artifacts(summary["pipeline_run_id"], "report")}
    assert {"report/report.md", "report/curves_generations.png"} <= artifacts
    assert "| lopd seed 0 | lopd | 0 |" in summary["evaluation"] and "toolworld" in summary["evaluation"]
    assert json.loads((pipe_dir / "trained.json").read_text())["bank_version"] == 1
    assert (pipe_dir / "pipeline.yaml").exists()


def test_flow_run_has_report_artifacts(first):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    summary, _ = first

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[summary["flow_run_id"]]))
            )

    import asyncio

    artifacts = {a.key: a for a in asyncio.run(read())}
    assert {"lopd-report", "lopd-evaluation"} <= set(artifacts)
    assert (
        "## Evaluation" in artifacts["lopd-report"].data and summary["pipeline_run_id"] in artifacts["lopd-report"].data
    )
    from tests.flows.test_report_artifact import IMAGE, loadable

    report = artifacts["lopd-report"].data
    assert IMAGE.findall(report) and not loadable(report) and "file://" not in report  # figures load in the UI


def test_rerun_takes_everything_from_the_cache(first, pipe_dir):
    from flows.pipeline import lopd_pipeline

    _, first_s = first
    t0 = time.perf_counter()
    again = lopd_pipeline(config=config(pipe_dir))
    rerun_s = time.perf_counter() - t0
    assert ran(again) == []
    assert rerun_s < 0.25 * first_s, (rerun_s, first_s)  # the bench measures the 5% goal; CI machines are noisy
    assert "| lopd seed 0 | lopd | 0 |" in again["evaluation"]


def test_a_lost_bank_comes_back_from_its_snapshot(first, pipe_dir):
    from flows.pipeline import lopd_pipeline
    from flows.stages import bank_version

    shutil.rmtree(pipe_dir / "bank")  # e.g. a fresh pod: the live bank is gone, its snapshot is in the store
    again = lopd_pipeline(config=config(pipe_dir))
    assert ran(again) == []
    assert bank_version(str(pipe_dir / "bank"), "experience") == 1


def test_changed_parameter_reruns_only_downstream(first, pipe_dir):
    from flows.pipeline import lopd_pipeline

    changed = lopd_pipeline(config=config(pipe_dir, "train.schedule.steps=2"))
    assert ran(changed) == ["train lopd seed 0", "evaluate lopd seed 0", "report"]
    assert cached(changed) == ["collect", "bank", "cold-start seed 0", "evaluate base"]


def test_bank_growth_is_announced_once_and_retrains_what_reads_the_bank(first, pipe_dir):
    from flows.pipeline import lopd_pipeline
    from flows.retrain import bank_watch, lopd_retrain
    from lopd_core.conversation import Message, Trajectory

    assert bank_watch(run_dir=str(pipe_dir), min_growth=1)["status"] == "waiting"
    with pytest.raises(ValueError, match=r"run_dir=.*no trained pipeline there"):  # nothing to watch: a failure
        bank_watch(run_dir=str(pipe_dir / "nothing-here"))
    grown = pipe_dir / "grown.jsonl"
    with grown.open("w") as fh:
        for i in range(3):
            t = Trajectory(
                f"extra-{i}",
                "toolworld_bank",
                f"Extra task {i}",
                [Message("user", f"Extra task {i}"), Message("assistant", "done")],
                reward=1.0,
                trace=f"Action: done {i}",
            )
            fh.write(t.to_json() + "\n")
    from components.memory import ExperienceBank, experiences_from_jsonl

    with grown.open() as fh, ExperienceBank.open(str(pipe_dir / "bank"), "experience") as b:
        assert b.ingest(experiences_from_jsonl(fh, 0.0)[0]).added == 3
    announced = bank_watch(run_dir=str(pipe_dir), min_growth=3)
    assert announced["status"] == "emitted" and announced["grown"] == 3 and announced["event_id"]
    assert bank_watch(run_dir=str(pipe_dir), min_growth=3)["status"] == "pending"  # debounced
    out = lopd_retrain(run_dir=str(pipe_dir), bank_version=announced["version"])
    assert out["status"] == "retrained"
    summary = out["pipeline"]
    assert cached(summary) == ["collect", "evaluate base"]
    assert ran(summary) == ["bank", "cold-start seed 0", "train lopd seed 0", "evaluate lopd seed 0", "report"]
    assert json.loads((pipe_dir / "trained.json").read_text())["bank_version"] == announced["version"]
    assert bank_watch(run_dir=str(pipe_dir), min_growth=1)["status"] == "waiting"
    assert lopd_retrain(run_dir=str(pipe_dir))["status"] == "up-to-date"
    assert ran(lopd_pipeline(config=config(pipe_dir, "train.schedule.steps=2"))) == []


def test_unreachable_mlflow_is_retried_then_fails(harness, tmp_path):
    import socket

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from components.tracking import TrackingUnavailableError
    from flows.pipeline import lopd_pipeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket is closed
    state = lopd_pipeline(config=config(tmp_path, f"tracking_uri=http://127.0.0.1:{port}"), return_state=True)
    assert state.is_failed()
    with pytest.raises(TrackingUnavailableError, match="unreachable"):
        state.result()

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )

    import asyncio

    (opened,) = [t for t in asyncio.run(task_runs()) if t.name.startswith("open-mlflow-pipeline-run")]
    assert opened.run_count == 3  # the first attempt and execution.retries = 2 retries


def test_compare_reads_every_evaluation_from_mlflow(first, pipe_dir, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    out = CliRunner().invoke(app, ["compare", "--run-dir", str(pipe_dir), "--out", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    methods = [row["method"] for row in data["evaluations"]]
    assert methods.count("base") == 1 and methods.count("lopd") >= 1  # every pipeline run's evaluations
    assert all(row["benchmarks"]["toolworld"]["n"] == 2 for row in data["evaluations"])
    assert {t["run_id"] for t in data["training"]} == {
        r["train_run_id"] for r in data["evaluations"] if r["train_run_id"]
    }
    assert data["budget"] == min(t["final_generations"] for t in data["training"])
    assert (tmp_path / "report.md").read_text().startswith("# Comparison of")
    assert (tmp_path / "curves_generations.png").stat().st_size > 0
