"""A real Prefect server on PostgreSQL with a process worker: deploy prefect.yaml, run the pipeline deployment,
grow the bank, and see bank-watch's event trigger the re-training deployment, which runs to completion.

The server is tests/flows/servers.py's (`lopd deploy` creates the work pools and registers every deployment);
`prefect worker start --pool lopd-process` runs the flow runs as subprocesses. The pipeline sends its evaluations to
the lopd-stage/stage-in-a-process deployment (mode=deployments), so the scale-out path (run_deployment, job
variables, the result hand-off through the stage cache) runs too. Every process started here is stopped by its
process group.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.flows.presets import LEAN as PRESET_LEAN
from tests.flows.servers import ROOT, flow_runs, lopd, prefect_server, started, wait_for

pytestmark = pytest.mark.slow

LEAN = [
    *PRESET_LEAN,
    "evaluate.base=false",
    "execution.mode=deployments",
    "execution.remote_stages=[evaluate]",
    "execution.deployments={evaluate: lopd-stage/stage-in-a-process}",
    "execution.job_variables={evaluate: {env: {LOPD_TEST_MARK: x}}}",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as srv:
        yield srv


def test_deploy_run_pipeline_and_retrain_on_bank_growth(server, tmp_path):
    timings = {"server_start_s": round(server["start_s"], 1)}
    t0 = time.monotonic()
    deployed = lopd(server, "deploy")
    assert "11 deployments on" in deployed.stdout and "prefect worker start --pool lopd-process" in deployed.stdout
    timings["deploy_s"] = round(time.monotonic() - t0, 1)
    deployments = httpx.post(f"{server['api']}/deployments/filter", json={}, timeout=30).json()
    names = {d["name"] for d in deployments}
    assert {"pipeline-on-this-machine", "pipeline-on-kubernetes", "train-gpu-pod", "retrain-on-bank-growth"} <= names
    assert len(names) == len(deployments) == 11  # unique: the automation card shows the name alone
    study = next(d for d in deployments if d["entrypoint"].endswith(":lopd_study"))
    assert "config" in study["parameter_openapi_schema"]["properties"]  # the typed form
    pool = httpx.get(f"{server['api']}/work_pools/lopd-gpu", timeout=30).json()
    assert pool["type"] == "kubernetes"
    assert "nvidia.com/gpu" in json.dumps(pool["base_job_template"]["job_configuration"])
    retrain = next(d for d in deployments if d["entrypoint"].endswith(":lopd_retrain"))
    assert retrain["global_concurrency_limit"]["limit"] == 1
    assert retrain["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"

    worker_env = {**server["env"], "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
    worker_cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "lopd-process", "--type", "process"]
    run_dir = tmp_path / "run"
    with started(worker_cmd, worker_env, server["home"] / "worker.log"):
        # 1. the pipeline deployment; its evaluations run as lopd-stage/stage-in-a-process flow runs
        t0 = time.monotonic()
        config = [arg for item in [*LEAN, f"run_dir={run_dir}"] for arg in ("-s", item)]
        tiny = str(ROOT / "configs" / "tiny.yaml")
        shown = lopd(server, "run", tiny, *config, "-d", "lopd-pipeline/pipeline-on-this-machine")
        timings["pipeline_s"] = round(time.monotonic() - t0, 1)
        (pipe_run,) = flow_runs(server, "lopd-pipeline")
        # what the user sees: the table, where things are and the UI link, as a local run prints them
        assert "## Evaluation" in shown.stdout and "| Model |" in shown.stdout, shown.stdout
        assert "MLflow pipeline run" in shown.stdout and f"{run_dir}" in shown.stdout, shown.stdout
        assert f"/runs/flow-run/{pipe_run['id']}" in shown.stdout, shown.stdout
        assert pipe_run["state_type"] == "COMPLETED"
        stage_runs = flow_runs(server, "lopd-stage")
        assert [r["state_type"] for r in stage_runs] == ["COMPLETED"]  # the evaluation, in its own process
        assert all(r["job_variables"]["env"]["LOPD_TEST_MARK"] == "x" for r in stage_runs)
        assert all(r["job_variables"]["env"]["MLFLOW_TRACKING_URI"].endswith("mlflow.db") for r in stage_runs)
        trained = json.loads((run_dir / "trained.json").read_text())
        assert trained["bank_version"] == 1

        # 2. the bank grows (the bank CLI), bank-watch announces it twice in a row: one re-training
        grown = tmp_path / "grown.jsonl"
        rows = [
            {
                "task_id": f"extra-{i}",
                "env_id": "toolworld_bank",
                "task": f"Extra task {i}",
                "reward": 1.0,
                "messages": [{"role": "user", "content": f"Extra task {i}"}, {"role": "assistant", "content": "ok"}],
                "trace": f"Action: ok {i}",
            }
            for i in range(3)
        ]
        grown.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ingest = lopd(server, "bank", "ingest", str(grown), "--location", str(run_dir / "bank"), "--min-reward", "0")
        assert json.loads(ingest.stdout)["added"] == 3
        t0 = time.monotonic()
        first = json.loads(lopd(server, "watch", "--run-dir", str(run_dir), "--min-growth", "3").stdout)
        again = json.loads(
            lopd(server, "watch", "--run-dir", str(run_dir), "--min-growth", "3", "--debounce-s", "0").stdout
        )
        assert first["status"] == again["status"] == "emitted"  # two events: the trigger must debounce them
        done = wait_for(
            "the triggered lopd-retrain run to finish",
            lambda: [
                r
                for r in flow_runs(server, "lopd-retrain")
                if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
            ],
            timeout=900,
        )
        timings["retrain_s"] = round(time.monotonic() - t0, 1)
        (run,) = done
        assert run["state_type"] == "COMPLETED", run["state"]
        assert run["parameters"]["run_dir"] == str(run_dir) and run["parameters"]["bank_version"] == 2
        assert run["name"] == f"retrain bank v2 of {run_dir}"  # what triggered it, not a random name
        retrained = [r for r in flow_runs(server, "lopd-pipeline") if r["name"] == "retrain bank v2"]
        assert len(retrained) == 1 and {"retrain", "bank-v2"} <= set(retrained[0]["tags"])
        from mlflow import MlflowClient

        mlflow = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
        pipes = mlflow.search_runs(
            [mlflow.get_experiment_by_name("lopd").experiment_id], "tags.`lopd.role` = 'pipeline'"
        )
        assert sorted(p.data.tags.get("lopd.trigger", "-") for p in pipes) == ["-", "retrain bank v2"]
        assert json.loads((run_dir / "trained.json").read_text())["bank_version"] == 2
        time.sleep(5)
        assert len(flow_runs(server, "lopd-retrain")) == 1  # debounced: one growth burst, one re-training
        assert [r["state_type"] for r in flow_runs(server, "lopd-stage")] == ["COMPLETED"] * 2  # evaluated again
    print(json.dumps(timings))
