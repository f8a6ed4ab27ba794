"""Deployment files validated offline: k8s manifests and overlays, the Prefect GPU job template, Dockerfiles,
the compose file. Each check also runs on a deliberately broken input, to show that it can fail.

The checks live in scripts/validate_deploy.py (also runnable on its own). A check whose external tool is missing
(kubectl, hadolint, prefect-kubernetes, Docker Compose v2) is skipped with the reason.
"""

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
BROKEN = ROOT / "tests" / "fixtures" / "k8s" / "broken"

_spec = importlib.util.spec_from_file_location("validate_deploy", ROOT / "scripts" / "validate_deploy.py")
vd = importlib.util.module_from_spec(_spec)
sys.modules["validate_deploy"] = vd
_spec.loader.exec_module(vd)

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed: overlays cannot be rendered (kubectl kustomize)"
)
needs_prefect_kubernetes = pytest.mark.skipif(
    importlib.util.find_spec("prefect_kubernetes") is None,
    reason="prefect-kubernetes is not installed: the job template cannot be rendered as the worker renders it",
)


def _tool_or_skip(check, *args):
    try:
        return check(*args)
    except vd.ToolMissing as missing:
        pytest.skip(str(missing))


# --- Kubernetes manifests -----------------------------------------------------------------------------------


def test_every_manifest_validates_strictly():
    assert vd.check_manifest_files() == []


def test_secret_templates_are_valid_and_hold_placeholders_only():
    assert vd.check_secret_templates() == []
    names = set(vd.secret_template_keys())
    assert {"lopd-s3", "lopd-mlflow-db", "lopd-prefect-db", "lopd-postgres"} <= names


def test_overlays_dev_and_gpu_cluster_exist():
    assert {path.name for path in vd.overlay_dirs()} >= {"dev", "gpu-cluster"}


@needs_kubectl
@pytest.mark.parametrize("overlay", ["dev", "gpu-cluster"])
def test_overlay_renders_and_validates(overlay):
    assert vd.check_overlay(vd.K8S_DIR / "overlays" / overlay) == []


@needs_kubectl
def test_gpu_cluster_overlay_uses_the_registry_image_and_external_s3():
    docs = vd.load_documents(vd.kustomize(vd.K8S_DIR / "overlays" / "gpu-cluster"))
    by_name = {vd._name(doc): doc for doc in docs}
    mlflow = by_name["Deployment/mlflow"]["spec"]["template"]["spec"]["containers"][0]
    assert mlflow["image"].endswith("/lopd-platform:cpu") and "/" in mlflow["image"]
    services = by_name["ConfigMap/lopd-services"]["data"]
    assert services["AWS_ENDPOINT_URL"] != "http://minio:9000"
    assert "StatefulSet/minio" not in by_name and "StatefulSet/postgres" not in by_name
    for doc in docs:
        assert doc["metadata"].get("namespace", "lopd") == "lopd"


def test_worker_role_is_namespaced_and_covers_jobs_and_pods():
    docs = vd.load_documents((vd.K8S_DIR / "base" / "prefect-worker.yaml").read_text())
    kinds = {doc["kind"] for doc in docs}
    assert "ClusterRole" not in kinds and {"Role", "RoleBinding", "ServiceAccount"} <= kinds
    rules = next(doc for doc in docs if doc["kind"] == "Role")["rules"]
    granted = set()
    for rule in rules:
        for group in rule["apiGroups"]:
            granted |= {(group, resource, verb) for resource in rule["resources"] for verb in rule["verbs"]}
    assert {("batch", "jobs", verb) for verb in ("create", "get", "watch", "delete")} <= granted
    assert {("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list")} <= granted
    worker = next(doc for doc in docs if doc["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert worker["containers"][0]["args"][:5] == ["prefect", "worker", "start", "--pool", "lopd-gpu"]


def test_broken_fixture_fails_strict_file_validation():
    problems = vd.check_manifest_files(BROKEN)
    text = "\n".join(problems)
    assert "'replica' was unexpected" in text  # only strict validation rejects an unknown field
    assert "no resources.limits.cpu" in text
    assert "lopd-platform:latest" in text
    assert "base/unlisted.yaml: not listed" in text
    assert "Secret/committed-secret" in text


def test_strict_mode_is_what_catches_the_typo():
    doc = vd.load_documents((BROKEN / "base" / "deployment.yaml").read_text())[0]
    vd.kubernetes_validate.validate(doc, vd.K8S_VERSIONS[-1], strict=False)  # passes without strict
    with pytest.raises(vd.kubernetes_validate.ValidationError):
        vd.kubernetes_validate.validate(doc, vd.K8S_VERSIONS[-1], strict=True)


@needs_kubectl
def test_broken_fixture_fails_after_kustomize():
    problems = vd.check_overlay(BROKEN / "overlays" / "bad", BROKEN)
    text = "\n".join(problems)
    assert "'replica' was unexpected" in text
    assert "Secret/committed-secret" in text
    assert "no ConfigMap lopd-services" in text


@needs_kubectl
def test_command_line_exits_non_zero_on_the_broken_fixture():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "validate_deploy.py"), "k8s", str(BROKEN)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL k8s" in result.stdout


def test_a_secret_template_with_a_real_password_fails(tmp_path):
    (tmp_path / "secrets").mkdir()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "lopd-s3", "namespace": "lopd"},
        "stringData": {"AWS_ACCESS_KEY_ID": "change-me-id", "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI"},
    }
    (tmp_path / "secrets" / "s3.yaml").write_text(yaml.safe_dump(secret))
    problems = vd.check_secret_templates(tmp_path)
    assert len(problems) == 1 and "AWS_SECRET_ACCESS_KEY is not a placeholder" in problems[0]


def test_configmap_has_every_key_the_stage_pods_read():
    doc = vd.load_documents((vd.K8S_DIR / "base" / "services-configmap.yaml").read_text())[0]
    assert set(vd.SERVICE_KEYS) <= set(doc["data"])
    assert doc["data"]["LOPD_ARTIFACT_ROOT"].startswith("s3://")


# --- Prefect job template ------------------------------------------------------------------------------------


def _template():
    return json.loads(vd.JOB_TEMPLATE.read_text())


def test_job_template_passes_the_prefect_server_validation():
    assert vd.template_server_problems(_template()) == []


def test_job_template_variables_and_defaults():
    properties = _template()["variables"]["properties"]
    assert properties["gpu_count"]["default"] == 1 and properties["gpu_count"]["type"] == "integer"
    assert properties["namespace"]["default"] == "lopd"
    assert properties["image"]["default"] == "lopd-platform:gpu"
    assert properties["config_map_name"]["default"] == "lopd-services"
    assert properties["secret_name"]["default"] == "lopd-s3"
    for name in ("node_selector", "tolerations", "cpu_request", "cpu_limit", "memory_request", "memory_limit"):
        assert properties[name].get("default") is not None, name


@needs_prefect_kubernetes
def test_job_template_renders_a_valid_gpu_job():
    assert vd.check_job_template() == []


@needs_prefect_kubernetes
def test_job_template_renders_with_defaults_and_without_gpu():
    template = _template()
    job = vd.render_job_manifest(template, {})
    assert vd.schema_problems(job, "defaults") == []
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    job = vd.render_job_manifest(template, {"gpu_count": 0, "node_selector": {}, "tolerations": []})
    assert vd.schema_problems(job, "cpu only") == []


def test_a_template_with_an_undeclared_variable_fails():
    template = _template()
    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority }}"
    problems = vd.template_server_problems(template)
    assert problems and "priority" in problems[0]


@needs_prefect_kubernetes
def test_a_template_that_loses_the_gpu_limit_fails(tmp_path):
    template = _template()
    del template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]["nvidia.com/gpu"]
    broken = copy.deepcopy(template)
    broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["nodeSelectr"] = "{{ node_selector }}"
    path = tmp_path / "template.json"
    path.write_text(json.dumps(broken))
    text = "\n".join(vd.check_job_template(path))
    assert "nvidia.com/gpu limit is None, expected 4" in text
    assert "'nodeSelectr' was unexpected" in text


# --- Dockerfiles ---------------------------------------------------------------------------------------------


def test_cpu_and_gpu_dockerfiles_exist():
    assert (vd.DOCKER_DIR / "Dockerfile.cpu").exists() and (vd.DOCKER_DIR / "Dockerfile.gpu").exists()


def test_dockerfiles_pass_hadolint_and_the_image_contract():
    assert _tool_or_skip(vd.check_docker) == []


def test_a_broken_dockerfile_fails(tmp_path):
    path = tmp_path / "Dockerfile.bad"
    path.write_text('FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nCMD ["bash"]\n')
    text = "\n".join(_tool_or_skip(vd.check_dockerfile, path))
    assert "DL3007" in text  # :latest
    assert "DL3008" in text  # unpinned apt package
    assert "non-root USER" in text
    assert "entrypoint" in text


def test_dockerfiles_copy_only_what_dockerignore_lets_in():
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    for dockerfile in sorted(vd.DOCKER_DIR.glob("Dockerfile.*")):
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY ") and "--from=" not in line:
                sources = line.split()[1:-1]
                assert all(source.rstrip("/") in allowed for source in sources), (dockerfile.name, line)


def test_install_scripts_parse():
    for script in ("build-local-image.sh", "install-python-deps.sh"):
        shell = "bash" if script == "build-local-image.sh" else "sh"
        result = subprocess.run([shell, "-n", str(vd.DOCKER_DIR / script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


# --- Compose file --------------------------------------------------------------------------------------------


def test_compose_file_follows_the_rules():
    compose = yaml.safe_load(vd.COMPOSE_FILE.read_text())
    assert vd.compose_rule_problems(compose, "compose.yaml") == []
    assert {"postgres", "prefect-server", "mlflow", "minio", "qdrant"} <= set(compose["services"])


def test_compose_config_accepts_the_example_env():
    assert _tool_or_skip(vd.check_compose) == []


def test_compose_config_refuses_to_run_without_credentials(monkeypatch):
    for name in ("POSTGRES_USER", "POSTGRES_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    result = _tool_or_skip(vd.compose_config, vd.COMPOSE_FILE, Path("/dev/null"))
    assert result.returncode != 0 and "docker/.env" in result.stderr


def test_env_example_names_every_variable_of_the_compose_file():
    used = set(re.findall(r"\$\{([A-Z_]+)", vd.COMPOSE_FILE.read_text()))
    example = {line.split("=", 1)[0] for line in vd.COMPOSE_ENV_EXAMPLE.read_text().splitlines() if "=" in line}
    assert used <= example, used - example


def test_a_broken_compose_file_fails(tmp_path):
    broken = {
        "services": {
            "db": {
                "image": "postgres",
                "environment": {"POSTGRES_PASSWORD": "hunter2"},
                "ports": ["5432:5432"],
                "volumes": ["undeclared:/var/lib/postgresql/data"],
                "healthchek": {"test": ["CMD", "true"]},
            }
        }
    }
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    text = "\n".join(vd.compose_rule_problems(broken, "compose.yaml"))
    for expected in ("not pinned", "no healthcheck", "not declared", "not bound to 127.0.0.1", "POSTGRES_PASSWORD"):
        assert expected in text
    result = _tool_or_skip(vd.compose_config, path, Path("/dev/null"))
    assert result.returncode != 0 and "healthchek" in result.stderr


# --- PyTorchJob (multi-node training) ---


@pytest.mark.parametrize(("nodes", "gpus"), [(1, 8), (2, 8), (4, 1)])
def test_pytorchjob_renders_and_validates(nodes, gpus):
    assert vd.check_pytorchjob(nodes, gpus) == []


def test_pytorchjob_carries_the_rendezvous_image_and_entrypoint():
    from components.train import TrainSpec
    from flows.pytorchjob import render_pytorchjob
    from lopd_core.artifacts import ArtifactRef

    dataset = ArtifactRef(uri="s3://lopd/ds.jsonl", kind="dataset", sha256="0" * 64)
    spec = TrainSpec(run_dir="/runs/x", dataset=dataset, lopd={"method": "grpo"}, nproc=8,
                     schedule={"samples_per_task": 2, "tasks_per_step": 16})  # fmt: skip
    job = render_pytorchjob("train", spec, nodes=2, gpus_per_node=8, image="lopd-platform:gpu")
    assert vd.pytorchjob_problems(job) == []
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    assert job["spec"]["nprocPerNode"] == "8"
    (container,) = replicas["Worker"]["template"]["spec"]["containers"]
    assert container["image"] == "lopd-platform:gpu" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert "torch.distributed.run -m components.train --spec /tmp/spec.json" in container["command"][-1]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert TrainSpec.model_validate_json(env["LOPD_STAGE_SPEC"]) == spec
    with pytest.raises(ValueError, match="does not run data-parallel"):
        render_pytorchjob("collect", spec, 2, 8, "img")


def test_stage_job_is_what_the_train_stage_pod_submits(monkeypatch):
    """train.nodes > 1 under execution.mode=deployments: the stage flow renders one PyTorchJob per stage run, named
    after its cache key, whose ranks run `flows.stages` and whose rank 0 stores the result under that key."""
    from components.train import TrainSpec
    from flows.pytorchjob import stage_job
    from lopd_core.artifacts import ArtifactRef

    dataset = ArtifactRef(uri="s3://lopd/ds.jsonl", kind="dataset", sha256="0" * 64)
    spec = TrainSpec(run_dir="/runs/x", dataset=dataset, lopd={"method": "grpo"}, nproc=8, nodes=2,
                     schedule={"samples_per_task": 2, "tasks_per_step": 16})  # fmt: skip
    key, root = "ab" * 32, "s3://lopd-artifacts/runs/stage-cache"
    monkeypatch.delenv("LOPD_IMAGE", raising=False)
    with pytest.raises(ValueError, match="needs LOPD_IMAGE"):
        stage_job("train", spec, root, key)
    monkeypatch.setenv("LOPD_IMAGE", "registry.example.internal/lopd/lopd-platform:gpu")
    job = stage_job("train", spec, root, key)
    assert vd.pytorchjob_problems(job) == []
    assert job["metadata"]["name"] == f"lopd-train-{key[:12]}" and job["metadata"]["namespace"] == "lopd"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1 and job["spec"]["nprocPerNode"] == "8"
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.internal/lopd/lopd-platform:gpu"
    assert container["command"][-1].endswith(
        f"torch.distributed.run -m flows.stages train /tmp/spec.json /tmp/result.json --cache-root {root} "
        f"--cache-key {key}"
    )
    with pytest.raises(ValueError, match=r"below nodes x nproc = 2 x 8"):
        TrainSpec(**{**spec.model_dump(), "schedule": {"samples_per_task": 2, "tasks_per_step": 8}})


def test_job_phase_reads_the_training_operators_conditions():
    from flows.pytorchjob import job_phase

    def job(*conditions: tuple[str, str, str]) -> dict:
        return {"status": {"conditions": [{"type": t, "status": s, "message": m} for t, s, m in conditions]}}

    assert job_phase({}) == ("Pending", "")
    assert job_phase(job(("Created", "True", "created"))) == ("Created", "created")
    running = ("Created", "False", ""), ("Running", "True", "PyTorchJob lopd-train is running.")
    assert job_phase(job(*running)) == ("Running", "PyTorchJob lopd-train is running.")
    assert job_phase(job(*running, ("Restarting", "True", "a worker restarts")))[0] == "Restarting"
    done = ("Running", "False", ""), ("Succeeded", "True", "PyTorchJob lopd-train is successfully completed.")
    assert job_phase(job(*done))[0] == "Succeeded"
    failed = job(("Running", "False", ""), ("Failed", "True", "PyTorchJob lopd-train has failed: OOMKilled"))
    assert job_phase(failed) == ("Failed", "PyTorchJob lopd-train has failed: OOMKilled")


def test_stage_pods_may_submit_pytorchjobs_and_nothing_else():
    docs = vd.load_documents((vd.K8S_DIR / "base" / "stage-pods.yaml").read_text())
    assert {doc["kind"] for doc in docs} == {"ServiceAccount", "Role", "RoleBinding"}
    (role,) = [doc for doc in docs if doc["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"],
                              "verbs": ["get", "list", "watch", "create", "delete"]}]  # fmt: skip
    assert _template()["variables"]["properties"]["service_account_name"]["default"] == "lopd-stage"
    docs = vd.load_documents(vd.kustomize(vd.K8S_DIR / "overlays" / "gpu-cluster"))
    claim = next(doc for doc in docs if doc["kind"] == "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == "lopd-runs" and claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_broken_pytorchjob_fails():
    from flows.pytorchjob import render_pytorchjob

    job = render_pytorchjob("train", TrainStandIn(), 2, 8, "lopd-platform:gpu")
    job["spec"]["nprocPerNodes"] = "8"  # a typo: unknown field
    assert any("nprocPerNodes" in p for p in vd.pytorchjob_problems(job))
    job = render_pytorchjob("train", TrainStandIn(), 2, 8, "lopd-platform:gpu")
    job["spec"]["nprocPerNode"] = "4"  # torchrun's ranks differ from the GPUs the pod requests
    assert any("nprocPerNode 4 != GPUs 8" in p for p in vd.pytorchjob_problems(job))
    job = render_pytorchjob("train", TrainStandIn(), 2, 8, "lopd-platform:gpu")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "x"
    assert any("imagePullPolicyy" in p for p in vd.pytorchjob_problems(job))


class TrainStandIn(BaseModel):
    run_dir: str = "/runs/x"
