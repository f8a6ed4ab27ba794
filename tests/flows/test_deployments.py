"""prefect.yaml (names, pools, entrypoints, triggers, schedules), the GPU job a stage run renders to, the CLI help.

Fast: nothing runs a flow. The deployments are registered and run on a real server in test_server.py (slow).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = ROOT / "prefect.yaml"
TEMPLATE = ROOT / "k8s" / "prefect" / "gpu-job-template.json"
EXPECTED = {
    "lopd-pipeline/local": "lopd-process",
    "lopd-pipeline/k8s": "lopd-gpu",
    "lopd-study/local": "lopd-process",
    "lopd-stage/sft": "lopd-gpu",
    "lopd-stage/collect": "lopd-gpu",
    "lopd-stage/cold-start": "lopd-gpu",
    "lopd-stage/train": "lopd-gpu",
    "lopd-stage/evaluate": "lopd-gpu",
    "lopd-stage/local": "lopd-process",
    "lopd-retrain/local": "lopd-process",
    "bank-watch/local": "lopd-process",
}


@pytest.fixture(scope="module")
def deployments() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(PREFECT_YAML.read_text())
    out = {}
    for dep in data["deployments"]:
        path, func = dep["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        out[f"{getattr(module, func).name}/{dep['name']}"] = dep
    return out


def test_prefect_yaml_is_valid_for_prefect_deploy():
    from prefect.cli.deploy._models import PrefectYamlModel

    model = PrefectYamlModel.model_validate(yaml.safe_load(PREFECT_YAML.read_text()))
    assert len(model.deployments) == len(EXPECTED)


def test_deployment_names_pools_and_entrypoints(deployments):
    assert {name: dep["work_pool"]["name"] for name, dep in deployments.items()} == EXPECTED
    for name, dep in deployments.items():
        on_gpu_pool = dep["work_pool"]["name"] == "lopd-gpu"
        pulls = dep.get("pull") or []
        assert on_gpu_pool == bool(pulls), name  # image deployments load the flows from /opt/lopd
        if on_gpu_pool:
            image = dep["work_pool"]["job_variables"]["image"]
            assert image == ("lopd-platform:cpu" if name == "lopd-pipeline/k8s" else "lopd-platform:gpu")
    assert deployments["lopd-pipeline/k8s"]["parameters"]["config"]["execution"]["mode"] == "deployments"


def test_retrain_trigger_matches_the_bank_watch_event(deployments):
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
    from prefect.events.schemas.events import Resource

    from flows.retrain import EVENT, bank_resource_id

    dep = deployments["lopd-retrain/local"]
    (raw,) = dep["triggers"]
    trigger = DeploymentEventTrigger.model_validate(raw)
    assert trigger.expect == {EVENT} and trigger.threshold == 1 and trigger.within.total_seconds() >= 60
    assert trigger.for_each == {"prefect.resource.id"}  # debounced per bank
    resource_id = bank_resource_id("/runs/x/bank", "experience")
    assert trigger.match.matches(Resource({"prefect.resource.id": resource_id, "prefect.resource.name": "experience"}))
    assert set(trigger.parameters) == {"run_dir", "bank_version", "min_growth"}
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert not any(s.get("active", True) for s in dep["schedules"])  # cron schedule shipped off
    assert not any(s.get("active", True) for s in deployments["bank-watch/local"]["schedules"])


def test_flow_parameters_are_a_typed_form_with_paper_defaults():
    from flows.pipeline import lopd_pipeline

    schema = lopd_pipeline.parameters.model_dump()
    config = schema["properties"]["config"]
    assert config["$ref"].endswith("PipelineConfig")
    lopd = schema["definitions"]["LOPDConfig"]["properties"]
    assert lopd["top_m"]["default"] == 20 and lopd["n_queries"]["default"] == 32
    assert lopd["margin_target"]["default"] == 0.05 and lopd["method"]["enum"][0] == "lopd"
    assert schema["definitions"]["ScheduleConfig"]["properties"]["steps"]["default"] == 100


def render(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The Job the kubernetes worker submits for a flow run with these job variables (prefect-kubernetes)."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    conf = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=object()))
    conf.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="render", flow_id=uuid.uuid4()))
    return conf.job_manifest


def test_train_stage_run_renders_to_a_gpu_job(deployments, tmp_path):
    pytest.importorskip("prefect_kubernetes")
    from flows.config import load_config
    from flows.pipeline import stage_context

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            "execution.mode=deployments",
            "tracking_uri=http://mlflow:5000",
            "artifact_root=s3://lopd-artifacts/runs",
            "bank.location=http://qdrant:6333",
            "execution.job_variables={train: {gpu_count: 8, node_selector: {gpu: h100}}}",
        ],
    )
    ctx = stage_context(cfg)
    assert ctx.remote_stages == ("sft", "collect", "cold_start", "train", "evaluate")
    # The server merges the deployment's job variables with the run's (the run's win), as run_deployment sends them.
    values = {**deployments["lopd-stage/train"]["work_pool"]["job_variables"], **ctx.job_variables_for("train")}
    job = render(json.loads(TEMPLATE.read_text()), values)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "lopd-platform:gpu"
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["LOPD_ARTIFACT_ROOT"] == "s3://lopd-artifacts/runs" and env["LOPD_QDRANT_URL"] == "http://qdrant:6333"
    assert {"configMapRef": {"name": "lopd-services"}} in container["envFrom"]
    # The pipeline pod itself asks for no GPU.
    pipe = render(json.loads(TEMPLATE.read_text()), deployments["lopd-pipeline/k8s"]["work_pool"]["job_variables"])
    (pipe_container,) = pipe["spec"]["template"]["spec"]["containers"]
    assert pipe_container["resources"]["limits"]["nvidia.com/gpu"] == 0
    assert pipe_container["image"] == "lopd-platform:cpu"


def test_train_nproc_sets_the_pods_gpu_request(deployments, tmp_path):
    """train.nproc=8 is the one setting: the train pod requests 8 GPUs, and the stage runs 8 ranks under torchrun."""
    pytest.importorskip("prefect_kubernetes")
    from flows.config import load_config
    from flows.pipeline import stage_context
    from flows.stages import gpu_variables

    cfg = load_config(None, [f"run_dir={tmp_path}", "execution.mode=deployments", "train.nproc=8",
                             "train.schedule.tasks_per_step=16"])  # fmt: skip
    assert cfg.train.nproc == 8
    spec = SimpleNamespace(nproc=cfg.train.nproc)
    values = {**deployments["lopd-stage/train"]["work_pool"]["job_variables"],
              **gpu_variables("train", spec, stage_context(cfg).job_variables_for("train"))}  # fmt: skip
    job = render(json.loads(TEMPLATE.read_text()), values)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(ValueError, match=r"gpu_count=4 differs from train\.nproc=8"):
        gpu_variables("train", spec, {"gpu_count": 4})
    assert gpu_variables("train", SimpleNamespace(nproc=1), {"gpu_count": 4}) == {"gpu_count": 4}


@pytest.mark.parametrize("command", ["run", "compare", "deploy", "watch", "bank"])
def test_cli_help(command):
    from flows.cli import app

    out = CliRunner().invoke(app, [command, "--help"])
    assert out.exit_code == 0, out.output
    assert "Usage" in out.output


def test_cli_run_prints_the_resolved_config_and_rejects_bad_fields(tmp_path):
    from flows.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["run", str(ROOT / "configs" / "tiny.yaml"), "-s", "seeds=[0, 1]", "--print-config"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["seeds"] == [0, 1]
    bad = runner.invoke(app, ["run", "-s", "lopd.top_m=-1", "--print-config"])
    assert bad.exit_code == 2 and "top_m" in bad.output


def test_cli_eval_passes_through_to_the_evaluate_stage():
    from flows.cli import app

    out = CliRunner().invoke(app, ["eval", "backbone=tiny", "benchmarks=[toolworld]", "--print-spec"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["backbone"] == "tiny"
