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
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.flows import test_stopping as stopping
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
        t0 = time.monotonic()
        srv["deployed"] = lopd(srv, "deploy")  # the work pools and every deployment of prefect.yaml
        srv["deploy_s"] = round(time.monotonic() - t0, 1)
        yield srv


def worker(server: dict[str, Any]) -> Any:
    """A process worker on lopd-process (stopped by its process group when the block ends)."""
    env = {**server["env"], "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "lopd-process", "--type", "process"]
    return started(cmd, env, server["home"] / "worker.log")


def test_deploy_run_pipeline_and_retrain_on_bank_growth(server, tmp_path):
    timings = {"server_start_s": round(server["start_s"], 1), "deploy_s": server["deploy_s"]}
    deployed = server["deployed"]
    assert "12 deployments on" in deployed.stdout and "prefect worker start --pool lopd-process" in deployed.stdout
    deployments = httpx.post(f"{server['api']}/deployments/filter", json={}, timeout=30).json()
    names = {d["name"] for d in deployments}
    assert {"pipeline-on-this-machine", "pipeline-on-kubernetes", "train-gpu-pod", "retrain-on-bank-growth"} <= names
    assert len(names) == len(deployments) == 12  # unique: the automation card shows the name alone
    study = next(d for d in deployments if d["entrypoint"].endswith(":lopd_study"))
    assert "config" in study["parameter_openapi_schema"]["properties"]  # the typed form
    pool = httpx.get(f"{server['api']}/work_pools/lopd-gpu", timeout=30).json()
    assert pool["type"] == "kubernetes"
    assert "nvidia.com/gpu" in json.dumps(pool["base_job_template"]["job_configuration"])
    retrain = next(d for d in deployments if d["entrypoint"].endswith(":lopd_retrain"))
    assert retrain["global_concurrency_limit"]["limit"] == 1
    assert retrain["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"

    run_dir = tmp_path / "run"
    with worker(server):
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


# ------------------------------------------------------------------------------ one SIGTERM to a deployment run


def _deployment_run(server: dict[str, Any], run_dir: Any, *extra: str) -> subprocess.Popen[str]:
    """`lopd run ... -d lopd-pipeline/pipeline-on-this-machine`: two methods x two seeds, stages in processes."""
    cmd = [sys.executable, "-m", "flows.cli", "run", str(ROOT / "configs" / "tiny.yaml")]
    for item in stopping.overrides(run_dir, f"train.schedule.steps={stopping.STEPS}"):
        cmd += ["-s", item]
    cmd += ["-d", "lopd-pipeline/pipeline-on-this-machine", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=server["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def _task_run_states(server: dict[str, Any], flow_run_id: str) -> list[str]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    return [t["state_type"] for t in httpx.post(f"{server['api']}/task_runs/filter", json=body, timeout=30).json()]


def _stop_flow_run_process(
    server: dict[str, Any], process: subprocess.Popen[str] | int, run_dir: Any
) -> tuple[float, float]:
    """Once two arms train, one SIGTERM to the flow run's process (as Kubernetes sends a pod's); its exit time and
    the signal's wall-clock time (for `stopping.assert_stopped_record`)."""
    pid = process if isinstance(process, int) else process.pid

    def what_it_printed() -> str:  # the pod's log (the Kubernetes test) and the tail of each stage's log
        logs = [run_dir.parent / "pod.log", *sorted(run_dir.glob("stages/*/*/stage.log"))]
        return "\n".join(f"--- {log}:\n{log.read_text()[-1500:]}" for log in logs if log.exists())

    def training() -> bool:
        if not _alive(pid):
            raise AssertionError(f"the flow run's process {pid} ended before two arms trained:\n{what_it_printed()}")
        return stopping.arms_training(run_dir)

    try:
        stopping.wait_for(training, 600, "two train stages, one with a checkpoint")
    except AssertionError as e:
        if not str(e).startswith("timed out"):
            raise
        raise AssertionError(f"{e}\n{what_it_printed()}") from None
    ours = stopping.descendants(pid)
    signalled_at = time.time()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    stopping.wait_for(lambda: not _alive(pid), 30, "the flow run's process to exit")
    stopped_in = time.monotonic() - t0
    assert stopped_in < stopping.STOP_S, f"the flow run's process took {stopped_in:.1f} s"
    assert not stopping.alive(ours), f"left behind: {stopping.alive(ours)}"
    return stopped_in, signalled_at


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "zombie" not in status


def test_one_sigterm_stops_a_deployment_run_in_a_process_worker(server, tmp_path):
    run_dir = tmp_path / "run"
    with worker(server) as proc:
        client = _deployment_run(server, run_dir)
        try:
            engine = stopping.wait_for(
                lambda: [p for p, c in stopping.descendants(proc.pid).items() if "prefect.engine" in c], 300,
                "the worker's flow run process")[0]  # fmt: skip
            stopped_in, signalled_at = _stop_flow_run_process(server, engine, run_dir)
            out, _ = client.communicate(timeout=120)
        finally:
            if client.poll() is None:
                client.kill()
        print(f"the deployment run's process stopped in {stopped_in:.1f} s")
        stopping.assert_stopped_record(run_dir, signalled_at)
        (run,) = [r for r in flow_runs(server, "lopd-pipeline") if r["parameters"]["config"]["run_dir"] == str(run_dir)]
        assert run["state_type"] == "CRASHED", run["state"]
        states = _task_run_states(server, run["id"])
        assert "FAILED" not in states and "CRASHED" in states, states
        assert client.returncode == 1 and "CRASHED" in out.upper(), out[-2000:]
        log = (server["home"] / "worker.log").read_text()
        assert "Logging error" not in log, log[-3000:]
        rerun = _deployment_run(server, run_dir)
        out, _ = rerun.communicate(timeout=900)
        assert rerun.returncode == 0, out[-3000:]
    stopping.assert_resumed(run_dir, out)


def test_one_sigterm_stops_the_kubernetes_job_templates_command(server, tmp_path):
    """A pod runs the job template's container command for its flow run (`prefect.engine`, the image's ENTRYPOINT
    `python -m`); Kubernetes stops it with one SIGTERM, then SIGKILL after the grace period. (With Prefect's default
    command, `prefect flow-run execute`, and the reschedule intent the worker sets for backoff_limit 0, the
    supervisor killed the engine at once without a signal it handles: the runs stayed RUNNING.)"""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from scripts.validate_deploy import GPU_VALUES, JOB_TEMPLATE, render_job_manifest

    run_dir = tmp_path / "run"
    created = _deployment_run(server, run_dir, "--no-wait", "--json")  # no worker polls: the run waits for us
    out, _ = created.communicate(timeout=120)
    assert created.returncode == 0, out[-3000:]
    flow_run_id = json.loads(out.strip().splitlines()[-1])["flow_run_id"]
    template = json.loads(JOB_TEMPLATE.read_text())
    flow_run = FlowRun.model_validate(httpx.get(f"{server['api']}/flow_runs/{flow_run_id}", timeout=30).json())
    # The worker renders the pod's environment from its own settings, which point at its server. This test process's
    # settings may point elsewhere: an in-process flow run of an earlier test leaves Prefect's temporary server in
    # them (CI's pod once asked that server for its flow run: 404).
    with temporary_settings(updates={PREFECT_API_URL: server["api"]}):
        job = render_job_manifest(template, GPU_VALUES, flow_run)
    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {**server["env"], **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
    assert env["PREFECT__FLOW_RUN_ID"] == flow_run_id
    assert env["PREFECT_API_URL"] == server["api"], env["PREFECT_API_URL"]
    # The pod's output goes to a file, as a pod's log does: a pipe nobody reads fills up (64 KiB) and blocks the run.
    with (tmp_path / "pod.log").open("w") as log:
        pod = subprocess.Popen([sys.executable, "-m", *container["args"]], cwd=ROOT, env=env, stdout=log,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
        try:
            stopped_in, signalled_at = _stop_flow_run_process(server, pod, run_dir)
            pod.wait(timeout=30)
        finally:
            if pod.poll() is None:
                pod.kill()
    out = (tmp_path / "pod.log").read_text()
    print(f"the pod's command stopped in {stopped_in:.1f} s (exit code {pod.returncode})")
    stopping.assert_stopped_record(run_dir, signalled_at)
    assert "Logging error" not in out, out[-3000:]
    run = httpx.get(f"{server['api']}/flow_runs/{flow_run_id}", timeout=30).json()
    assert run["state_type"] == "CRASHED", run["state"]
    assert "FAILED" not in _task_run_states(server, flow_run_id)
