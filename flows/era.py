"""`lopd-era-shift`: re-training as the bank grows, where it matters (issue 43).

    lopd era-shift configs/era-shift.yaml            # era 0, the rule change, the students' new experience, re-trains

The scenario, on a toolworld-rules suite (docs/study.md, "Re-training as the bank grows"):

1. **Era 0.** The pipeline of the config (`lopd run`): a warm start, collection, the bank, cold starts and every
   (arm, seed) trained at the equal budget, evaluated and reported.
2. **The rules change.** Era `era` of the same suite (`<suite>-era<n>`, lopd_core/envs/toolworld/rules.py): half of
   the environments move to their other code, the rest keep theirs; tasks and splits stay.
3. **New experience, the way a user's arrives.** Every era-0 student collects on the new era; each collection goes
   through the bank stage into the same bank, where its successes carry the new era and supersede the old era's in
   their environments (docs/memory.md, "Eras").
4. **The re-train**, every arm from its own era-0 student (`TrainSpec.init_student`), at the config's budget, on
   the new era with the grown bank: each method as configured (LOPD with its era-0 cold start: no new cold start,
   no new labels) and, for every arm whose teacher reads the bank, `<arm> new cold start` (a cold start on the
   grown bank). OPSD's solutions are its student's verified successes of the new era only
   (`TrainSpec.reference_solutions` off): the suite's reference solution would hand its teacher the new rules for
   every task.
5. **The verdict** on the new era's held-out tasks, split into the environments whose code moved (shifted) and the
   rest: reward and rule pass per arm; each re-trained arm against its era-0 student on the same tasks (on shifted
   environments what the re-train recovered, on the rest what it forgot), with the environment-clustered bootstrap
   (flows/verdicts.py); the era-0 level on the shifted environments (the era-0 students on era 0) as the target.

Every stage goes through the stage cache. What the era-0 half produced and what the new era's collection grew are
written to `<run_dir>/era<n>/state.json` when first done: the bank has grown since, so replaying the era-0 bank
stage would snapshot the grown bank and re-train era 0 on it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from pydantic import BaseModel

from components.artifacts import ArtifactStore
from components.common import StageResult
from components.tracking import Tag, Tracker
from flows.config import PipelineConfig, Preset, preset_config, with_overrides
from flows.lifecycle import RunDirLock, stop_stages_on_sigterm
from flows.pipeline import (
    Grid,
    Outcome,
    _report_dir,
    _run,
    close_pipeline_run,
    closing,
    lopd_pipeline,
    open_pipeline_run,
    record_trained,
    stage_context,
    train_grid,
    ui_link,
)
from flows.report import ARM_TAG, ReportSpec
from flows.specs import bank_spec, cold_start_spec, collect_spec, common_fields, evaluate_spec, train_spec
from flows.verdicts import Episodes, _est, _signed, difference, paired, read_episodes, rule_rate
from lopd_core.artifacts import ArtifactRef
from lopd_core.evaluation.stats import mean_interval
from lopd_core.method_rules import METHOD_RULES

STATE_FILE = "state.json"
# The scenario on the study-rules preset (the deployment's and `lopd era-shift`'s default): the arms the issue names.
ERA_SHIFT = ("methods=[grpo, opsd, lopd]", "variants={}", "oracle=false", "evaluate.teacher_eval=false",
             "run_dir=runs/era-shift")  # fmt: skip
NEW_COLD_START = "new cold start"  # the suffix of the arm that re-trains LOPD with a cold start on the grown bank


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _key(text: str) -> tuple[str, int]:
    arm, seed = text.rsplit("|", 1)
    return arm, int(seed)


class EraZero(BaseModel):
    """What the era-shift reads of era 0 (saved in the state file)."""

    warm: dict[str, Any] | None
    dataset: dict[str, Any]
    bank: StageResult
    arms: dict[str, str]
    composers: dict[str, dict[str, Any]]
    trained: dict[str, StageResult]

    def student(self, arm: str, seed: int) -> StageResult:
        return self.trained[f"{arm}|{seed}"]

    def composer(self, arm: str, seed: int) -> ArtifactRef | None:
        ref = self.composers.get(f"{arm}|{seed}")
        return ArtifactRef.from_dict(ref) if ref else None

    @classmethod
    def of(cls, grid: Grid) -> EraZero:
        return cls(
            warm=grid.warm.to_dict() if grid.warm else None,
            dataset=grid.dataset.to_dict(),
            bank=grid.bank.result,
            arms=grid.arms,
            composers={f"{a}|{s}": c.to_dict() for (a, s), c in grid.composers.items()},
            trained={f"{a}|{s}": o.result for (a, s), o in grid.trained.items()},
        )

    @property
    def warm_ref(self) -> ArtifactRef | None:
        return ArtifactRef.from_dict(self.warm) if self.warm else None


# ------------------------------------------------------------------------------------------------- the flow


@flow(name="lopd-era-shift", log_prints=True)
def lopd_era_shift(
    preset: Preset = "study-rules",
    overrides: tuple[str, ...] = ERA_SHIFT,
    config: PipelineConfig | None = None,
    era: int = 1,
    retrain_now: bool = True,
) -> dict[str, Any]:
    """Era 0's pipeline, then a change of the house rules in half of the environments, the era-0 students' new
    experience through the bank, and every arm re-trained from its own student on the new era: reward and rule pass
    on the shifted and unshifted environments, each re-trained arm against its era-0 student (docs/study.md,
    "Re-training as the bank grows").

    Args:
        preset: The era-0 settings (configs/PRESET.yaml): a toolworld-rules suite with a budget (study-rules).
        overrides: Dotted key=value changes to the preset, one per item (default: the scenario's arms, GRPO, OPSD
            and LOPD, in runs/era-shift).
        config: Leave on None to run the preset. A whole era-0 config instead of it (the overrides still apply).
        era: The era the rules change to (the suite named SUITE-eraN, N = era).
        retrain_now: Re-train as soon as the bank has grown. Off: stop there, and let bank-watch see the growth and
            its automation start lopd-retrain on the run directory, which finishes the re-train (as in production).
    """
    cfg = preset_config(preset, overrides) if config is None else with_overrides(config, overrides)
    cfg1 = cfg.for_era(era)  # checks the suite and the budget
    with stop_stages_on_sigterm():
        state_path = cfg.resolved_run_dir() / f"era{era}" / STATE_FILE
        state = json.loads(state_path.read_text()) if state_path.exists() else {}
        if "era0" in state:  # a resumed era shift: the same arms and seeds, or its saved students do not fit
            saved = (state["era0"]["arms"], sorted({_key(k)[1] for k in state["era0"]["trained"]}))
            if saved != (dict(cfg.arms()), sorted(cfg.seeds)):
                raise ValueError(f"{state_path} holds an era shift of arms {saved[0]} and seeds {saved[1]}, not "
                                 f"{dict(cfg.arms())} and {cfg.seeds}: use another run_dir for these")  # fmt: skip
        if "era0" not in state:
            lopd_pipeline.with_options(flow_run_name="era 0")(config=cfg)
        return _era_shift(cfg, cfg1, era, state, state_path, retrain_now)


def _stages(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [{"stage": o.stage, "label": o.label, "cached": o.cached} for o in outcomes]


def pending_era(run_dir: Path) -> int | None:
    """The era whose bank has grown and whose re-train has not run in `run_dir` (lopd-retrain finishes it)."""
    for path in sorted(run_dir.glob(f"era*/{STATE_FILE}")):
        state = json.loads(path.read_text())
        if "grown" in state and not state.get("done"):
            return int(path.parent.name.removeprefix("era"))
    return None


def _era_shift(
    cfg: PipelineConfig,
    cfg1: PipelineConfig,
    era: int,
    state: dict[str, Any],
    state_path: Path,
    retrain_now: bool = True,
) -> dict[str, Any]:
    logger = get_run_logger()
    lock = RunDirLock(cfg.resolved_run_dir(), "lopd-era-shift").acquire()
    try:
        flow_run_id, flow_run_url = flow_run.id, ui_link(flow_run.ui_url)
        pipe = open_pipeline_run(cfg1, flow_run_id, flow_run_url)
        tags = {
            k: v for k, v in {Tag.PREFECT_FLOW_RUN_ID: flow_run_id, Tag.PREFECT_FLOW_RUN_URL: flow_run_url}.items() if v
        }
        common, ctx, outcomes = common_fields(cfg1, pipe, tags), stage_context(cfg1), []

        def run(calls: list[tuple[str, str, BaseModel]]) -> list[Outcome]:
            done = _run(calls, ctx, cfg1)
            outcomes.extend(done)
            return done

        with closing(close_pipeline_run, cfg1, pipe, outcomes):
            if "era0" not in state:  # the era-0 pipeline just ran: its stages come from the cache
                state["era0"] = EraZero.of(train_grid(cfg, common_fields(cfg, pipe, tags), run)).model_dump(mode="json")
                _save(state_path, state)
            zero = EraZero.model_validate(state["era0"])
            if "grown" not in state:
                state["grown"] = grow_bank(cfg1, common, zero, era, run)
                _save(state_path, state)
            datasets = {_key(k): ArtifactRef.from_dict(v) for k, v in state["grown"]["datasets"].items()}
            bank = StageResult.model_validate(state["grown"]["bank"])
            if not retrain_now:
                logger.info("era %d: the bank grew to v%d; the re-train waits for bank-watch and lopd-retrain", era,
                            int(bank.metrics["version"]))  # fmt: skip
                return {"status": "waiting", "bank_version": int(bank.metrics["version"]), "mlflow_run_id": pipe,
                        "stages": _stages(outcomes)}  # fmt: skip
            retrained = retrain(cfg1, common, zero, datasets, bank, run)
            evaluated = evaluate_eras(cfg, cfg1, common, zero, retrained, bank, run)
            report = ReportSpec(
                **common,
                suite=cfg1.suite,
                title=f"Era {era} re-train: {', '.join(sorted({a for a, _ in retrained}))} x seeds {cfg1.seeds}",
                evaluate_run_ids=[o.result.mlflow_run_id for o in evaluated.values() if o.result.mlflow_run_id],
                evaluations=[o.result.artifacts["metrics"] for o in evaluated.values() if o.result.mlflow_run_id],
                episodes=[o.result.artifacts["episodes"] for o in evaluated.values() if o.result.mlflow_run_id],
                study=False,
            )
            (r,) = run([("report", "report", report)])
            out_dir = cfg.resolved_run_dir() / f"era{era}"
            text, data = era_report(cfg1, era, zero, evaluated, out_dir, retrained)
            tracker = Tracker.open(
                cfg1.suite,
                run_dir=cfg1.resolved_run_dir(),
                tracking_uri=cfg1.resolved_tracking_uri(),
                experiment=cfg1.experiment,
            )
            tracker.call("logging the era report", lambda: tracker.client.log_artifact(pipe, str(out_dir / "era.md")))
            create_markdown_artifact(text, key=f"era-shift-{era}", description=f"Re-training on era {era}")
            record_trained(cfg1, bank, pipe, flow_run_id)  # bank-watch measures growth from the grown bank now
            state["done"] = True
            _save(state_path, state)
        logger.info("era %d re-train done: %s", era, out_dir / "era.md")
        return {
            "report": str(out_dir / "era.md"),
            "era": data,
            "mlflow_run_id": pipe,
            "tables": str(_report_dir(cfg1, r.result) / "report.md"),  # the pipeline report's tables of every run
            "stages": _stages(outcomes),
        }
    finally:
        lock.release()


def grow_bank(cfg1: PipelineConfig, common: dict[str, Any], zero: EraZero, era: int, run: Any) -> dict[str, Any]:
    """Every era-0 student collects on the new era; each collection enters the bank through the bank stage."""
    warm = zero.warm_ref
    members = [(a, s) for a in zero.arms for s in cfg1.seeds]
    specs = [
        collect_spec(cfg1, common, warm).model_copy(update={"checkpoint": zero.student(a, s).artifacts["checkpoint"]})
        for a, s in members
    ]
    collected = run(
        [("collect", f"collect era {era} by {a} seed {s}", spec) for (a, s), spec in zip(members, specs, strict=True)]
    )
    datasets = {m: o.result.artifacts["dataset"] for m, o in zip(members, collected, strict=True)}
    banked = run(
        [("bank", f"bank era {era} ({a} seed {s})", bank_spec(cfg1, common, d)) for (a, s), d in datasets.items()]
    )
    return {
        "datasets": {f"{a}|{s}": d.to_dict() for (a, s), d in datasets.items()},
        "bank": banked[-1].result.model_dump(mode="json"),
    }


def retrain(
    cfg1: PipelineConfig,
    common: dict[str, Any],
    zero: EraZero,
    datasets: dict[tuple[str, int], ArtifactRef],
    bank: StageResult,
    run: Any,
) -> dict[tuple[str, int], Outcome]:
    """Every arm from its era-0 student on the new era, and `<arm> new cold start` for the arms that read the bank."""
    warm, snapshot = zero.warm_ref, bank.artifacts["bank_snapshot"]
    reads = [a for a, m in zero.arms.items() if METHOD_RULES[m].reads_bank]
    cold = {}
    if reads:
        wanted = [(a, s) for a in reads for s in cfg1.seeds]
        done = run(
            [
                (
                    "cold_start",
                    f"cold-start {a} {NEW_COLD_START} seed {s}",
                    cold_start_spec(cfg1, common, s, datasets[(a, s)], snapshot, warm, a),
                )
                for a, s in wanted
            ]
        )
        cold = {m: o.result.artifacts["composer"] for m, o in zip(wanted, done, strict=True)}
    plan: list[tuple[str, str, int, ArtifactRef | None]] = []  # (label, arm, seed, composer)
    for arm in zero.arms:
        for s in cfg1.seeds:
            plan.append((arm, arm, s, zero.composer(arm, s)))
            if arm in reads:
                plan.append((f"{arm} {NEW_COLD_START}", arm, s, cold[(arm, s)]))
    calls = []
    for label, arm, s, composer in plan:
        spec = train_spec(cfg1, common, arm, s, datasets[(arm, s)], snapshot, composer, warm)
        spec = spec.model_copy(  # OPSD's solutions: the new era's verified successes only (no reference solution)
            update={"init_student": zero.student(arm, s).artifacts["checkpoint"], "reference_solutions": False,
                    "tags": {**spec.tags, ARM_TAG: label}}
        )  # fmt: skip
        calls.append(("train", f"train {label} seed {s} (era {cfg1.suite})", spec))
    trained = run(calls)
    return {(label, s): o for (label, _, s, _), o in zip(plan, trained, strict=True)}


def evaluate_eras(
    cfg: PipelineConfig,
    cfg1: PipelineConfig,
    common: dict[str, Any],
    zero: EraZero,
    retrained: dict[tuple[str, int], Outcome],
    bank: StageResult,
    run: Any,
) -> dict[tuple[str, str, int | None], Outcome]:
    """(what, arm label, seed) -> evaluation: `before` (an era-0 student on the new era), `after` (re-trained, on the
    new era), `era0` (an era-0 student on era 0: the level to recover); the warm start on the new era as `base`."""
    warm = zero.warm_ref
    plan: list[tuple[tuple[str, str, int | None], Any]] = []
    if cfg1.evaluate.base:
        plan.append(
            (
                ("base", "warm start", None),
                evaluate_spec(cfg1, common, "vanilla (sft warm start)", "base", None, None, None, warm),
            )
        )
    for arm, method in zero.arms.items():
        for s in cfg1.seeds:
            student = zero.student(arm, s)
            plan.append(
                (
                    ("era0", arm, s),
                    evaluate_spec(cfg, common, f"{arm} seed {s}", method, s, student, zero.bank, warm, arm),
                )
            )
            plan.append(
                (
                    ("before", arm, s),
                    evaluate_spec(cfg1, common, f"{arm} seed {s} (era 0 student)", method, s, student, None, warm, arm),
                )
            )
    for (label, s), o in retrained.items():
        arm = label.removesuffix(f" {NEW_COLD_START}")
        plan.append(
            (
                ("after", label, s),
                evaluate_spec(cfg1, common, f"{label} seed {s}", zero.arms[arm], s, o.result, bank, warm, arm),
            )
        )
    done = run(
        [
            ("evaluate", f"evaluate {what} {label}" + (f" seed {s}" if s is not None else ""), spec)
            for (what, label, s), spec in plan
        ]
    )
    return {key: o for (key, _), o in zip(plan, done, strict=True)}


# ------------------------------------------------------------------------------------------------ the verdict


def _episodes(store: ArtifactStore, o: Outcome, bench: str) -> Episodes:
    return read_episodes(Path(store.get(o.result.artifacts["episodes"])), bench)


def era_tables(
    evaluated: dict[tuple[str, str, int | None], Any], shifted: set[str], read: Any
) -> dict[str, dict[str, Any]]:
    """Per arm label: reward and rule pass on shifted and unshifted environments, and each re-trained arm against
    its era-0 students on the same tasks (recovery on shifted, forgetting on unshifted). `read(outcome)` -> Episodes."""
    runs: dict[tuple[str, str], dict[int | None, Episodes]] = {}
    for (what, label, s), o in evaluated.items():
        runs.setdefault((what, label), {})[s] = read(o)
    out: dict[str, dict[str, Any]] = {}
    for (what, label), per_seed in runs.items():
        arm = label.removesuffix(f" {NEW_COLD_START}")
        row: dict[str, Any] = {"what": what, "seeds": len(per_seed)}
        first = next(iter(per_seed.values()))
        for part, keep in (("shifted", True), ("unshifted", False)):
            tasks = sorted(t for t in first if (first[t].env in shifted) == keep)
            if not tasks:
                continue
            episodes = [run[t] for run in per_seed.values() for t in tasks]
            cell: dict[str, Any] = {
                "n_tasks": len(tasks),
                "reward": mean_interval([statistics.fmean(run[t].reward for run in per_seed.values()) for t in tasks]),
                "rule_pass": rule_rate(episodes),
            }
            before = runs.get(("before", arm))
            if what == "after" and before is not None:
                env_of = {t: first[t].env for t in tasks}
                seeds = sorted(set(per_seed) & set(before))
                cell["vs_era0_student"] = difference(
                    paired([per_seed[x] for x in seeds], [before[x] for x in seeds], tasks), env_of
                )
            row[part] = cell
        out[f"{label} ({what})"] = row
    return out


def shifted_reward(records: list[dict[str, Any]], shifted: set[str]) -> float | None:
    """The mean training reward of the rollouts on the shifted environments over these steps (None: none there)."""
    total = sum(r for rec in records for env, (r, _) in rec["envs"].items() if env in shifted)
    n = sum(n for rec in records for env, (_, n) in rec["envs"].items() if env in shifted)
    return total / n if n else None


def recovery(before: list[dict[str, Any]], after: list[dict[str, Any]], shifted: set[str]) -> dict[str, Any]:
    """Generations a re-train needs to recover the era-0 level on the shifted environments: the target is the era-0
    run's training reward there over its last quarter of steps; the re-train recovers at the first step whose
    trailing window (a quarter of its steps) reaches it. `before`, `after`: the runs' per-step env rewards."""
    target = shifted_reward(before[-max(1, len(before) // 4) :], shifted) if before else None
    window = max(1, len(after) // 4)
    out = {"target": target, "budget": after[-1]["generations_total"] if after else None, "generations": None}
    if target is None:
        return out
    for i in range(window - 1, len(after)):
        level = shifted_reward(after[i - window + 1 : i + 1], shifted)
        if level is not None and level >= target:
            out["generations"] = after[i]["generations_total"]
            break
    return out


def _env_rewards(store: ArtifactStore, train: StageResult) -> list[dict[str, Any]]:
    """A train run's per-step environment rewards, from its final checkpoint ([] for a run from before they were
    kept)."""
    state = json.loads((Path(store.get(train.artifacts["checkpoint"])) / "state.json").read_text())
    return state.get("env_rewards", [])


def recovery_table(
    store: ArtifactStore, zero: EraZero, retrained: dict[tuple[str, int], Outcome], shifted: set[str]
) -> dict[str, dict[str, Any]]:
    """Per re-trained arm: `recovery` of every seed."""
    out: dict[str, dict[str, Any]] = {}
    for (label, s), o in retrained.items():
        arm = label.removesuffix(f" {NEW_COLD_START}")
        before = _env_rewards(store, zero.student(arm, s))
        out.setdefault(label, {})[s] = recovery(before, _env_rewards(store, o.result), shifted)
    return out


def _recovery_rows(table: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    rows = ["| arm | seeds that recovered | generations to recover (median of those) | era-0 level (training "
            "reward on shifted) | budget |", "|---|---|---|---|---|"]  # fmt: skip
    for label, seeds in table.items():
        reached = [r["generations"] for r in seeds.values() if r["generations"] is not None]
        targets = [r["target"] for r in seeds.values() if r["target"] is not None]
        budget = max((r["budget"] or 0) for r in seeds.values())
        if not targets:
            rows.append(
                f"| {label} | – | – | – (no era-0 rollout rewards kept on the shifted environments) | {budget} |"
            )
            continue
        median = statistics.median(reached) if reached else "–"
        rows.append(
            f"| {label} | {len(reached)} of {len(seeds)} | {median} | {statistics.fmean(targets):.3f} | {budget} |"
        )
    return rows


def era_report(
    cfg1: PipelineConfig,
    era: int,
    zero: EraZero,
    evaluated: dict[tuple[str, str, int | None], Outcome],
    out_dir: Path,
    retrained: dict[tuple[str, int], Outcome] | None = None,
) -> tuple[str, dict[str, Any]]:
    from lopd_core.envs.toolworld.rules import parse_rules_name

    rules = parse_rules_name(cfg1.suite)
    assert rules is not None
    shifted = set(rules.shifted())
    held_out = [b.label for b in cfg1.evaluate.benchmarks if b.split != "validation"]
    store = ArtifactStore(cfg1.resolved_artifact_root())
    parts = [
        f"# Re-training on era {era} ({cfg1.suite})\n",
        f"The house code moved in {', '.join(sorted(shifted))}; the other environments kept theirs. Each re-trained "
        f"arm started from its own era-0 student; `before` is that student on era {era} without the re-train, "
        "`era0` the same student on era 0 (the level to recover). Reward x 100 [95% t over tasks], rule pass % "
        "[Wilson]; Δ vs era-0 student: paired per task, [cluster bootstrap over environments].\n",
    ]
    data: dict[str, Any] = {"suite": cfg1.suite, "shifted": sorted(shifted), "benchmarks": {}}
    for bench in held_out:
        tables = era_tables(evaluated, shifted, lambda o, b=bench: _episodes(store, o, b))
        data["benchmarks"][bench] = tables
        parts.append(f"## {bench}\n")
        parts.append(
            "| arm | shifted: reward | rule pass | Δ vs era-0 student (recovery) | unshifted: reward | rule pass "
            "| Δ vs era-0 student (forgetting) |\n|---|---|---|---|---|---|---|"
        )
        for name, row in tables.items():
            cells = []
            for part in ("shifted", "unshifted"):
                c = row.get(part)
                if c is None:
                    cells += ["–", "–", "–"]
                    continue
                vs = c.get("vs_era0_student")
                cells += [_est(c["reward"]), _est(c["rule_pass"]), _signed(vs["cluster"]) if vs else "–"]
            parts.append(f"| {name} | " + " | ".join(cells) + " |")
        parts.append("")
    if retrained:
        table = recovery_table(store, zero, retrained, shifted)
        data["recovery"] = table
        parts.append("## Recovery on the shifted environments (training rollouts)\n")
        parts.append(
            "The era-0 level: each era-0 run's training reward on the shifted environments over its last quarter of "
            "steps. A re-train recovers at the first step whose trailing quarter reaches it.\n"
        )
        parts += [*_recovery_rows(table), ""]
    text = "\n".join(parts)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "era.md").write_text(text)
    (out_dir / "era.json").write_text(json.dumps(data, indent=2, default=str))
    return text, data
