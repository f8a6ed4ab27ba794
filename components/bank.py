"""bank: put a dataset's successful trajectories into the experience memory and snapshot the new version.

Only training-split successes enter (the bank refuses evaluation data); re-ingesting is a no-op; the
snapshot is the artifact later stages name ("which bank did this model see").

    python -m components.bank dataset='{"uri": ..., "kind": "dataset", "sha256": ...}' bank_location=runs/local/bank
"""

from __future__ import annotations

import sys
from typing import Any

from pydantic import Field

from components.common import StageResult, StageSpec, open_suite, run_stage_cli, start_tracking
from lopd_core.artifacts import ArtifactRef


class BankSpec(StageSpec):
    dataset: ArtifactRef  # trajectories (collect's output)
    suite: str = "toolworld"  # its evaluation task ids are audited against the bank
    bank_location: str | None = None  # ":memory:", a directory (default <run_dir>/bank) or a Qdrant URL
    bank_name: str = "experience"
    embedder: str | None = None  # sentence-transformers model name/path; default all-MiniLM-L6-v2 (offline)
    success_threshold: float = Field(1.0, ge=0, le=1)


def bank(spec: BankSpec) -> StageResult:
    # the stage's heavy imports load when it runs, so that `--help` stays fast
    from components.memory import ExperienceBank, experiences_from_jsonl

    store = spec.store()
    location = spec.bank_location or str(spec.stage_dir("bank") / "store")
    with start_tracking(spec, "bank", spec.suite, spec) as run:
        path = store.get(spec.dataset)
        with open(path) as fh:
            records, errors, skipped = experiences_from_jsonl(
                fh, spec.success_threshold, source_run=str(spec.dataset.metadata.get("source_run", ""))
            )
        with ExperienceBank.open(location, spec.bank_name, spec.embedder, min_reward=spec.success_threshold) as b:
            check_suite(b, spec.suite, location, spec.bank_name)
            report = b.ingest(records)
            held_out = open_suite(spec.suite).tasks("eval")
            audit = b.audit(eval_task_ids=[t.task_id for t in held_out], eval_tasks=[t.instruction for t in held_out])
            if not audit.ok:
                raise ValueError(f"bank audit found evaluation data: {audit.to_dict()}")
            snapshot = b.snapshot(spec.stage_dir("bank") / "snapshots")
            ref = store.put(snapshot.uri, "bank_snapshot", snapshot.metadata)
            count, version = b.count(), b.version
        metrics = {"added": float(report.added), "duplicates": float(report.duplicates),
                   "moved_era": float(report.moved_era), "rejected": float(len(report.rejected)),
                   "invalid_lines": float(len(errors)),
                   "skipped_failures": float(skipped), "count": float(count), "version": float(version)}  # fmt: skip
        run.log_metrics(metrics)
        run.log_artifact_ref(ref)
    text = f"bank v{version}: {count} entries (+{report.added}, {report.duplicates} already there)"
    return StageResult(stage="bank", artifacts={"bank_snapshot": ref}, metrics=metrics, mlflow_run_id=run.run_id,
                       summary=text)  # fmt: skip


def check_suite(bank: Any, suite: str, location: str, name: str) -> None:
    """One suite per bank: entries of another suite (another rule draw or code style of toolworld-rules, another
    benchmark) would reach the cold start and the teacher's retrieval with their stale codes. The eras of one suite
    (`<suite>-era<n>`) share a bank: a later era's successes supersede an earlier one's in retrieval, environment by
    environment (docs/memory.md, "Eras")."""
    from lopd_core.envs.base import suite_era

    family = suite_era(suite)[0]
    stored = {e.metadata.get("suite") for e in bank.experiences()} - {None}
    others = sorted(s for s in stored if suite_era(s)[0] != family)
    if others:
        raise ValueError(
            f"bank {name!r} in {location} holds experiences of {', '.join(others)}, and this run's suite is "
            f"{suite!r}: one bank per suite. Use another run_dir, or another bank (bank.name=experience-{suite})"
        )


if __name__ == "__main__":
    sys.exit(run_stage_cli(BankSpec, bank))
