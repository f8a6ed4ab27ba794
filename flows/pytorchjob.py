"""Multi-node training as a Kubeflow Training Operator `PyTorchJob` (kubeflow.org/v1), rendered per stage run.

    job = render_pytorchjob("train", spec, nodes=2, gpus_per_node=8, image="registry.example.internal/lopd:gpu")
    result = run_pytorchjob_stage(spec, cache_root, cache_key)     # what the lopd-stage flow does for nodes > 1

One Master and `nodes - 1` Workers, each a pod that requests `gpus_per_node` GPUs and runs the stage under
torchrun. The operator injects the rendezvous (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
PET_MASTER_ADDR/PORT), which torchrun reads; `nprocPerNode` is the same number as the GPU request. The stage's
spec travels as JSON in an environment variable and is written to /tmp in the pod; the run directory
(checkpoints) must be shared storage that every pod mounts (`run_dir_claim`, a ReadWriteMany PVC).

Two ways to start it:
- from Prefect: a train stage with `nodes > 1` (the form's `train.nodes`, execution.mode=deployments). The stage
  deployment's flow run renders the job for its spec and cache key, creates it through the Kubernetes API,
  polls its conditions until Succeeded or Failed, and returns the result that rank 0 stored in the stage cache
  (the pods run `python -m flows.stages train ... --cache-root ROOT --cache-key KEY`);
- by hand: `python -m flows.pytorchjob SPEC --nodes 2 --gpus-per-node 8 --image IMAGE | kubectl apply -f -`,
  whose rank 0 writes its result to `run_dir/result.json`.

Validated offline (scripts/validate_deploy.py, tests/test_deploy_manifests.py): each replica's pod template as
a core/v1 Pod with kubernetes-validate in strict mode, and the PyTorchJob's own fields against
k8s/schemas/pytorchjob-v1.json (the subset of the CRD's schema that we render; the upstream CRD is not vendored).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shlex
import time
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
    cache: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The PyTorchJob of one data-parallel stage run over `nodes` x `gpus_per_node` ranks. `cache` = (stage
    cache root, key): rank 0 stores its result there (a run submitted by the stage flow); else in
    `run_dir/result.json`."""
    if stage not in STAGE_MODULES:
        raise ValueError(f"stage {stage!r} does not run data-parallel (only {', '.join(STAGE_MODULES)})")
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"nodes={nodes} and gpus_per_node={gpus_per_node} must both be >= 1")
    run_dir = getattr(spec, "run_dir", "runs/local")
    name = name or f"lopd-{stage}"
    if cache is None:
        entry = f"-m {STAGE_MODULES[stage]} --spec /tmp/spec.json --out {run_dir}/{RESULT}"
    else:
        root, key = (shlex.quote(x) for x in cache)
        entry = f"-m flows.stages {stage} /tmp/spec.json /tmp/{RESULT} --cache-root {root} --cache-key {key}"
    script = f'printf %s "$LOPD_STAGE_SPEC" > /tmp/spec.json && exec python -m torch.distributed.run {entry}'
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


# ------------------------------------------------------------------------------ submitting it from the stage flow

GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
TERMINAL = ("Succeeded", "Failed")  # the Training Operator's JobConditionType values that end a job


class PyTorchJobError(RuntimeError):
    """The PyTorchJob failed, or did not finish in time."""


def job_phase(job: dict[str, Any]) -> tuple[str, str]:
    """(phase, message) of a PyTorchJob object from its `status.conditions` (the Training Operator's
    JobCondition: type Created | Running | Restarting | Suspended | Succeeded | Failed, status "True" when it
    holds). Succeeded or Failed when such a condition holds, else the newest condition that holds ("Pending"
    before the operator has written any)."""
    conditions = (job.get("status") or {}).get("conditions") or []
    holding = [c for c in conditions if str(c.get("status")) == "True"]
    for wanted in TERMINAL:
        for c in holding:
            if c.get("type") == wanted:
                return wanted, str(c.get("message") or c.get("reason") or "")
    if not holding:
        return "Pending", ""
    last = holding[-1]
    return str(last.get("type")), str(last.get("message") or last.get("reason") or "")


async def submit_and_wait(
    job: dict[str, Any], poll_s: float = 30.0, timeout_s: float | None = None, log: Any = print
) -> dict[str, Any]:
    """Create `job` through the Kubernetes API (in-cluster credentials, else the local kubeconfig), poll it until
    it succeeds (returns the final object) or fails (PyTorchJobError with the operator's message). A job that
    outlives `timeout_s` is deleted, so that its GPU pods do not linger, and is an error."""
    from kubernetes_asyncio import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    async with client.ApiClient() as api_client:
        api = client.CustomObjectsApi(api_client)
        await api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
        log(f"PyTorchJob {namespace}/{name} created")
        start, seen = time.monotonic(), None
        while True:
            current = await api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            phase, message = job_phase(current)
            if phase != seen:
                log(f"PyTorchJob {name}: {phase} {message}".rstrip())
                seen = phase
            if phase == "Succeeded":
                return current
            if phase == "Failed":
                raise PyTorchJobError(f"PyTorchJob {namespace}/{name} failed: {message} (kubectl -n {namespace} "
                                      f"logs -l training.kubeflow.org/job-name={name})")  # fmt: skip
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                await api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                raise PyTorchJobError(f"PyTorchJob {namespace}/{name} did not finish in {timeout_s:.0f} s; deleted")
            await asyncio.sleep(poll_s)


def stage_job(stage: str, spec: BaseModel, cache_root: str, cache_key: str) -> dict[str, Any]:
    """The PyTorchJob of one stage run with `spec.nodes` nodes x `spec.nproc` GPUs, as the stage flow submits it:
    named after the cache key, image, namespace and run-directory claim from the pod's environment
    (LOPD_IMAGE, LOPD_NAMESPACE, LOPD_RUNS_CLAIM: k8s/base/services-configmap.yaml)."""
    image = os.environ.get("LOPD_IMAGE")
    if not image:
        raise ValueError(
            "a multi-node stage needs LOPD_IMAGE (the image its PyTorchJob pods run) in the stage pod's environment: "
            "set it in the lopd-services ConfigMap (k8s/base/services-configmap.yaml)"
        )
    return render_pytorchjob(
        stage, spec, nodes=getattr(spec, "nodes", 1), gpus_per_node=getattr(spec, "nproc", 1), image=image,
        name=f"lopd-{stage.replace('_', '-')}-{cache_key[:12]}", namespace=os.environ.get("LOPD_NAMESPACE", "lopd"),
        run_dir_claim=os.environ.get("LOPD_RUNS_CLAIM", "lopd-runs"), cache=(cache_root, cache_key),
    )  # fmt: skip


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
