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

import copy
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
        template = {"metadata": {"labels": dict(labels)}, "spec": copy.deepcopy(pod_spec)}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": template}

    replicas = {"Master": replica(1)}
    if nodes > 1:
        replicas["Worker"] = replica(nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
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


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.pytorchjob SPEC.yaml --nodes 2 --gpus-per-node 8 --image IMAGE [--pvc lopd-runs]`: print
    the train stage's PyTorchJob as YAML (for `kubectl apply -f -`)."""
    import argparse

    import yaml

    from components.train import TrainSpec

    ap = argparse.ArgumentParser(prog="python -m flows.pytorchjob", description=main.__doc__)
    ap.add_argument("spec", help="the train stage's spec (YAML or JSON, as `python -m components.train --spec`)")
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--gpus-per-node", type=int, required=True)
    ap.add_argument("--image", required=True)
    ap.add_argument("--name", default="lopd-train")
    ap.add_argument("--namespace", default="lopd")
    ap.add_argument("--pvc", default="lopd-runs", help="a ReadWriteMany claim mounted at the spec's run_dir")
    args = ap.parse_args(argv)
    with open(args.spec) as fh:
        spec = TrainSpec.model_validate(yaml.safe_load(fh))
    spec = spec.model_copy(update={"nproc": args.gpus_per_node})
    job = render_pytorchjob("train", spec, args.nodes, args.gpus_per_node, args.image, args.name, args.namespace,
                            run_dir_claim=args.pvc)  # fmt: skip
    print(yaml.safe_dump(job, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
