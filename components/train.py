"""train: Algorithm 1 for LOPD or a baseline: student rollouts -> verify -> one joint step -> checkpoints.

Starts from the cold-start composer (LOPD), reads the bank snapshot for retrieval (never a task's own
entries), logs every step to MLflow (margin, beta, reward, ...) and checkpoints every `schedule.
checkpoint_every` steps. Re-running the same spec resumes from the last checkpoint and continues exactly.

    python -m components.train lopd.method=lopd dataset=... bank_snapshot=... composer=... schedule.steps=20
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from components.common import (
    NullRun,
    StageResult,
    StageSpec,
    backbone_label,
    launched_ranks,
    load_stage_backbone,
    open_suite,
    other_rank_result,
    read_trajectories,
    run_stage_cli,
    start_rank,
    start_tracking,
)
from lopd_core import skills
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import LOPDConfig, RolloutConfig, ScheduleConfig
from lopd_core.method_rules import METHOD_RULES

logger = logging.getLogger(__name__)
RANK_SEED_STRIDE = 1_000_000_007  # rollout seeds of rank r are offset by r * this
RUN_ID_FILE = "mlflow_run_id"  # the MLflow run of this arm, written when it starts: a rerun continues it


class TrainSpec(StageSpec):
    backbone: str = "smollm2-135m"
    warm_start: ArtifactRef | None = None  # the sft stage's model: the student's (and teacher's) starting weights
    suite: str = "toolworld"
    validation_fraction: float = Field(0.0, ge=0, lt=1)  # a slice of the training split never trained on
    dataset: ArtifactRef  # collect's trajectories: solutions (OPSD, SDFT) and skill notes (Skill-SD)
    bank_snapshot: ArtifactRef | None = None  # LOPD's experience memory
    composer: ArtifactRef | None = None  # cold-start output (LOPD)
    lopd: LOPDConfig = LOPDConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    rollout: RolloutConfig = RolloutConfig()
    n_train_tasks: int | None = Field(None, ge=1)  # restrict to a seeded sample of the training split
    difficulties: list[int] | None = None
    # the latent-dependence probe of the trained teacher (components.probe; LOPD on a suite with house rules): how many
    # validation tasks it scores at the end of training (0: none)
    probe_tasks: int = Field(48, ge=0)
    resume: bool = True  # continue from this spec's last checkpoint when there is one
    # start the student from a trained run's student (its train checkpoint; the weights only, not the optimizer,
    # composer or teacher): a re-train of a trained student on new rules or a grown bank (flows/era.py)
    init_student: ArtifactRef | None = None
    # the text teachers' solutions (OPSD, SDFT): the dataset's verified successes, and for a task without one the
    # suite's reference solution replayed (true) or nothing: that task gives no distillation signal (false; the era
    # shift's re-train, where the reference would hand the teacher the new rules)
    reference_solutions: bool = True
    threads: int = Field(1, ge=1)
    # data-parallel ranks on this node (one per GPU): > 1 runs the stage under `torchrun --nproc-per-node nproc`
    # (lopd_core.distributed); a stage already started by torchrun (a PyTorchJob pod) uses torchrun's world
    nproc: int = Field(1, ge=1)
    # nodes of a multi-node run, each with nproc ranks: > 1 runs as a Kubeflow PyTorchJob that the stage deployment
    # submits (flows.pytorchjob; execution.mode=deployments), or that `python -m flows.pytorchjob` renders
    nodes: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _needs(self) -> TrainSpec:
        name, method = self.lopd.method, METHOD_RULES[self.lopd.method]
        if method.reads_bank and (self.bank_snapshot is None or self.composer is None):
            raise ValueError(f"method {name!r} needs bank_snapshot (bank stage) and composer (cold-start stage)")
        method.check_group(name, self.schedule.samples_per_task)
        ranks = self.nproc * self.nodes
        if self.schedule.tasks_per_step < ranks:
            where = f"nproc={self.nproc}" if self.nodes == 1 else f"nodes x nproc = {self.nodes} x {self.nproc}"
            raise ValueError(f"schedule.tasks_per_step={self.schedule.tasks_per_step} is below {where}: "
                             "every data-parallel rank needs at least one task per step")  # fmt: skip
        return self

    def method_config(self) -> LOPDConfig:
        """`lopd` with GRPO's `baseline.policy_temperature` resolved: null = the rollouts' temperature (1.0 when
        they are greedy), so the policy gradient is that of the policy that sampled."""
        if self.lopd.baseline.policy_temperature is not None:
            return self.lopd
        temperature = self.rollout.temperature if self.rollout.temperature > 0 else 1.0
        baseline = self.lopd.baseline.model_copy(update={"policy_temperature": temperature})
        return self.lopd.model_copy(update={"baseline": baseline})


def _tasks(spec: TrainSpec, suite) -> list:  # type: ignore[no-untyped-def]
    import random

    tasks = suite.tasks("train")
    if spec.difficulties is not None:
        tasks = [t for t in tasks if t.difficulty in set(spec.difficulties)]
    if spec.n_train_tasks is not None and spec.n_train_tasks < len(tasks):
        tasks = sorted(random.Random(spec.lopd.seed).sample(tasks, spec.n_train_tasks), key=lambda t: t.task_id)
    return tasks


def _check_bank_size(count: int, cfg: LOPDConfig, snapshot: ArtifactRef) -> None:
    """LOPD's teacher reads the bank's successes: one too small to fill a retrieval's J slots is an error
    unless `lopd.min_bank_size` allows it (0: any bank, even an empty one)."""
    if not METHOD_RULES[cfg.method].reads_bank:
        return
    minimum = cfg.n_retrieved if cfg.min_bank_size is None else cfg.min_bank_size
    if count < minimum:
        raise ValueError(
            f"bank snapshot {snapshot.uri} holds {count} entries, fewer than LOPD needs ({minimum}: lopd."
            f"min_bank_size, by default n_retrieved = J): its teacher would read placeholder items instead of past "
            f"successes. Fill the bank (collect more successes, or lower the bank stage's success_threshold), or "
            f"set lopd.min_bank_size={count} to train with it anyway"
        )
    if count < cfg.n_retrieved:
        logger.warning(
            "bank snapshot %s holds %d entries, fewer than n_retrieved=%d (allowed by lopd.min_bank_size=%d): "
            "LOPD's teacher reads placeholder items for the missing ones (n_placeholder_experiences)",
            snapshot.uri,
            count,
            cfg.n_retrieved,
            minimum,
        )


@dataclass
class _Setup:
    """What a train run starts from: its config, tasks and teacher texts, the checkpoint it resumes, its models."""

    cfg: LOPDConfig
    suite: Any
    tasks: list
    solutions: dict
    notes: dict
    run_name: str
    ckpt_dir: Path
    saved: dict | None  # the last checkpoint's state.json when resuming
    models: Any  # lopd_core.models.LOPDModels
    source: str  # where the backbone came from (logged with the checkpoint)
    cold_probe: dict  # the cold start's latent-dependence probe, `cold_probe_*` (LOPD on a suite with house rules)


def train(spec: TrainSpec) -> StageResult:
    """Algorithm 1, top to bottom: set up, open the bank, build the step and its rollouts, loop, report."""
    from lopd_core.training import train_loop

    if (launched := launched_ranks(spec, "components.train", spec.nproc, spec.nodes)) is not None:
        return launched
    world = start_rank(spec.threads, spec.lopd.seed)
    run_setup = _set_up(spec)
    cfg, store = run_setup.cfg, spec.store()
    label = backbone_label(spec.backbone, spec.warm_start)
    with contextlib.ExitStack() as scope:  # the bank's lock and the rollout engine, released however the run ends
        bank = _open_bank(spec, cfg, run_setup.run_name, world, scope)
        labels = {"method": cfg.method, "seed": cfg.seed, "backbone": label,
                  "bank_snapshot_id": spec.bank_snapshot.sha256[:16] if spec.bank_snapshot else None}  # fmt: skip
        # the run to continue: the checkpoint's, else the one a run cut before its first checkpoint started
        run_file = run_setup.ckpt_dir / RUN_ID_FILE
        resume_id = run_setup.saved.get("mlflow_run_id") if run_setup.saved else None
        if resume_id is None and spec.resume and run_file.exists():
            resume_id = run_file.read_text().strip() or None
        t0 = time.time()
        tracking = start_tracking(spec, "train", spec.suite, spec, resume_run_id=resume_id, **labels) \
            if world.is_main else NullRun()  # fmt: skip
        with tracking as run:  # MLflow from rank 0 only
            if world.is_main:
                run_setup.ckpt_dir.mkdir(parents=True, exist_ok=True)
                run_file.write_text(run.run_id)
            sink = run.metrics_sink()
            step = _step(spec, run_setup, bank, sink)
            rollout = _rollouts(spec, run_setup, step, world, scope)
            if run_setup.saved is not None:  # the steps this checkpoint covers, re-sent where the store lacks them
                for row in run_setup.saved["history"]:
                    sink.log(int(row["step"]), {k: v for k, v in row.items() if k not in ("step", "generations_total")})
                sink.flush()
            extra = {"backbone": run_setup.source, "mlflow_run_id": run.run_id,
                     "bank_snapshot": spec.bank_snapshot.sha256 if spec.bank_snapshot else None}  # fmt: skip

            def on_checkpoint(path: Path, n: int) -> None:
                run.log_checkpoint(store.put(path, "checkpoint", {"method": cfg.method, "step": n}), n)

            out = train_loop(step, run_setup.tasks, rollout, spec.schedule, run_setup.ckpt_dir, extra_state=extra,
                             on_checkpoint=on_checkpoint, before_checkpoint=lambda n: sink.flush())  # fmt: skip
            sink.close()
            if not world.is_main:
                return other_rank_result("train", out["steps_done"])
            probe = _probe(spec, run_setup, bank)
            if probe:  # the trained teacher's probe at the last step, the cold-started one's at the first
                run.log_metrics(probe, step=max(out["steps_done"] - 1, 0))
                run.log_metrics(run_setup.cold_probe, step=0)
            probe |= run_setup.cold_probe if probe else {}
            return _report(spec, run_setup, run, out, label, time.time() - t0, probe)


def _set_up(spec: TrainSpec) -> _Setup:
    """The method config, tasks, the text teachers' solutions and notes, the checkpoint to resume, the models (with
    the cold-start composer for LOPD)."""
    from lopd_core.checkpoint import load_model_tensors
    from lopd_core.models import build_models
    from lopd_core.sft import reference_traces

    cfg = spec.method_config()
    store = spec.store()
    suite = open_suite(spec.suite, spec.validation_fraction)
    tasks = _tasks(spec, suite)
    dataset = read_trajectories(store.get(spec.dataset))
    solved = {t.task_id for t in dataset if t.reward >= 1.0 and not t.failed and t.trace}
    # the text teachers' solutions where the model never solved a task: its reference solution, replayed (a trace)
    reads = "solutions" in METHOD_RULES[cfg.method].needs and spec.reference_solutions
    unsolved = [t for t in tasks if t.task_id not in solved] if reads else []
    solutions = skills.solutions(dataset, reference_traces(suite, unsolved))
    notes = skills.skill_notes(dataset)

    run_name = f"{cfg.method}-seed{cfg.seed}"
    ckpt_dir = spec.stage_dir("train") / run_name
    state_file = ckpt_dir / "last" / "state.json"
    saved = None
    if spec.resume and state_file.exists():
        saved = json.loads(state_file.read_text())
        before = LOPDConfig.model_validate(saved["config"]).flat()  # a setting added since takes its default
        # how the ranks share the work may change: checkpoints hold whole tensors (lopd_core.checkpoint)
        diff = sorted(k for k, v in cfg.flat().items() if before.get(k) != v and k != "data_parallel")
        if diff:
            raise ValueError(f"{ckpt_dir} was trained with another method config (differs in {diff}); "
                             "use the same lopd settings to resume, or another run_dir / resume=false")  # fmt: skip
    elif state_file.exists():
        raise FileExistsError(f"{ckpt_dir} already holds a run; set resume=true or use another run_dir")

    model, tok, source = load_stage_backbone(spec.backbone, spec.warm_start, store)
    models = build_models(model, tok, cfg)
    if spec.composer is not None:
        from safetensors.torch import load_file

        composer_dir = store.get(spec.composer)
        # full fine-tuning: the student keeps the backbone's (warm-start) weights
        load_model_tensors(models, load_file(str(composer_dir / "weights.safetensors")), student=False)
        models.composer.anchor_cache.load(composer_dir / "latent_cache.safetensors")
        cold_probe = json.loads((composer_dir / "state.json").read_text()).get("probe") or {}
    else:
        cold_probe = {}
    if spec.init_student is not None:  # a resumed run's own checkpoint replaces these weights later
        from safetensors.torch import load_file

        from lopd_core.checkpoint import load_student_weights

        load_student_weights(models, load_file(str(store.get(spec.init_student) / "weights.safetensors")))
    return _Setup(cfg, suite, tasks, solutions, notes, run_name, ckpt_dir, saved, models, source,
                  {f"cold_{k}": v for k, v in cold_probe.items()})  # fmt: skip


def _open_bank(spec: TrainSpec, cfg: LOPDConfig, run_name: str, world: Any, scope: contextlib.ExitStack) -> Any:
    """LOPD's experience memory (None for the baselines), locked in `scope` while this run reads it."""
    from components.memory import open_snapshot

    if spec.bank_snapshot is None:
        return None
    where = f"train/{run_name}" + (f"/rank{world.rank}" if world.rank else "")  # one restored copy per rank
    bank = scope.enter_context(open_snapshot(spec, spec.bank_snapshot, where))
    _check_bank_size(bank.count(), cfg, spec.bank_snapshot)
    return bank


def _step(spec: TrainSpec, s: _Setup, bank: Any, sink: Any) -> Any:
    """The method (context strategy + objective, `lopd_core.methods`) inside one `TrainStep`."""
    from lopd_core.serialization import ChatSerializer
    from lopd_core.step import TrainStep, build_method

    cfg = s.cfg
    env_of = {t.task_id: t.env_id for t in s.tasks}.get if cfg.retrieval_scope == "environment" else None
    retrieve = bank.retriever(k=cfg.n_retrieved, env_of=env_of) if bank is not None else None
    strategy, objective = build_method(
        s.models, cfg, retrieve=retrieve,
        solutions=lambda task_id: s.solutions.get(task_id, (None, ""))[0],
        skills=s.notes.get, source_env=retrieve.source_env if retrieve is not None else None,
    )  # fmt: skip
    return TrainStep(s.models, ChatSerializer(s.models.tokenizer, cfg.max_seq_len), strategy, objective, cfg, sink,
                     token_marks=getattr(s.suite, "rule_spans", None))  # fmt: skip


def _rollouts(spec: TrainSpec, s: _Setup, step: Any, world: Any, scope: contextlib.ExitStack) -> Any:
    """batch of tasks -> trajectories, from one engine for the whole run (`lopd_core.engines`: "hf" samples from
    the student itself; "vllm" holds a copy of its weights, loaded after every update and before the first
    rollout, since a checkpoint may have restored the weights after the engine started)."""
    from lopd_core.engines import make_engine

    models, seed0 = s.models, s.cfg.seed
    with step.gathered(), models.acting_student() as acting:
        engine = scope.enter_context(make_engine(acting, models.tokenizer, spec.rollout.seeded(seed0, progress=False)))
    synced = [False]

    def sync() -> None:
        with models.acting_student() as acting:
            engine.sync(acting)
        synced[0] = True

    if engine.holds_weights:
        step.after_update.append(sync)

    def rollout(batch):  # type: ignore[no-untyped-def]
        # a fresh, reproducible stream per step, and per rank (rank 0 draws the one-rank stream)
        seed = seed0 * 1_000_003 + step.step_index + world.rank * RANK_SEED_STRIDE
        if engine.holds_weights and not synced[0]:
            sync()
        engine.config = spec.rollout.seeded(seed, progress=False)
        return engine.run([s.suite.episode(t) for t in batch])

    return rollout


def _probe(spec: TrainSpec, s: _Setup, bank: Any) -> dict[str, float]:
    """The latent-dependence probe of the trained teacher (a teacher that reads latents, on a suite with house rules):
    its `probe_*` metrics, or none."""
    from components.probe import latent_probe_for
    from lopd_core.serialization import ChatSerializer

    if bank is None or not METHOD_RULES[s.cfg.method].reads_bank:
        return {}
    where = (spec.suite, spec.validation_fraction, spec.difficulties)
    probe = latent_probe_for(*where, spec.probe_tasks, s.cfg.seed, bank, s.cfg.n_retrieved)
    return probe(s.models, ChatSerializer(s.models.tokenizer, s.cfg.max_seq_len)).metrics() if probe else {}


def _report(
    spec: TrainSpec, s: _Setup, run: Any, out: dict, label: str, seconds: float, probe: dict[str, float]
) -> StageResult:
    """Rank 0's epilogue: the final checkpoint stored, the curves logged, the stage's metrics and summary."""
    cfg = s.cfg
    final = spec.store().put(s.ckpt_dir / "last", "checkpoint",
                             {"method": cfg.method, "seed": cfg.seed, "step": out["steps_done"], "backbone": label,
                              "generations": out["generations"]})  # fmt: skip
    run.log_curves()
    last = out["history"][-1] if out["history"] else {}
    metrics = {k: float(v) for k, v in last.items() if isinstance(v, (int, float))}
    n_reference = sum(source == "reference" for _, source in s.solutions.values())
    metrics.update(steps=float(out["steps_done"]), generations_total=float(out["generations"]), seconds=seconds,
                   solutions_from_reference=float(n_reference), **probe)  # fmt: skip
    (spec.stage_dir("train") / f"{s.run_name}.history.json").write_text(json.dumps(out["history"]))
    text = (f"{cfg.method} seed {cfg.seed}: {out['steps_done']} steps, {out['generations']} generations, "
            f"final reward {metrics.get('reward_mean', float('nan')):.3f}")  # fmt: skip
    return StageResult(stage="train", artifacts={"checkpoint": final}, metrics=metrics, mlflow_run_id=run.run_id,
                       summary=text)  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_stage_cli(TrainSpec, train))
