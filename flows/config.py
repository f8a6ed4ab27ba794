"""The pipeline's parameters: one typed model, shown by the Prefect UI as a form with the paper's defaults.

    cfg = PipelineConfig()                                             # paper defaults (J=3, K=32, M=20, ...)
    cfg = load_config("configs/demo.yaml", ["train.schedule.steps=3"])  # a preset plus dotted overrides

A sweep is `methods` x `seeds`: collect and bank run once, cold-start once per seed (LOPD only), train and
evaluate once per (method, seed), and the report compares them. Method hyperparameters live in `lopd` (every
field of `lopd_core.config.LOPDConfig`); the sweep sets `lopd.method` and `lopd.seed` per member.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from components.evaluate import GREEDY, BenchmarkSpec, DecodingSpec, EvalRollout
from lopd_core.config import (
    BaselineConfig,
    ColdStartConfig,
    LOPDConfig,
    LoraSpec,
    MethodName,
    OPDOptions,
    RolloutConfig,
    ScheduleConfig,
    SFTConfig,
    form_schema,
    load_model,
    set_dotted,
)
from lopd_core.method_rules import METHOD_RULES

Method = MethodName
RemoteStage = Literal["sft", "collect", "cold_start", "train", "evaluate"]
GPU_STAGES: tuple[str, ...] = ("sft", "collect", "cold_start", "train", "evaluate")
DEFAULT_DEPLOYMENTS = {
    "sft": "lopd-stage/sft-gpu-pod",
    "collect": "lopd-stage/collect-gpu-pod",
    "cold_start": "lopd-stage/cold-start-gpu-pod",
    "train": "lopd-stage/train-gpu-pod",
    "evaluate": "lopd-stage/evaluate-gpu-pod",
}


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=form_schema)


def _fold(schema: dict[str, Any]) -> None:
    """The Prefect form shows an object without `properties` as one JSON editor holding its default: rarely
    changed settings then take a few lines instead of a card per field. Pydantic still validates every field
    (the fields' descriptions stay in the model, the CLI help and `lopd run --print-config`)."""
    keep = {k: schema[k] for k in ("title", "description", "default") if k in schema}
    is_list = schema.get("type") == "array"
    schema.clear()
    schema.update(keep, type="array" if is_list else "object")
    schema["description"] = (keep.get("description", "").rstrip() + " Rarely changed: edit as JSON.").strip()


FOLDED: Any = _fold  # json_schema_extra of a folded field


def _fold_benchmarks(schema: dict[str, Any]) -> None:
    """Folded, with the default list shown (pydantic gives no default for a default_factory)."""
    _fold(schema)
    schema["default"] = [b.name for b in _default_benchmarks()]


class SweepLOPDConfig(LOPDConfig):
    """The method's hyperparameters as the pipeline takes them: `method` and `seed` are left out of the form,
    because the sweep sets them for every member (`methods`, `seeds`, `variants`)."""

    # Left out of the form and of the dump (exclude): a run request carrying them would fail the form's schema.
    method: SkipJsonSchema[MethodName] = Field(
        "lopd", exclude=True, description="Set per arm by the sweep (methods, variants)."
    )
    seed: SkipJsonSchema[int] = Field(0, exclude=True, description="Set per member by the sweep (seeds).")
    encoder_lora: LoraSpec = Field(
        LoraSpec(), description="LoRA of the experience encoder (the composer's).", json_schema_extra=FOLDED
    )
    student_lora: LoraSpec = Field(
        LoraSpec(), description="LoRA of the student (student_mode=lora).", json_schema_extra=FOLDED
    )
    baseline: BaselineConfig = Field(
        BaselineConfig(),
        description="Knobs of the baselines (GRPO clip and KL, teacher sync); LOPD ignores them.",
        json_schema_extra=FOLDED,
    )
    opd: OPDOptions = Field(
        OPDOptions(),
        description="The OPD family's options for every distillation method: divergence, distill_form, "
        "reward_aligned (docs/methods.md).",
        json_schema_extra=FOLDED,
    )


class CollectParams(Model):
    """The collect stage: the base model rolls out on training tasks; every trajectory is kept and verified."""

    n_tasks: int | None = Field(32, ge=1, description="Training tasks (a seeded sample of the split; null = all).")
    difficulties: list[int] | None = Field(None, description="Keep only these difficulty levels (null = all).")
    samples_per_task: int = Field(1, ge=1, description="Rollouts per task.")
    seed: int = Field(0, description="Task sample and sampling seed of the collection.")
    rollout: RolloutConfig = Field(
        RolloutConfig(), description="Generation settings of the collection rollouts.", json_schema_extra=FOLDED
    )


class BankParams(Model):
    """The experience memory the successes go into (and the composer retrieves from)."""

    location: str | None = Field(
        None, description='A directory (embedded Qdrant; default RUN_DIR/bank), ":memory:" or a Qdrant URL.'
    )
    name: str = Field("experience", description="Bank (collection) name.")
    embedder: str | None = Field(
        None, description="sentence-transformers model or hashing-DIM; default all-MiniLM-L6-v2 (offline)."
    )


class TrainParams(Model):
    """The train stage (Algorithm 1): student rollouts, verification, one joint step per batch."""

    schedule: ScheduleConfig = Field(
        ScheduleConfig(), description="The outer loop of Algorithm 1: steps, tasks and samples per step."
    )
    rollout: RolloutConfig = Field(
        RolloutConfig(),
        description="Generation settings of the student's training rollouts.",
        json_schema_extra=FOLDED,
    )
    n_train_tasks: int | None = Field(None, ge=1, description="Restrict to a seeded sample of the training split.")
    difficulties: list[int] | None = Field(None, description="Train only on these difficulty levels.")
    nproc: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks per node, one per GPU (torchrun --nproc-per-node), for the train stage, "
        "the sft warm start and the cold start; with mode=deployments their pods request this many GPUs. More nodes: "
        "docs/distributed.md (PyTorchJob).",
    )
    nodes: int = Field(
        1,
        ge=1,
        description="Nodes of the train stage, each running nproc ranks. More than 1 needs execution.mode="
        "deployments; the train stage's pod then submits a Kubeflow PyTorchJob (one Master, nodes - 1 Workers) and "
        "waits for it.",
    )


def _default_benchmarks() -> list[BenchmarkSpec]:
    return [BenchmarkSpec(name="toolworld"), BenchmarkSpec(name="bfcl"), BenchmarkSpec(name="humaneval")]


class EvalParams(Model):
    """The evaluate stage: the student alone (no context) on held-out tasks and benchmarks."""

    benchmarks: list[BenchmarkSpec] = Field(
        default_factory=_default_benchmarks,
        description="Held-out benchmarks, each {name, sample, split, ...} (components.evaluate.BenchmarkSpec); a bare "
        "name means {name: NAME}.",
        json_schema_extra=_fold_benchmarks,
    )
    decoding: DecodingSpec = Field(
        DecodingSpec(), description="Samples per code task for pass@k.", json_schema_extra=FOLDED
    )
    rollout: EvalRollout = Field(
        GREEDY,
        description="Decoding and limits of an evaluation episode (greedy unless it names a temperature).",
        json_schema_extra=FOLDED,
    )
    seed: int = Field(0, description="Task sample seed (the same tasks for every model).")
    base: bool = Field(True, description="Also evaluate the base model: the reference row of the table.")
    latent_eval: bool = Field(False, description="LOPD runs: also evaluate the latent teacher (a diagnostic).")
    teacher_eval: bool = Field(
        False,
        description="Distillation runs: also evaluate the teacher as a policy with its context (a diagnostic): LOPD's "
        "latent teacher (as latent_eval), the frozen text teacher of OPSD, SDFT and Skill-SD.",
    )

    @field_validator("benchmarks", mode="before")
    @classmethod
    def _bare_names(cls, value: Any) -> Any:
        """A benchmark may be given by its name alone: [toolworld, bfcl]."""
        return [{"name": v} if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @field_serializer("benchmarks")
    def _compact(self, benchmarks: list[BenchmarkSpec]) -> list[Any]:
        """Dumped the way one writes them: a bare name, or a mapping of the fields that differ from the defaults
        (the form's JSON editor and `--print-config` then show `toolworld`, not thirteen null keys)."""
        dumps = [b.model_dump(mode="json", exclude_defaults=True) | {"name": b.name} for b in benchmarks]
        return [d["name"] if len(d) == 1 else d for d in dumps]


class ExecutionParams(Model):
    """Where stages run, how failures are retried, and the stage cache."""

    mode: Literal["in_process", "subprocess", "deployments"] = Field(
        "in_process",
        description="in_process: every stage in the pipeline's process (local). subprocess: the GPU stages as "
        "child processes of this one, up to max_parallel at once (local, all cores busy). deployments: the GPU "
        "stages as runs of their own deployments (Kubernetes pods at scale), via run_deployment.",
    )
    max_parallel: int = Field(
        1,
        ge=1,
        description="With mode=subprocess: the cores the stages share (e.g. the machine's); a stage takes one per "
        "torch thread of each rank (threads x nproc), so max_parallel 2 runs two one-thread arms at once, or one "
        "two-thread warm start.",
    )
    warm_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the warm start (sft) and the composer's cold start, which run "
        "before the arms fan out: on a CPU machine they can take every core (default: threads). Rollouts keep "
        "`threads` (one is faster than two for a small model's generation).",
    )
    remote_stages: list[RemoteStage] = Field(
        default_factory=lambda: list(GPU_STAGES),
        description="With mode=subprocess or deployments: the stages run outside the pipeline's process.",
    )
    deployments: dict[str, str] = Field(
        default_factory=lambda: dict(DEFAULT_DEPLOYMENTS),
        description='Stage to deployment (\'flow/name\'), e.g. {"train": "lopd-stage/train-gpu-pod"}.',
    )
    job_variables: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Per stage (or "default"): work pool job variables, e.g. {"train": {"gpu_count": 8}}.',
    )
    retries: int = Field(2, ge=0, description="Retries of a stage that failed on a transient error.")
    retry_delay_s: float = Field(10.0, ge=0, description="First retry delay; doubles at each retry.")
    stage_timeout_s: float | None = Field(None, gt=0, description="Longest wait for a stage deployment run.")
    cache: bool = Field(True, description="Skip stages whose inputs, parameters and code are unchanged.")


class Variant(Model):
    """An extra arm of the sweep: a method with overrides of its own (e.g. the fig. 3 ablation: LOPD at another
    margin, or with a frozen composer). Overrides use dotted keys under `lopd.`, `train.` and `cold_start.` (an arm
    whose composer or cold start differs gets a cold start of its own)."""

    method: Method = Field(description="The method this arm runs.")
    overrides: dict[str, Any] = Field(default_factory=dict, description='e.g. {"lopd.margin_target": 0.0}')


OVERRIDE_ROOTS = ("lopd", "train", "cold_start")


class PipelineConfig(Model):
    """collect -> bank -> cold-start -> train -> evaluate -> report, for LOPD and baselines x seeds."""

    run_dir: str = Field("runs/local", description="Working directory of the pipeline (bank, stages, MLflow db).")
    artifact_root: str | None = Field(
        None,
        description="Artifact store: a directory or s3://... (default $LOPD_ARTIFACT_ROOT, else RUN_DIR/artifacts).",
    )
    tracking_uri: str | None = Field(
        None, description="MLflow store (default $MLFLOW_TRACKING_URI, else sqlite in run_dir)."
    )
    experiment: str = Field("lopd", description="MLflow experiment.")
    backbone: str = Field("smollm2-135m", description='"tiny" | "smollm2-135m" | a local Hugging Face folder.')
    suite: str = Field(
        "toolworld",
        description="Training suite: toolworld | toolworld-compact | toolworld-minimal | "
        "toolworld-rules[-sSEED][-kK][-digits] (the positive control: hidden house rules) | bfcl | "
        "envscaler:ENV:TRAIN[:EVAL].",
    )
    methods: list[Method] = Field(default_factory=lambda: ["lopd"], description="Methods of the sweep.")
    seeds: list[int] = Field(default_factory=lambda: [0], description="Training seeds of the sweep.")
    success_threshold: float = Field(1.0, ge=0, le=1, description="Reward that counts as a success (bank entry).")
    threads: int = Field(1, ge=1, description="torch threads per stage.")
    validation_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="A stratified slice of the training split held out of every training stage, to choose "
        "hyperparameters on (evaluate it with a benchmark whose split is validation). 0 = none.",
    )
    sft: SFTConfig | None = Field(
        None,
        description="The warm start: supervised fine-tuning on verified demonstrations before everything else; "
        "every later stage starts from its model, and the base row of the table is this warm start. null = none.",
    )
    oracle: bool = Field(
        False,
        description="A suite with house rules (toolworld-rules): also warm-start a student on rule-following "
        "demonstrations (sft.house_codes: correct) and score it beside the warm start: the ceiling's calibration row.",
    )
    draws: list[int] | None = Field(
        None,
        description="A study on a toolworld-rules suite: run it on each of these rule draws (the suite's seed), one "
        "warm start for all, a bank per draw, and report each draw and the draws pooled (lopd study). null = the "
        "suite's own draw only.",
    )
    budget: int | None = Field(
        None,
        ge=1,
        description="Equal generation budget per training run: each arm trains for ceil(budget / (tasks_per_step x "
        "samples_per_task)) steps, overriding train.schedule.steps. null = train.schedule.steps.",
    )
    overrides: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description='Per method or variant: dotted overrides of lopd.* and train.*, e.g. {"grpo": '
        '{"train.schedule.samples_per_task": 8, "lopd.student_lr": 0.001}}.',
    )
    variants: dict[str, Variant] = Field(
        default_factory=dict, description="Extra named arms beside `methods` (ablations), trained for every seed."
    )
    lopd: SweepLOPDConfig = Field(
        SweepLOPDConfig(),
        description="The method's hyperparameters (lopd_core.config.LOPDConfig, the paper's defaults) for every arm; "
        "the sweep sets the method and the seed of each member.",
    )
    collect: CollectParams = Field(CollectParams(), description=CollectParams.__doc__, json_schema_extra=FOLDED)
    bank: BankParams = Field(BankParams(), description=BankParams.__doc__)
    cold_start: ColdStartConfig = Field(
        ColdStartConfig(), description="Composer cold-start (app. A.2), LOPD only.", json_schema_extra=FOLDED
    )
    train: TrainParams = Field(TrainParams(), description=TrainParams.__doc__)
    evaluate: EvalParams = Field(EvalParams(), description=EvalParams.__doc__)
    execution: ExecutionParams = Field(ExecutionParams(), description=ExecutionParams.__doc__, json_schema_extra=FOLDED)

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.methods or not self.seeds:
            raise ValueError("the sweep needs at least one method and one seed")
        if len(set(self.methods)) != len(self.methods) or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"methods and seeds must not repeat: {self.methods}, {self.seeds}")
        clash = set(self.variants) & set(get_args(Method))
        if clash:
            raise ValueError(f"variant names must differ from method names: {sorted(clash)}")
        # Overrides of a method left out of `methods` stay allowed (`-s 'methods=[lopd]'` narrows a study config).
        unknown_arms = set(self.overrides) - {*get_args(Method), *self.variants}
        if unknown_arms:
            raise ValueError(f"overrides name arms that are neither methods nor variants: {sorted(unknown_arms)}")
        for arm, method in self.arms():
            _, train = self.arm_config(arm)  # validates every override
            rules = METHOD_RULES[method]
            if train.schedule.samples_per_task < rules.min_group:
                raise ValueError(
                    f"arm {arm!r} ({method}) needs train.schedule.samples_per_task >= {rules.min_group}: "
                    f"{rules.group_reason}; set it in overrides, e.g. overrides: "
                    f'{{{arm}: {{"train.schedule.samples_per_task": {max(rules.min_group, 4)}}}}}'
                )
        self._check_rules_benchmarks()
        if self.draws is not None and not self.suite.startswith("toolworld-rules"):
            raise ValueError(f"draws: rule draws need a toolworld-rules suite, got suite={self.suite!r}")
        if self.oracle and (self.sft is None or not self.suite.startswith("toolworld-rules")):
            given = f"sft={'set' if self.sft else 'null'}, suite={self.suite!r}"
            raise ValueError(f"oracle: the rule-following warm start needs sft and a suite with house rules "
                             f"(toolworld-rules), got {given}")  # fmt: skip
        remote_train = self.execution.mode == "deployments" and "train" in self.execution.remote_stages
        if self.train.nodes > 1 and not remote_train:
            raise ValueError(
                f"train.nodes={self.train.nodes} runs the train stage as a Kubeflow PyTorchJob, which only the train "
                "stage deployment submits: set execution.mode=deployments (with train in execution.remote_stages), "
                "or train.nodes=1 and train.nproc=N for one node"
            )
        unknown = set(self.execution.deployments) - set(GPU_STAGES)
        if unknown:
            raise ValueError(f"execution.deployments names unknown stages {sorted(unknown)}; stages: {GPU_STAGES}")
        return self

    # -- resolved locations (absolute, so that worker processes and pods agree)

    def resolved_run_dir(self) -> Path:
        return Path(self.run_dir).expanduser().resolve()

    def resolved_artifact_root(self) -> str:
        root = self.artifact_root or os.environ.get("LOPD_ARTIFACT_ROOT")
        if root and "://" in root:
            return root
        return str(Path(root).expanduser().resolve()) if root else str(self.resolved_run_dir() / "artifacts")

    def resolved_tracking_uri(self) -> str:
        from components.tracking import resolve_tracking_uri

        return resolve_tracking_uri(self.tracking_uri, self.resolved_run_dir())

    def resolved_bank_location(self) -> str:
        loc = self.bank.location
        if loc and (loc == ":memory:" or "://" in loc):
            return loc
        return str(Path(loc).expanduser().resolve()) if loc else str(self.resolved_run_dir() / "bank")

    def resolved(self) -> PipelineConfig:
        """The same config with absolute local paths (what a pipeline run saves for re-training)."""
        update: dict[str, Any] = {"run_dir": str(self.resolved_run_dir())}
        if self.artifact_root:
            update["artifact_root"] = self.resolved_artifact_root()
        if self.bank.location:
            update["bank"] = self.bank.model_copy(update={"location": self.resolved_bank_location()})
        return self.model_copy(update=update)

    def _check_rules_benchmarks(self) -> None:
        """A rules suite's held-out score must be on its own rules: an evaluation benchmark that names another
        draw, k or code style of toolworld-rules than `suite` would score the trained codes against other ones."""
        from lopd_core.envs.toolworld.rules import parse_rules_name

        trained = parse_rules_name(self.suite)
        for i, bench in enumerate(self.evaluate.benchmarks):
            scored = parse_rules_name(bench.name)
            if scored is not None and scored != trained:
                raise ValueError(
                    f"evaluate.benchmarks[{i}].name={bench.name!r} scores other house rules than suite={self.suite!r}: "
                    f"set both to the same toolworld-rules suite (overriding suite, override the benchmark list too)"
                )

    def for_draw(self, draw: int) -> PipelineConfig:
        """The same config on another rule draw: the suite, the benchmarks that score it and the bank (one per
        suite: components.bank.check_suite) follow the draw; the warm start does not depend on it (flows.specs)."""
        from lopd_core.envs.toolworld.rules import parse_rules_name, rules_suite_name

        rules = parse_rules_name(self.suite)
        if rules is None:
            raise ValueError(f"suite {self.suite!r} has no house rules to draw")
        suite = rules_suite_name(draw, rules.k, rules.style)
        benchmarks = [b.model_copy(update={"name": suite}) if b.name == self.suite else b
                      for b in self.evaluate.benchmarks]  # fmt: skip
        return self.model_copy(update={
            "suite": suite, "draws": None,
            "evaluate": self.evaluate.model_copy(update={"benchmarks": benchmarks}),
            "bank": self.bank.model_copy(update={"name": f"{self.bank.name}-s{draw}"}),
        })  # fmt: skip

    def for_era(self, era: int) -> PipelineConfig:
        """The same config after `era` changes of the house rules (`<suite>-era<era>`, flows/era.py): the suite and
        the benchmarks that score it follow; the bank stays (the eras of a suite share it, docs/memory.md "Eras")."""
        from lopd_core.envs.toolworld.rules import parse_rules_name, rules_suite_name

        rules = parse_rules_name(self.suite)
        if rules is None:
            raise ValueError(f"suite {self.suite!r} has no house rules to change: the era shift needs a "
                             "toolworld-rules suite, e.g. suite=toolworld-rules-s1-digits")  # fmt: skip
        if era <= rules.era:
            raise ValueError(f"era={era}: the suite {self.suite!r} is already at era {rules.era}; name a later one")
        if self.budget is None:
            raise ValueError("the era shift re-trains every arm at an equal generation budget: set budget (e.g. 800)")
        suite = rules_suite_name(rules.seed, rules.k, rules.style, era)
        data = self.model_dump(mode="json")
        data["evaluate"]["benchmarks"] = [{**b, "name": suite} if b["name"] == self.suite else b
                                          for b in data["evaluate"]["benchmarks"]]  # fmt: skip
        return PipelineConfig.model_validate({**data, "suite": suite, "draws": None})  # validated: what a stage reads

    def method_config(self, method: str, seed: int) -> LOPDConfig:
        """The method's LOPDConfig for `seed` (with the method's overrides; used for arms named by a method)."""
        return self.arm_config(method)[0].model_copy(update={"method": method, "seed": seed})

    @property
    def is_study(self) -> bool:
        """A comparison of methods (a warm start or an equal budget): the report gains the study section."""
        return self.sft is not None or self.budget is not None

    def arms(self) -> list[tuple[str, str]]:
        """(arm name, method) of the sweep: one arm per method, then the variants."""
        return [(m, m) for m in self.methods] + [(name, v.method) for name, v in self.variants.items()]

    def arm_config(self, arm: str) -> tuple[LOPDConfig, TrainParams]:
        """An arm's method config and train settings: lopd/train, then the method's overrides, then the variant's;
        with a budget, schedule.steps = ceil(budget / (tasks_per_step x samples_per_task))."""
        lopd, train, _ = self._arm(arm)
        return lopd, train

    def arm_cold_start(self, arm: str, seed: int) -> tuple[LOPDConfig, ColdStartConfig]:
        """The cold start an arm's composer comes from: LOPD's config for `seed` with the arm's composer settings
        (`method_rules.composer_fields`: the composer, its retrieval and the reader) and the arm's cold_start.*
        overrides. Arms that differ only in what training does (a margin, a frozen composer) share one."""
        from lopd_core.method_rules import composer_fields

        lopd, _, cold = self._arm(arm)
        base = self.method_config("lopd", seed)
        same = {f: getattr(lopd, f) for f in composer_fields() if getattr(lopd, f) != getattr(base, f)}
        return base.model_copy(update=same), cold

    def _arm(self, arm: str) -> tuple[LOPDConfig, TrainParams, ColdStartConfig]:
        method = self.variants[arm].method if arm in self.variants else arm
        data = {"lopd": self.lopd.model_dump(mode="json"), "train": self.train.model_dump(mode="json"),
                "cold_start": self.cold_start.model_dump(mode="json")}  # fmt: skip
        layers = [self.overrides.get(method, {})] if arm in self.variants else []
        layers += [self.overrides.get(arm, {})]
        if arm in self.variants:
            layers.append(self.variants[arm].overrides)
        for layer in layers:
            for key, value in layer.items():
                if key.split(".", 1)[0] not in OVERRIDE_ROOTS or "." not in key:
                    raise ValueError(f"override {key!r} of arm {arm!r}: keys are dotted under {OVERRIDE_ROOTS}")
                set_dotted(data, key, value)
        data["lopd"]["method"] = method
        try:
            lopd, train = LOPDConfig.model_validate(data["lopd"]), TrainParams.model_validate(data["train"])
            cold = ColdStartConfig.model_validate(data["cold_start"])
        except ValidationError as exc:
            raise ValueError(f"arm {arm!r}: invalid override:\n{exc}") from None
        if self.budget is not None:
            per_step = train.schedule.tasks_per_step * train.schedule.samples_per_task
            steps = -(-self.budget // per_step)
            every = min(train.schedule.checkpoint_every, steps)
            train = train.model_copy(
                update={"schedule": train.schedule.model_copy(update={"steps": steps, "checkpoint_every": every})}
            )
        return lopd, train, cold

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json", exclude_defaults=False), sort_keys=False)


CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
# The presets a run form offers: configs/<name>.yaml. tiny (the default a click starts) is a one-minute look at the
# plumbing; demo the positive control (a warm start built here, then GRPO beating it: ~10 min on 2 cores);
# study-rules / study-cpu the equal-budget studies (hours on a CPU); paper the paper's settings (GPUs).
Preset = Literal["tiny", "demo", "demo-smollm2", "study-rules", "study-cpu", "paper"]


def preset_config(preset: str, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """configs/<preset>.yaml plus `key=value` overrides (a bad preset or field is an error naming it)."""
    if preset not in get_args(Preset):
        raise ValueError(f"preset={preset!r}: choose one of {', '.join(get_args(Preset))} (configs/<preset>.yaml)")
    return load_config(CONFIG_DIR / f"{preset}.yaml", list(overrides))


def with_overrides(config: PipelineConfig, overrides: list[str] | tuple[str, ...] = ()) -> PipelineConfig:
    """`config` with dotted `key=value` overrides (validated again; errors name the field)."""
    if not overrides:
        return config
    data = config.model_dump(mode="json")
    return load_model(PipelineConfig, None, list(overrides), what="pipeline config", updates=data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """A PipelineConfig from a YAML file (optional) plus `key=value` overrides; errors name the file and field."""
    hint = " (presets are in configs/)"
    return load_model(PipelineConfig, path, overrides, what="pipeline config", missing_hint=hint)
