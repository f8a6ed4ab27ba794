"""sft: the warm start. Supervised fine-tuning of the whole student on verified demonstrations of training tasks.

Demonstrations are the reference solutions of the suite's training split (minus the validation slice), replayed
through the suite's own episodes so they carry real tool results and the exact prompts of the student's
rollouts (`lopd_core.sft`); only replays that score 1.0 are kept. For the built-in toolworld suites,
`sft.pool_per_level` adds generator scenarios of the training distribution (per environment and difficulty),
disjoint from every shipped scenario by instance and by task text, so neither a held-out task nor a held-out
instance reaches the SFT data. On a suite with house rules (toolworld-rules) every demonstration obeys them when it
is verified; then, by default (`sft.house_codes: uniform`), its code is replaced by an alternative drawn uniformly
at random, so the warm start learns the rule's form and not its value (`correct` keeps the right codes: the oracle
warm start). Output: the trained model as a Hugging Face folder (artifact kind "model"), which later stages load
through their `warm_start` field, and the demonstrations (kind "dataset").

    python -m components.sft backbone=toolworld-1m suite=toolworld-compact sft.steps=600 sft.pool_per_level=400
"""

from __future__ import annotations

import random
import sys
import time

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
    run_stage_cli,
    start_rank,
    start_tracking,
    write_trajectories,
)
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import SFTConfig
from lopd_core.envs.base import Suite, Task


class SFTSpec(StageSpec):
    backbone: str = "toolworld-1m"
    warm_start: ArtifactRef | None = None  # continue from an earlier sft model instead of the plain backbone
    suite: str = "toolworld-compact"
    validation_fraction: float = Field(0.0, ge=0, lt=1)  # a slice of the training split never demonstrated
    difficulties: list[int] | None = None  # demonstrate only these difficulty levels
    sft: SFTConfig = SFTConfig()
    max_seq_len: int = Field(4096, ge=64)
    threads: int = Field(1, ge=1)
    # data-parallel ranks on this node (one per GPU): > 1 runs the stage under `torchrun --nproc-per-node nproc`
    # (lopd_core.sft splits every batch over the ranks); a stage already started by torchrun uses torchrun's world
    nproc: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ranks_have_work(self) -> SFTSpec:
        if self.sft.batch_size < self.nproc:
            raise ValueError(f"sft.batch_size={self.sft.batch_size} is below nproc={self.nproc}: every rank needs "
                             "a demonstration per step")  # fmt: skip
        return self


def pool_suite(suite_name: str, per_level: int, difficulties: list[int] | None) -> Suite:
    """The toolworld generator's extra training scenarios as a suite (their own task ids, split "train")."""
    from lopd_core.envs.toolworld import SUITES, is_toolworld, open_toolworld
    from lopd_core.envs.toolworld.generate import LEVELS, training_pool

    if not is_toolworld(suite_name):
        raise ValueError(f"sft.pool_per_level needs a toolworld suite ({', '.join(SUITES)}, toolworld-rules), "
                         f"not {suite_name!r}")  # fmt: skip
    levels = tuple(sorted(set(difficulties))) if difficulties else LEVELS
    if any(level > max(LEVELS) for level in levels):
        raise ValueError(f"the generator's levels are {LEVELS} (level {max(LEVELS)} holds 6 to 8 calls)")
    return open_toolworld(suite_name, items=training_pool(per_level, levels=levels))


def _tasks(suite: Suite, difficulties: list[int] | None) -> list[Task]:
    tasks = suite.tasks("train")
    return [t for t in tasks if difficulties is None or t.difficulty in set(difficulties)]


def run_sft(spec: SFTSpec) -> StageResult:
    # the stage's heavy imports load when it runs, so that `--help` stays fast

    from lopd_core.distributed import full_state_dict
    from lopd_core.sft import demonstration_stats, demonstrations, privileged_copies, sft

    if (launched := launched_ranks(spec, "components.sft", spec.nproc)) is not None:
        return launched
    world = start_rank(spec.threads, spec.sft.seed)
    cfg = spec.sft
    store = spec.store()
    suite = open_suite(spec.suite, spec.validation_fraction)
    tasks = _tasks(suite, spec.difficulties)
    if cfg.n_demonstrations is not None and cfg.n_demonstrations < len(tasks):
        tasks = sorted(random.Random(cfg.seed).sample(tasks, cfg.n_demonstrations), key=lambda t: t.task_id)
    t0 = time.time()
    demos, dropped = demonstrations(suite, tasks, cfg.answer)
    if cfg.pool_per_level:
        pool = pool_suite(spec.suite, cfg.pool_per_level, spec.difficulties)
        extra, extra_dropped = demonstrations(pool, pool.tasks("train"), cfg.answer)
        demos, dropped = demos + extra, dropped + extra_dropped
    rules = getattr(suite, "rules", None)  # toolworld-rules: verify, then randomise (DESIGN.md §9, pitfall 1)
    if rules is not None and cfg.house_codes == "uniform":
        rng = random.Random(cfg.seed + 2)
        demos = [rules.randomise(d, rng) for d in demos]
    recode = None
    if cfg.privileged_codes == "pool":  # only reading the shown solution predicts the code
        if rules is None:
            raise ValueError(f"sft.privileged_codes: pool draws house codes, and suite {spec.suite!r} has no house "
                             "rules: use a toolworld-rules suite, or privileged_codes: own")  # fmt: skip
        recode = lambda d, rng: rules.recode(d, rng.choice(rules.pool))  # noqa: E731
    demos = demos + privileged_copies(demos, cfg.privileged_fraction, cfg.seed, recode)
    if not demos:
        raise ValueError(
            f"no verified demonstrations in suite {spec.suite!r} (do its scenarios have reference solutions?)"
        )
    label = backbone_label(spec.backbone, spec.warm_start)
    tracking = start_tracking(spec, "sft", spec.suite, spec, backbone=label, seed=cfg.seed) if world.is_main \
        else NullRun()  # fmt: skip
    with tracking as run:  # MLflow from rank 0 only
        model, tok, _ = load_stage_backbone(spec.backbone, spec.warm_start, store)
        stats = demonstration_stats(demos)
        sink = run.metrics_sink()
        losses = sft(model, tok, demos, cfg, spec.max_seq_len, on_step=sink.log, world=world)
        sink.close()
        weights = full_state_dict(model) if world.active else None  # FSDP: every rank gathers the shards
        if not world.is_main:
            return other_rank_result("sft", cfg.steps)
        run.log_json({**stats, "dropped": dropped}, "demonstrations.json")
        out = spec.stage_dir("sft") / "model"
        model.save_pretrained(out, state_dict=weights)
        tok.save_pretrained(out)
        ref = store.put(out, "model", {"backbone": spec.backbone, "sft_steps": cfg.steps, "n_demos": len(demos)})
        data = store.put(write_trajectories(spec.stage_dir("sft") / "demonstrations.jsonl", demos), "dataset",
                         {"suite": spec.suite, "n": len(demos), "role": "demonstrations"})  # fmt: skip
        tail = losses[-min(20, len(losses)) :] if losses else [float("nan")]
        metrics = {
            "n_demonstrations": float(len(demos)),
            "n_dropped": float(len(dropped)),
            "nll_first": losses[0] if losses else float("nan"),
            "nll_last": sum(tail) / len(tail),
            "seconds": time.time() - t0,
        }
        run.log_metrics({k: v for k, v in metrics.items() if v == v})
        run.log_artifact_ref(ref)
        run.log_curves([["nll"], ["grad_norm"], ["lr"]])
    text = (f"sft: {cfg.steps} steps on {len(demos)} demonstrations ({len(dropped)} dropped), "
            f"NLL {metrics['nll_first']:.3f} -> {metrics['nll_last']:.3f} in {metrics['seconds']:.0f} s")  # fmt: skip
    return StageResult(stage="sft", artifacts={"model": ref, "dataset": data}, metrics=metrics,
                       mlflow_run_id=run.run_id, summary=text)  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_stage_cli(SFTSpec, run_sft))
