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
LOCAL_PIPELINE, K8S_PIPELINE = "lopd-pipeline/pipeline-on-this-machine", "lopd-pipeline/pipeline-on-kubernetes"
EXPECTED = {
    "lopd-pipeline/pipeline-on-this-machine": "lopd-process",
    "lopd-pipeline/pipeline-on-kubernetes": "lopd-gpu",
    "lopd-study/study-on-this-machine": "lopd-process",
    "lopd-era-shift/era-shift-on-this-machine": "lopd-process",
    "lopd-stage/sft-gpu-pod": "lopd-gpu",
    "lopd-stage/collect-gpu-pod": "lopd-gpu",
    "lopd-stage/cold-start-gpu-pod": "lopd-gpu",
    "lopd-stage/train-gpu-pod": "lopd-gpu",
    "lopd-stage/evaluate-gpu-pod": "lopd-gpu",
    "lopd-stage/stage-in-a-process": "lopd-process",
    "lopd-retrain/retrain-on-bank-growth": "lopd-process",
    "bank-watch/watch-bank-growth": "lopd-process",
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
            assert image == ("lopd-platform:cpu" if name == K8S_PIPELINE else "lopd-platform:gpu")
    assert "execution.mode=deployments" in deployments[K8S_PIPELINE]["parameters"]["overrides"]
    assert deployments[LOCAL_PIPELINE]["parameters"] == {"preset": "tiny"}  # what Quick run starts: minutes on CPU


def test_deployment_names_are_unique_and_say_what_they_do(deployments):
    """The automation card and the deployments list show the name alone ("Run deployment: NAME")."""
    names = [name.split("/")[1] for name in deployments]
    assert len(set(names)) == len(names), names
    assert all(n not in ("local", "k8s", "default") for n in names)


def test_retrain_trigger_matches_the_bank_watch_event(deployments):
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
    from prefect.events.schemas.events import Resource

    from flows.retrain import EVENT, bank_resource_id

    dep = deployments["lopd-retrain/retrain-on-bank-growth"]
    (raw,) = dep["triggers"]
    trigger = DeploymentEventTrigger.model_validate(raw)
    assert trigger.expect == {EVENT} and trigger.threshold == 1 and trigger.within.total_seconds() >= 60
    assert trigger.for_each == {"prefect.resource.id"}  # debounced per bank
    resource_id = bank_resource_id("/runs/x/bank", "experience")
    assert trigger.match.matches(Resource({"prefect.resource.id": resource_id, "prefect.resource.name": "experience"}))
    assert set(trigger.parameters) == {"run_dir", "bank_version", "min_growth"}
    assert dep["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert not any(s.get("active", True) for s in dep["schedules"])  # cron schedule shipped off
    assert not any(s.get("active", True) for s in deployments["bank-watch/watch-bank-growth"]["schedules"])


def test_flow_parameters_are_a_typed_form_with_paper_defaults():
    from flows.pipeline import lopd_pipeline

    schema = lopd_pipeline.parameters.model_dump()
    assert list(schema["properties"]) == ["preset", "overrides", "config"]  # the common choice first
    assert schema["properties"]["preset"]["default"] == "tiny" and "paper" in schema["properties"]["preset"]["enum"]
    config = schema["properties"]["config"]
    assert config["anyOf"][0]["$ref"].endswith("PipelineConfig") and config["default"] is None  # None: the preset
    lopd = schema["definitions"]["SweepLOPDConfig"]["properties"]
    assert lopd["top_m"]["default"] == 20 and lopd["n_queries"]["default"] == 32
    assert lopd["margin_target"]["default"] == 0.05 and "method" not in lopd  # the sweep sets the method
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
    values = {**deployments["lopd-stage/train-gpu-pod"]["work_pool"]["job_variables"], **ctx.job_variables_for("train")}
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
    pipe = render(json.loads(TEMPLATE.read_text()), deployments[K8S_PIPELINE]["work_pool"]["job_variables"])
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
    values = {**deployments["lopd-stage/train-gpu-pod"]["work_pool"]["job_variables"],
              **gpu_variables("train", spec, stage_context(cfg).job_variables_for("train"))}  # fmt: skip
    job = render(json.loads(TEMPLATE.read_text()), values)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    with pytest.raises(ValueError, match=r"gpu_count=4 differs from train\.nproc=8"):
        gpu_variables("train", spec, {"gpu_count": 4})
    assert gpu_variables("train", SimpleNamespace(nproc=1), {"gpu_count": 4}) == {"gpu_count": 4}


def test_train_nodes_needs_deployments_and_its_pod_requests_no_gpu(tmp_path):
    """train.nodes=2: the train stage's pod only submits the PyTorchJob (flows.pytorchjob) and waits, so it asks
    for no GPU; outside execution.mode=deployments the setting is an error that says what to do."""
    from flows.config import load_config
    from flows.stages import gpu_variables

    args = [f"run_dir={tmp_path}", "train.nproc=8", "train.nodes=2", "train.schedule.tasks_per_step=16"]
    cfg = load_config(None, [*args, "execution.mode=deployments"])
    spec = SimpleNamespace(nproc=8, nodes=cfg.train.nodes)
    assert gpu_variables("train", spec, {"gpu_count": 8}) == {"gpu_count": 0}
    with pytest.raises(ValueError, match=r"train\.nodes=2 runs the train stage as a Kubeflow PyTorchJob.*"
                                         r"execution\.mode=deployments"):  # fmt: skip
        load_config(None, args)


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
    shown = runner.invoke(app, ["run", "--help"], env={"COLUMNS": "240"}, terminal_width=240)
    assert "-s 'methods=[lopd, grpo]' -s 'seeds=[0, 1]'" in shown.output  # brackets are not rich markup


def test_cli_eval_passes_through_to_the_evaluate_stage():
    from flows.cli import app

    out = CliRunner().invoke(app, ["eval", "backbone=tiny", "benchmarks=[toolworld]", "--print-spec"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load(out.output)["backbone"] == "tiny"


def _flow_schemas() -> dict[str, dict[str, Any]]:
    """The parameter JSON schema Prefect builds for every flow of prefect.yaml (what the UI's run form shows)."""
    out = {}
    for dep in yaml.safe_load(PREFECT_YAML.read_text())["deployments"]:
        path, func = dep["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), func)
        out[flow.name] = flow.parameters.model_dump()
    return out


def _properties(schema: dict[str, Any], node: dict[str, Any], path: str = ""):
    """(dotted path, property schema, its definition) of every property under `node`, through $ref/allOf/anyOf
    and array items, as the form renders them."""

    def resolve(n: dict[str, Any]) -> dict[str, Any]:
        return schema["definitions"][n["$ref"].split("/")[-1]] if "$ref" in n else n

    target = resolve(node)
    for sub in (*node.get("allOf", []), *node.get("anyOf", []), *target.get("anyOf", [])):
        yield from _properties(schema, sub, path)
    if isinstance(target.get("items"), dict):
        yield from _properties(schema, target["items"], f"{path}[]")
    for name, prop in (target.get("properties") or {}).items():
        dotted = f"{path}.{name}" if path else name
        yield dotted, prop, resolve(prop)
        yield from _properties(schema, prop, dotted)


def test_every_form_field_has_a_description_without_angle_brackets():
    schemas = _flow_schemas()
    assert {"lopd-pipeline", "lopd-study", "lopd-stage", "lopd-retrain", "bank-watch"} <= set(schemas)
    missing, angled, seen = [], [], 0
    for flow_name, schema in schemas.items():
        for path, prop, target in _properties(schema, schema):
            seen += 1
            text = prop.get("description") or target.get("description")  # pydantic drops one equal to its model's
            if not text:
                missing.append(f"{flow_name}: {path}")
            elif "<" in text or ">" in text:  # the UI renders descriptions as markdown and drops <...>
                angled.append(f"{flow_name}: {path}: {text}")
    assert seen > 100
    assert not missing, f"form fields without a description: {missing}"
    assert not angled, f"descriptions with angle brackets: {angled}"
    lopd = schemas["lopd-pipeline"]["definitions"]["SweepLOPDConfig"]["properties"]
    assert "M" in lopd["top_m"]["description"] and "eq. 9" in lopd["top_m"]["description"]
    assert lopd["dual_lr"]["description"].startswith("eta_beta") and "lambda" in lopd["anchor_weight"]["description"]
    config = schemas["lopd-pipeline"]["definitions"]["PipelineConfig"]["properties"]
    assert "RUN_DIR/artifacts" in config["artifact_root"]["description"]


def test_pipeline_form_is_compact():
    """The sweep sets lopd.method and lopd.seed: not in the form; rarely changed groups are one JSON editor each
    (an object without properties), so target modules are no longer two lists of seven inputs."""
    schema = _flow_schemas()["lopd-pipeline"]
    paths = {path: prop for path, prop, _ in _properties(schema, schema)}
    assert "config.lopd.method" not in paths and "config.lopd.seed" not in paths
    assert "config.lopd.top_m" in paths and "config.train.schedule.steps" in paths  # the method's knobs stay fields
    assert not [p for p in paths if p.endswith("target_modules")]
    for folded in (
        "lopd.encoder_lora",
        "lopd.baseline",
        "lopd.opd",
        "collect",
        "cold_start",
        "execution",
        "evaluate.benchmarks",
    ):
        prop = paths[f"config.{folded}"]
        assert "$ref" not in prop and "properties" not in prop and "items" not in prop, folded
        assert prop["default"] and "edit as JSON" in prop["description"], folded
    # 172 form fields before folding (100 with sft.* under its null switch; 101 with lopd.length_grouping, a
    # knob of the step's speed beside lopd.head_chunk_size; 102 with lopd.encoder_layer, which hidden states the
    # composer reads; 103 with lopd.latent_values; 104 with draws, the rule draws a study runs on), behind the
    # config's tab: preset and overrides first
    assert [p for p in paths if not p.startswith("config")] == ["preset", "overrides"]
    assert len([p for p in paths if p.startswith("config")]) <= 104, sorted(paths)
    # no "Property is type None" tab: a scalar that defaults to null is shown as its type (left empty: null)
    scalars = ("string", "integer", "number", "boolean")
    noise = [
        p
        for p, prop in paths.items()
        if prop.get("default", 0) is None and any(b.get("type") in scalars for b in prop.get("anyOf", []))
    ]
    assert not noise, noise
    assert paths["config.artifact_root"]["type"] == "string" and "default" not in paths["config.artifact_root"]
    # settable: one choice of three, not a const
    assert paths["config.lopd.gradient_checkpointing"]["enum"] == ["auto", True, False]
    # the form's JSON editors show the config's dump: benchmarks as one writes them, not 13 keys each
    assert paths["config.evaluate.benchmarks"]["default"] == ["toolworld", "bfcl", "humaneval"]


def test_every_config_field_is_described():
    """Folded groups leave the form, not the models: every field of the configs keeps its description."""
    from components.evaluate import BenchmarkSpec, DecodingSpec
    from flows.config import PipelineConfig
    from lopd_core.config import LOPDConfig, SFTConfig
    from lopd_core.rollout import RolloutConfig

    def walk(model: Any, prefix: str):
        for name, info in model.model_fields.items():
            yield f"{prefix}{name}", info
            for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
                if isinstance(arg, type) and hasattr(arg, "model_fields"):
                    yield from walk(arg, f"{prefix}{name}.")

    models = (PipelineConfig, LOPDConfig, SFTConfig, BenchmarkSpec, DecodingSpec, RolloutConfig)
    missing = [path for m in models for path, info in walk(m, f"{m.__name__}.") if not info.description]
    assert not missing, missing


def test_folded_groups_still_validate():
    from flows.config import PipelineConfig

    with pytest.raises(ValueError, match="grad_clip_qformer"):
        PipelineConfig.model_validate({"cold_start": {"grad_clip_qformer": -1}})
    cfg = PipelineConfig.model_validate({"lopd": {"encoder_lora": {"r": 4}}, "execution": {"retries": 0}})
    assert cfg.lopd.encoder_lora.r == 4 and cfg.execution.retries == 0
    assert cfg.method_config("grpo", 3).method == "grpo" and cfg.method_config("grpo", 3).seed == 3
