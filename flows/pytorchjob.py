"""Multi-node training as a Kubeflow Training Operator `PyTorchJob` (kubeflow.org/v1), rendered per stage run.

    job = render_pytorchjob("train", spec, nodes=2, gpus_per_node=8, image="registry.example.internal/lopd:gpu")

One Master and `nodes - 1` Workers, each a pod that requests `gpus_per_node` GPUs and runs the stage's own CLI
under torchrun (`torchrun -m components.train --spec ... --out ...`, the image's entrypoint module). The
operator injects the rendezvous (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT), which
torchrun reads; `nprocPerNode` is the same number as the GPU request. The stage's spec travels as JSON in an
environment variable and is written to /tmp in the pod; the run directory (checkpoints, the result that rank 0
writes, the stage cache) must be shared storage that every pod mounts (`run_dir_claim`, a ReadWriteMany PVC).

Validated offline (scripts/validate_deploy.py, tests/test_deploy_manifests.py): each replica's pod template as
a core/v1 Pod with kubernetes-validate in strict mode, and the PyTorchJob's own fields against
k8s/schemas/pytorchjob-v1.json (the subset of the CRD's schema that we render; the upstream CRD is not vendored).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

STAGE_MODULES = {"train": "components.train"}  # the stages that run data-parallel
RESULT = "result.json"


def render_pytorchjob(
    stage: str,
    spec: BaseModel,
    nodes: int,
    gpus_per_node: int,
    image: str,
    name: str | None = None,
    namespace: str = "lopd",
    run_dir_claim: str = "lopd-runs",
    cpu: str = "16",
    memory: str = "128Gi",
    shm_size: str = "32Gi",
    config_map: str = "lopd-services",
    secret: str = "lopd-s3",
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The PyTorchJob of one data-parallel stage run over `nodes` x `gpus_per_node` ranks."""
    if stage not in STAGE_MODULES:
        raise ValueError(f"stage {stage!r} does not run data-parallel (only {', '.join(STAGE_MODULES)})")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} must both be >= 1")
    run_dir = getattr(spec, "run_dir", "runs/local")
    name = name or f"lopd-{stage}"
    script = (
        'printf %s "$LOPD_STAGE_SPEC" > /tmp/spec.json && exec python -m torch.distributed.run '
        f"-m {STAGE_MODULES[stage]} --spec /tmp/spec.json --out {run_dir}/{RESULT}"
    )
    container = {
        "name": "pytorch",  # the name the Training Operator looks for
        "image": image,
        "command": ["/bin/sh", "-c", script],
        "env": [{"name": "LOPD_STAGE_SPEC", "value": json.dumps(spec.model_dump(mode="json"))}],
        "envFrom": [{"configMapRef": {"name": config_map}}, {"secretRef": {"name": secret}}],
        "resources": {
            "requests": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus_per_node},
            "limits": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": gpus_per_node},
        },
        "volumeMounts": [{"name": "runs", "mountPath": run_dir}, {"name": "dshm", "mountPath": "/dev/shm"}],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": run_dir_claim}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
        ],
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    labels = {"app.kubernetes.io/part-of": "lopd", "lopd/stage": stage}

    def replica(count: int) -> dict[str, Any]:
        return {"replicas": count, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": labels}, "spec": pod_spec}}  # fmt: skip

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "nprocPerNode": str(gpus_per_node),
            "runPolicy": {"backoffLimit": 2, "cleanPodPolicy": "None", "ttlSecondsAfterFinished": 86400},
            "pytorchReplicaSpecs": replicas,
        },
    }


def pod_documents(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Each replica's pod template as a core/v1 Pod (what kubernetes-validate can check strictly)."""
    out = []
    for role, replica in job["spec"]["pytorchReplicaSpecs"].items():
        template = replica["template"]
        metadata = {**template.get("metadata", {}), "name": f"{job['metadata']['name']}-{role.lower()}"}
        out.append({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})
    return out
