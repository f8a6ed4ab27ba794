"""cold-start: train the composer (encoder LoRA + QFormer) by latent-conditioned NLL of the base model's own
successes, backbone frozen (app. A.2); freeze it as the anchor phi_0 and cache c_phi0.

Each success retrieves J = 3 other successes from the bank snapshot (never its own task). Output: a weights
checkpoint (composer + anchor copy + the c_phi0 cache) that the train stage starts from, and the loss curve.

    python -m components.cold_start dataset=... bank_snapshot=... cold.steps=50
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from pydantic import Field, model_validator

from components.common import (
    NullRun,
    StageResult,
    StageSpec,
    backbone_label,
    launched_ranks,
    load_stage_backbone,
    other_rank_result,
    read_trajectories,
    run_stage_cli,
    start_rank,
    start_tracking,
)
from lopd_core.artifacts import ArtifactRef
from lopd_core.config import ColdStartConfig, LOPDConfig


class ColdStartSpec(StageSpec):
    backbone: str = "smollm2-135m"
    warm_start: ArtifactRef | None = None  # the sft stage's model (frozen here like any backbone)
    suite: str = "toolworld"
    dataset: ArtifactRef  # collect's trajectories (successes are used)
    bank_snapshot: ArtifactRef  # the experience memory the composer reads
    lopd: LOPDConfig = LOPDConfig()
    cold: ColdStartConfig = ColdStartConfig()
    success_threshold: float = Field(1.0, ge=0, le=1)
    # the latent-dependence probe's targets (cold.probe_tasks): the validation slice's tasks at these levels
    validation_fraction: float = Field(0.0, ge=0, lt=1)
    difficulties: list[int] | None = None
    threads: int = Field(1, ge=1)
    # data-parallel ranks on this node (one per GPU): > 1 runs the stage under `torchrun --nproc-per-node nproc`
    # (lopd_core.cold_start splits every batch over the ranks); a stage already started by torchrun uses its world
    nproc: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ranks_have_work(self) -> ColdStartSpec:
        if self.cold.batch_size < self.nproc:
            raise ValueError(f"cold.batch_size={self.cold.batch_size} is below nproc={self.nproc}: every rank needs "
                             "a record per step")  # fmt: skip
        return self


def cold_start(spec: ColdStartSpec) -> StageResult:
    # the stage's heavy imports load when it runs, so that `--help` stays fast

    from components.memory import open_snapshot
    from components.probe import house_rules, latent_probe_for
    from lopd_core.checkpoint import save_checkpoint
    from lopd_core.cold_start import cold_start as run_cold_start
    from lopd_core.latent_probe import LatentProbe
    from lopd_core.models import build_models
    from lopd_core.serialization import ChatSerializer

    if (launched := launched_ranks(spec, "components.cold_start", spec.nproc)) is not None:
        return launched
    world = start_rank(spec.threads, spec.lopd.seed)
    store = spec.store()
    successes = [t for t in read_trajectories(store.get(spec.dataset)) if t.reward >= spec.success_threshold]
    label = backbone_label(spec.backbone, spec.warm_start)
    labels = {"backbone": label, "seed": spec.lopd.seed, "bank_snapshot_id": spec.bank_snapshot.sha256[:16]}
    tracking = start_tracking(spec, "cold_start", spec.suite, spec, **labels) if world.is_main else NullRun()
    with tracking as run:  # MLflow from rank 0 only
        model, tok, source = load_stage_backbone(spec.backbone, spec.warm_start, store)
        models = build_models(model, tok, spec.lopd)
        where = "cold_start" + (f"/rank{world.rank}" if world.rank else "")  # one restored copy per rank
        serializer = ChatSerializer(tok, spec.lopd.max_seq_len)
        rules = house_rules(spec.suite)
        if spec.cold.relabel_codes != "none" and rules is None:
            raise ValueError(f"cold.relabel_codes={spec.cold.relabel_codes} rewrites house codes, and suite "
                             f"{spec.suite!r} has none: use a toolworld-rules suite or relabel_codes=none")  # fmt: skip
        relabel = rules.relabeller(spec.cold.relabel_codes) if rules and spec.cold.relabel_codes != "none" else None
        probes: list[LatentProbe] = []
        with open_snapshot(spec, spec.bank_snapshot, where) as bank:
            scoped = spec.lopd.retrieval_scope == "environment"
            env_of = {t.task_id: t.env_id for t in successes}.get if scoped else None
            retrieve = bank.retriever(k=spec.lopd.n_retrieved, env_of=env_of)
            on_probe = None
            where_probe = (spec.suite, spec.validation_fraction, spec.difficulties)
            probe = latent_probe_for(*where_probe, spec.cold.probe_tasks, spec.lopd.seed, bank, spec.lopd.n_retrieved) \
                if world.is_main else None  # fmt: skip
            if probe is not None:

                def on_probe(step: int) -> None:
                    probes.append(probe(models, serializer))
                    run.log_metrics(probes[-1].metrics(), step=step)

            t0 = time.time()
            losses = run_cold_start(
                models, serializer, successes, retrieve, spec.lopd, spec.cold,
                on_step=(lambda i, loss: run.log_metrics({"nll": loss}, step=i)) if world.is_main else None,
                success_threshold=spec.success_threshold, world=world, relabel=relabel, on_probe=on_probe,
                probe_every=spec.cold.probe_every, token_marks=rules.spans if rules else None,
            )  # fmt: skip
        if not world.is_main:
            return other_rank_result("cold_start", len(losses))
        path = save_checkpoint(
            Path(spec.stage_dir("cold_start")) / "composer", models, None,
            {"step": 0, "backbone": source, "role": "cold_start", "config": spec.lopd.model_dump(mode="json"),
             "losses": losses, "n_records": len(successes),
             "probe": probes[-1].metrics() if probes else None},  # the train stage logs it beside its own
        )  # fmt: skip
        ref = store.put(path, "checkpoint", {"role": "cold_start", "backbone": label})
        metrics = {
            "nll_first": losses[0] if losses else float("nan"),
            "nll_last": losses[-1] if losses else float("nan"),
            "n_records": float(len(successes)),
            "anchor_cache": float(len(models.composer.anchor_cache)),
            "seconds": time.time() - t0,
            **(probes[-1].metrics() if probes else {}),
        }
        run.log_metrics({k: v for k, v in metrics.items() if v == v and not k.startswith("probe_")})  # probes: logged
        run.log_checkpoint(ref)
    text = (f"cold-start: {len(losses)} steps on {len(successes)} successes, "
            f"NLL {metrics['nll_first']:.3f} -> {metrics['nll_last']:.3f}")  # fmt: skip
    if probes:
        text += f"; latent probe {probes[-1].summary()}"
    return StageResult(stage="cold_start", artifacts={"composer": ref}, metrics=metrics, mlflow_run_id=run.run_id,
                       summary=text)  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_stage_cli(ColdStartSpec, cold_start))
