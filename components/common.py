"""What every stage component shares: the spec base class, suites by name, rollout settings, the CLI runner.

A stage is `fn(spec) -> result`, both pydantic models, so it runs the same in-process (the Prefect flow calls
the function), in a container or a Kubernetes pod (`python -m components.<stage> --spec spec.yaml`), and the
Prefect UI can render its parameters as a form. Results carry artifact references, never tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components.artifacts import ArtifactStore
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import apply_overrides, explain
from lopd_core.envs.base import Suite, WithValidation
from lopd_core.rollout import RolloutConfig

SpecT = TypeVar("SpecT", bound="StageSpec")


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutSpec(Model):
    """Generation settings for rollouts (lopd_core.rollout.RolloutConfig)."""

    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_turns: int = Field(8, ge=1)
    max_new_tokens: int = Field(256, ge=1)
    max_total_tokens: int = Field(4096, ge=64)
    batch_size: int = Field(8, ge=1)
    engine: Literal["hf", "vllm"] = "hf"  # "vllm": a vLLM worker process (lopd_core.vllm_engine; make venv-vllm)
    vllm_compile: bool = False  # vLLM: torch.compile (minutes to start, cached under the cache dir) vs eager
    vllm_kv_cache_mb: int = Field(512, ge=16)

    def config(self, seed: int, progress: bool = True) -> RolloutConfig:
        return RolloutConfig(**self.model_dump(), seed=seed, progress=progress)


class StageSpec(Model):
    """Where a stage writes and logs. Defaults: everything under `run_dir` (embedded, one machine)."""

    run_dir: str = "runs/local"
    artifact_root: str | None = None  # default <run_dir>/artifacts; s3://... at scale
    tracking_uri: str | None = None  # default $MLFLOW_TRACKING_URI, else sqlite in run_dir
    experiment: str = "lopd"
    parent_run_id: str | None = None  # the pipeline's MLflow run
    tags: dict[str, str] = Field(default_factory=dict)  # e.g. prefect.flow_run_id, prefect.flow_run_url

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
    with compact prompts / the environment's id only, for small students), "bfcl" (BFCL-v3 multi-turn), or
    "envscaler:<env_metadata.json>:<train_scenarios.json>[:<eval_scenarios.json>]" for EnvScaler files.

    `validation_fraction > 0` moves a stratified slice of the training split into a "validation" split
    (`lopd_core.envs.base.WithValidation`): training never sees it; hyperparameters are chosen on it."""
    suite = _open_suite(name)
    return WithValidation(suite, validation_fraction) if validation_fraction > 0 else suite


def _open_suite(name: str) -> Suite:
    from lopd_core.envs.toolworld import SUITES as TOOLWORLD_SUITES

    if name in TOOLWORLD_SUITES:
        from lopd_core.envs.toolworld import load_toolworld

        return load_toolworld(prompt=TOOLWORLD_SUITES[name])
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
        f"unknown suite {name!r}: use 'toolworld', 'toolworld-compact', 'toolworld-minimal', 'bfcl' or "
        "'envscaler:<env>:<train>[:<eval>]'"
    )


def load_stage_backbone(backbone: str, warm_start: ArtifactRef | None, store: ArtifactStore) -> tuple[Any, Any, str]:
    """(model, tokenizer, what was loaded): the backbone by name, or the warm start's model folder (sft stage)
    when one is given. The third value is the name or local folder, for checkpoints to record."""
    from lopd_core.backbone import load_backbone

    source = str(store.get(warm_start)) if warm_start is not None else backbone
    model, tokenizer = load_backbone(source)
    return model, tokenizer, source


def backbone_label(backbone: str, warm_start: ArtifactRef | None) -> str:
    """How runs name their backbone: `toolworld-1m`, or `toolworld-1m+sft:<digest>` for a warm start."""
    return f"{backbone}+sft:{warm_start.sha256[:12]}" if warm_start is not None else backbone


def run_stage_cli(spec_cls: type[SpecT], fn: Callable[[SpecT], StageResult], argv: list[str] | None = None) -> int:
    """`python -m components.<stage> [--spec FILE] [key=value ...] [--out FILE] [--print-spec]`."""
    doc = (sys.modules[fn.__module__].__doc__ or "").strip()
    parser = argparse.ArgumentParser(
        prog=f"python -m {fn.__module__}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Fields (key=value overrides use dotted names, e.g. lopd.top_m=10):\n" + _fields_help(spec_cls),
    )
    parser.add_argument("--spec", help="a YAML or JSON file with the stage's parameters")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (YAML values)")
    parser.add_argument("--out", help="write the result JSON here (it is always printed)")
    parser.add_argument("--print-spec", action="store_true", help="print the resolved spec as YAML and exit")
    args = parser.parse_args(argv)
    data: dict[str, Any] = {}
    if args.spec:
        path = Path(args.spec)
        if not path.exists():
            parser.error(f"spec file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
    try:
        apply_overrides(data, args.overrides)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        spec = spec_cls.model_validate(data)
    except ValidationError as exc:
        parser.error(f"invalid {spec_cls.__name__}:\n{explain(exc, spec_cls)}")
    if args.print_spec:
        print(yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False))
        return 0
    result = fn(spec)
    text = result.model_dump_json(indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def _fields_help(spec_cls: type[BaseModel], prefix: str = "") -> str:
    lines = []
    for name, field in spec_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and not issubclass(ann, StageResult):
            lines.append(_fields_help(ann, f"{prefix}{name}."))
            continue
        default = field.default if field.default is not None else "-"
        if field.default_factory is not None:
            default = "(empty)"
        lines.append(f"  {prefix}{name} = {json.dumps(default, default=str)}")
    return "\n".join(lines)


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
