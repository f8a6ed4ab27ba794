"""The stage specs a pipeline config builds: one builder per stage, each reading only `PipelineConfig` (and the
artifacts of the stages before it). `flows.pipeline` wires them into the DAG; a spec's JSON is its stage-cache key
(flows/cache.py), so what a builder copies from the config is what re-runs a stage when it changes."""

from __future__ import annotations

from typing import Any

from components.bank import BankSpec
from components.cold_start import ColdStartSpec
from components.collect import CollectSpec
from components.common import StageResult
from components.evaluate import EvaluateSpec
from components.sft import SFTSpec
from components.tracking import Tag
from components.train import TrainSpec
from flows.config import PipelineConfig
from flows.report import ARM_TAG, LABEL_TAG
from lopd_core.artifacts import ArtifactRef
from lopd_core.method_rules import METHOD_RULES
from lopd_core.methods import teacher_sync


def common_fields(cfg: PipelineConfig, parent_run_id: str, tags: dict[str, str]) -> dict[str, Any]:
    return {
        "run_dir": str(cfg.resolved_run_dir()),
        "artifact_root": cfg.resolved_artifact_root(),
        "tracking_uri": cfg.resolved_tracking_uri(),
        "experiment": cfg.experiment,
        "parent_run_id": parent_run_id,
        "tags": tags,
    }


def sft_spec(cfg: PipelineConfig, common: dict[str, Any], oracle: bool = False) -> SFTSpec:
    """The warm start; `oracle`: the same on rule-following demonstrations (the positive control's ceiling). A warm
    start whose demonstrations draw their codes uniformly (house_codes: uniform) is the same for every rule draw,
    so its spec names the draw-0 suite and one warm start (one stage-cache entry) serves every draw."""
    assert cfg.sft is not None
    codes = "correct" if oracle else cfg.sft.house_codes
    return SFTSpec(
        **common,
        backbone=cfg.backbone,
        suite=draw_free_suite(cfg.suite) if codes == "uniform" else cfg.suite,
        validation_fraction=cfg.validation_fraction,
        difficulties=cfg.train.difficulties,
        sft=cfg.sft.model_copy(update={"house_codes": "correct"}) if oracle else cfg.sft,
        threads=cfg.execution.warm_threads or cfg.threads,
        nproc=cfg.train.nproc,
    )


def draw_free_suite(suite: str) -> str:
    """A rules suite's name with the draw (seed) left out: `toolworld-rules-s1-digits` -> `toolworld-rules-digits`;
    another suite as it is."""
    from lopd_core.envs.toolworld.rules import parse_rules_name, rules_suite_name

    rules = parse_rules_name(suite)
    return suite if rules is None else rules_suite_name(0, rules.k, rules.style)


def collect_spec(cfg: PipelineConfig, common: dict[str, Any], warm: ArtifactRef | None = None) -> CollectSpec:
    c = cfg.collect
    return CollectSpec(
        **common,
        backbone=cfg.backbone,
        warm_start=warm,
        suite=cfg.suite,
        validation_fraction=cfg.validation_fraction,
        n_tasks=c.n_tasks,
        difficulties=c.difficulties,
        samples_per_task=c.samples_per_task,
        rollout=c.rollout,
        success_threshold=cfg.success_threshold,
        seed=c.seed,
        threads=cfg.threads,
    )


def bank_spec(cfg: PipelineConfig, common: dict[str, Any], dataset: ArtifactRef) -> BankSpec:
    return BankSpec(
        **common,
        dataset=dataset,
        suite=cfg.suite,
        bank_location=cfg.resolved_bank_location(),
        bank_name=cfg.bank.name,
        embedder=cfg.bank.embedder,
        success_threshold=cfg.success_threshold,
    )


def cold_start_spec(
    cfg: PipelineConfig,
    common: dict[str, Any],
    seed: int,
    dataset: ArtifactRef,
    snapshot: ArtifactRef,
    warm: ArtifactRef | None = None,
    arm: str = "lopd",
) -> ColdStartSpec:
    """The cold start of `arm`'s composer (PipelineConfig.arm_cold_start: arms with the same composer settings
    share one)."""
    lopd, cold = cfg.arm_cold_start(arm, seed)
    return ColdStartSpec(
        **common,
        backbone=cfg.backbone,
        warm_start=warm,
        suite=cfg.suite,
        dataset=dataset,
        bank_snapshot=snapshot,
        lopd=lopd,
        cold=cold,
        success_threshold=cfg.success_threshold,
        validation_fraction=cfg.validation_fraction,
        difficulties=cfg.train.difficulties,
        threads=cfg.execution.warm_threads or cfg.threads,
        nproc=cfg.train.nproc,
    )


def train_spec(
    cfg: PipelineConfig,
    common: dict[str, Any],
    arm: str,
    seed: int,
    dataset: ArtifactRef,
    snapshot: ArtifactRef,
    composer: ArtifactRef | None,
    warm: ArtifactRef | None = None,
) -> TrainSpec:
    """Only LOPD reads the bank and the composer: a baseline's training does not depend on them."""
    method_cfg, t = cfg.arm_config(arm)
    lopd = METHOD_RULES[method_cfg.method].reads_bank
    return TrainSpec(
        **{**common, "tags": {**common["tags"], ARM_TAG: arm}},
        backbone=cfg.backbone,
        warm_start=warm,
        suite=cfg.suite,
        validation_fraction=cfg.validation_fraction,
        dataset=dataset,
        bank_snapshot=snapshot if lopd else None,
        composer=composer if lopd else None,
        lopd=method_cfg.model_copy(update={"seed": seed}),
        schedule=t.schedule,
        rollout=t.rollout,
        n_train_tasks=t.n_train_tasks,
        difficulties=t.difficulties,
        probe_tasks=cfg.cold_start.probe_tasks if lopd else 0,
        threads=cfg.threads,
        nproc=t.nproc,
        nodes=t.nodes,
    )


def evaluate_spec(
    cfg: PipelineConfig,
    common: dict[str, Any],
    label: str,
    method: str,
    seed: int | None,
    train: StageResult | None,
    bank: StageResult | None,
    warm: ArtifactRef | None = None,
    arm: str | None = None,
    dataset: ArtifactRef | None = None,
) -> EvaluateSpec:
    ev = cfg.evaluate
    checkpoint = train.artifacts["checkpoint"].to_dict() if train else None
    rules = METHOD_RULES.get(method)  # None for the warm start ("base") and the oracle
    latent = (ev.latent_eval or ev.teacher_eval) and rules is not None and rules.reads_bank and bank is not None
    # a text teacher that acts with its context: a frozen one (an EMA teacher is not restored for acting: LoRA's
    # teacher adapter would be re-copied from the student, and full fine-tuning's moved backbone is not wired yet)
    text_teacher = ev.teacher_eval and rules is not None and rules.acting_teacher and \
        teacher_sync(cfg.arm_config(arm or method)[0]) == "frozen"  # fmt: skip
    tags = {**common["tags"], "method": method, LABEL_TAG: label, ARM_TAG: arm or method}
    if seed is not None:
        tags["seed"] = str(seed)
    if train is not None and train.mlflow_run_id:
        tags[Tag.TRAIN_RUN] = train.mlflow_run_id
    return EvaluateSpec(
        backbone=cfg.backbone,
        warm_start=warm.to_dict() if warm is not None else None,
        validation_fraction=cfg.validation_fraction,
        checkpoint=checkpoint,
        name=label,
        benchmarks=ev.benchmarks,
        decoding=ev.decoding,
        rollout=ev.rollout,
        seed=ev.seed,
        latent_eval=latent,
        bank=bank.artifacts["bank_snapshot"].to_dict() if latent and bank else None,
        teacher_eval=text_teacher,
        dataset=dataset.to_dict() if text_teacher and rules.reads_notes and dataset is not None else None,
        run_dir=common["run_dir"],
        artifact_root=common["artifact_root"],
        tracking=True,
        tracking_uri=common["tracking_uri"],
        experiment=common["experiment"],
        parent_run_id=common["parent_run_id"],
        tags=tags,
        threads=cfg.threads,
    )
