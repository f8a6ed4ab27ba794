"""`lopd-pipeline`: [sft ->] collect -> bank -> cold-start -> train -> evaluate -> report, methods x seeds.

    from flows.config import load_config
    from flows.pipeline import lopd_pipeline
    summary = lopd_pipeline(config=load_config("configs/tiny.yaml"))  # Prefect's ephemeral API unless PREFECT_API_URL
    summary = lopd_pipeline("demo", ["seeds=[0, 1]"])                  # a preset (configs/demo.yaml) and overrides

The sweep: the warm start (sft, when configured) once, collect and bank once; cold-start per seed (LOPD only); train
and evaluate per (arm, seed), where the arms are the methods plus the named variants, each at the config's equal
generation budget; the base model (the warm start) is evaluated once as the reference row; the report compares
everything (flows/report.py). Stages go
through the stage cache (flows/stages.py): an unchanged pipeline re-runs in seconds, a changed parameter re-runs
that stage and what depends on it. The pipeline's MLflow run (parent of every stage run) carries the Prefect
flow run id and URL; the flow run gets a markdown report, a table of the evaluation and links to MLflow.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from components.common import StageResult
from components.tracking import Tag, Tracker, redact
from flows.config import PipelineConfig, Preset, preset_config, with_overrides
from flows.lifecycle import STOP, RunDirLock, stop_stages_on_sigterm, stopping_on_interrupt
from flows.report import ORACLE_LABEL, ReportSpec, arms_table, section, study_tables
from flows.specs import bank_spec, cold_start_spec, collect_spec, common_fields, evaluate_spec, sft_spec, train_spec
from flows.stages import StageContext, retry_transient, stage_key, stage_task
from lopd_core.artifacts import ArtifactRef
from lopd_core.method_rules import METHOD_RULES

PIPELINE_FILE = "pipeline.yaml"  # the config of the last pipeline run in a run_dir (read by re-training)
TRAINED_FILE = "trained.json"  # the bank version the current models were trained on (read by bank-watch)


@dataclass
class Outcome:
    stage: str
    label: str
    key: str
    result: StageResult
    cached: bool


# ------------------------------------------------------------------------------------ the pipeline's MLflow run


def ui_link(url: str | None) -> str | None:
    """A Prefect UI link, or None when there is no UI to link to: an in-process run with no PREFECT_UI_URL gets
    `None/flow-runs/...` from Prefect."""
    if not url or url.startswith("None/") or "://" not in url:
        return None
    return url


@task(
    name="open-mlflow-pipeline-run",
    cache_policy=NO_CACHE,
    retries=3,
    retry_delay_seconds=exponential_backoff(5),
    retry_condition_fn=retry_transient,
)
def open_pipeline_run(cfg: PipelineConfig, flow_run_id: str | None, flow_run_url: str | None) -> str:
    tracker = Tracker.open(
        cfg.suite, run_dir=cfg.resolved_run_dir(), tracking_uri=cfg.resolved_tracking_uri(), experiment=cfg.experiment
    )
    single = len(cfg.methods) == 1 and len(cfg.seeds) == 1
    prefect_tags = list(flow_run.tags or [])
    trigger = flow_run.name if "retrain" in prefect_tags else None  # "retrain bank v2" (flows.retrain)
    run = tracker.start_pipeline(
        f"pipeline {flow_run.name}" if flow_run.name else "pipeline",
        config=cfg,
        method=cfg.methods[0] if single else None,
        seed=cfg.seeds[0] if single else None,
        backbone=cfg.backbone,
        prefect_flow_run_id=flow_run_id,
        prefect_flow_run_url=flow_run_url,
        tags={
            "lopd.methods": ",".join(cfg.methods),
            "lopd.seeds": ",".join(map(str, cfg.seeds)),
            Tag.TRIGGER: trigger,
            "prefect.tags": ",".join(prefect_tags) or None,
        },
    )
    return run.run_id


@task(
    name="close-mlflow-pipeline-run",
    cache_policy=NO_CACHE,
    retries=3,
    retry_delay_seconds=exponential_backoff(5),
    retry_condition_fn=retry_transient,
)
def close_pipeline_run(cfg: PipelineConfig, run_id: str, outcomes: list[Outcome], status: str) -> None:
    tracker = Tracker.open(
        cfg.suite, run_dir=cfg.resolved_run_dir(), tracking_uri=cfg.resolved_tracking_uri(), experiment=cfg.experiment
    )
    stages = [
        {
            "stage": o.stage,
            "label": o.label,
            "key": o.key,
            "cached": o.cached,
            "mlflow_run_id": o.result.mlflow_run_id,
            "summary": o.result.summary,
        }
        for o in outcomes
    ]
    tracker.call(
        "logging stages.json", lambda: tracker.client.log_text(run_id, json.dumps(stages, indent=2), "stages.json")
    )
    tracker.call(
        "tagging the pipeline run",
        lambda: tracker.client.set_tag(
            run_id, "lopd.cached_stages", f"{sum(o.cached for o in outcomes)}/{len(outcomes)}"
        ),
    )
    tracker.end_run(run_id, status)


@contextlib.contextmanager
def closing(close: Any, cfg: PipelineConfig, pipe: str, outcomes: list[Outcome]) -> Iterator[None]:
    """Close the MLflow pipeline run when the block ends: FINISHED, FAILED on an error, KILLED when stopped (a
    failure to close is logged, never raised over the stage's own error)."""
    try:
        yield
    except BaseException as exc:
        status = "FAILED" if isinstance(exc, Exception) and not STOP.is_set() else "KILLED"  # stopped: KILLED
        try:
            close(cfg, pipe, outcomes, status)
        except Exception as exc:  # keep the stage's own error
            get_run_logger().warning("could not close the MLflow pipeline run %s: %s", pipe, exc)
        raise
    close(cfg, pipe, outcomes, "FINISHED")


# ---------------------------------------------------------------------------------------------- running stages


def _run(calls: list[tuple[str, str, BaseModel]], ctx: StageContext, cfg: PipelineConfig) -> list[Outcome]:
    """Run stage calls (stage, label, spec): one after the other in-process, concurrently as deployment runs."""
    ex = cfg.execution
    task_ = stage_task.with_options(retries=ex.retries, retry_delay_seconds=exponential_backoff(ex.retry_delay_s))
    parallel = ex.mode != "in_process" and len(calls) > 1 and all(s in ctx.remote_stages for s, _, _ in calls)
    with stopping_on_interrupt():  # a signal that lands in this wait stops the running stages too
        if parallel:
            futures = [task_.with_options(task_run_name=label).submit(stage, spec, ctx) for stage, label, spec in calls]
            for future in futures:
                future.wait()
            states = [f.state for f in futures]
        else:
            states = []
            for stage, label, spec in calls:
                states.append(task_.with_options(task_run_name=label)(stage, spec, ctx, return_state=True))
                if STOP.is_set():
                    break  # stopped: no further stage starts
    out = []
    for (stage, label, spec), state in zip(calls, states, strict=False):
        result = state.result()  # raises the stage's error
        out.append(Outcome(stage, label, stage_key(stage, spec), result, state.name == "Cached"))
    return out


def stage_context(cfg: PipelineConfig) -> StageContext:
    run_dir = cfg.resolved_run_dir()
    ex = cfg.execution
    env = {"MLFLOW_TRACKING_URI": cfg.resolved_tracking_uri(), "LOPD_ARTIFACT_ROOT": cfg.resolved_artifact_root()}
    if "://" in cfg.resolved_bank_location():
        env["LOPD_QDRANT_URL"] = cfg.resolved_bank_location()
    return StageContext(
        run_dir=str(run_dir),
        cache_root=cfg.resolved_artifact_root(),
        use_cache=ex.cache,
        remote_stages=tuple(ex.remote_stages) if ex.mode != "in_process" else (),
        mode=ex.mode,
        max_parallel=ex.max_parallel,
        deployments=dict(ex.deployments),
        job_variables=ex.job_variables,
        env=env,
        timeout_s=ex.stage_timeout_s,
    )


@flow(name="lopd-pipeline", log_prints=True)
def lopd_pipeline(
    preset: Preset = "tiny", overrides: tuple[str, ...] = (), config: PipelineConfig | None = None
) -> dict[str, Any]:
    """collect -> bank -> cold-start -> train -> evaluate -> report for every method x seed of the config.

    Args:
        preset: The settings to start from (configs/PRESET.yaml). tiny: a one-minute look at the plumbing on a
            random tiny model; demo: the positive control, ~10 minutes on 2 CPU cores, where training beats the
            warm start; study-rules / study-cpu: the equal-budget studies (hours on a CPU); paper: the paper's
            settings (GPUs).
        overrides: Dotted key=value changes to the preset, one per item, e.g. train.schedule.steps=3,
            methods=[grpo, lopd], seeds=[0, 1], run_dir=runs/mine, lopd.gradient_checkpointing=true.
        config: Leave on None to run the preset. A whole pipeline config instead of it (the overrides still
            apply); the PipelineConfig tab starts from the paper's defaults, not from the preset's values.
    """
    cfg = preset_config(preset, overrides) if config is None else with_overrides(config, overrides)
    with stop_stages_on_sigterm():  # SIGTERM stops the stages first, then the flow (flows.lifecycle)
        return _pipeline(cfg)


def _pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    logger = get_run_logger()
    run_dir = cfg.resolved_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir, "lopd-pipeline").acquire()  # one writer per run directory (flows.lifecycle)
    try:
        (run_dir / PIPELINE_FILE).write_text(cfg.resolved().to_yaml())
        flow_run_id, flow_run_url = flow_run.id, ui_link(flow_run.ui_url)
        retry = {
            "retries": cfg.execution.retries,
            "retry_delay_seconds": exponential_backoff(cfg.execution.retry_delay_s),
        }
        pipe = open_pipeline_run.with_options(**retry)(cfg, flow_run_id, flow_run_url)
        close = close_pipeline_run.with_options(**retry)
        prefect_tags = {
            k: v for k, v in {Tag.PREFECT_FLOW_RUN_ID: flow_run_id, Tag.PREFECT_FLOW_RUN_URL: flow_run_url}.items() if v
        }
        common = common_fields(cfg, pipe, prefect_tags)
        ctx = stage_context(cfg)
        outcomes: list[Outcome] = []

        def run(calls: list[tuple[str, str, BaseModel]]) -> list[Outcome]:
            done = _run(calls, ctx, cfg)
            outcomes.extend(done)
            return done

        with closing(close, cfg, pipe, outcomes):
            grid = train_grid(cfg, common, run)
            warm, oracle, b, dataset = grid.warm, grid.oracle, grid.bank, grid.dataset
            arms, trained = grid.arms, list(grid.trained.values())
            calls = []
            if cfg.evaluate.base:
                name = f"{cfg.backbone} (base)" if warm is None else "vanilla (sft warm start)"
                base = evaluate_spec(cfg, common, name, "base", None, None, None, warm)
                calls.append(("evaluate", "evaluate base", base))
            if oracle is not None:
                ceiling = evaluate_spec(cfg, common, ORACLE_LABEL, "oracle", None, None, None, oracle)
                calls.append(("evaluate", "evaluate oracle", ceiling))
            for (a, s), t in grid.trained.items():
                spec = evaluate_spec(cfg, common, f"{a} seed {s}", arms[a], s, t.result, b.result, warm, a, dataset)
                calls.append(("evaluate", f"evaluate {a} seed {s}", spec))
            evaluated = run(calls)
            report = ReportSpec(
                **common,
                suite=cfg.suite,
                title=f"LOPD pipeline: {', '.join(cfg.methods)} x seeds {cfg.seeds}",
                evaluate_run_ids=[o.result.mlflow_run_id for o in evaluated if o.result.mlflow_run_id],
                evaluations=[o.result.artifacts["metrics"] for o in evaluated],
                episodes=[o.result.artifacts["episodes"] for o in evaluated],  # per-task: success, paired Δ
                study=cfg.is_study,
                train_seconds={
                    t.result.mlflow_run_id: t.result.metrics["seconds"]
                    for t in trained
                    if t.result.mlflow_run_id and "seconds" in t.result.metrics
                },
            )
            (r,) = run([("report", "report", report)])
            summary = publish(cfg, pipe, r, outcomes, flow_run_id, flow_run_url)
            record_trained(cfg, b.result, pipe, flow_run_id)
        cached = sum(o.cached for o in outcomes)
        logger.info(
            "pipeline done: %d stages, %d from the cache; report at %s", len(outcomes), cached, summary["report"]
        )
        return summary
    finally:
        lock.release()


@dataclass
class Grid:
    """What the training half of a pipeline produced: the warm starts, the collection and its bank stage, and the
    trained run of every (arm, seed) with its cold-started composer (LOPD arms)."""

    warm: ArtifactRef | None
    oracle: ArtifactRef | None
    dataset: ArtifactRef
    bank: Outcome
    arms: dict[str, str]  # arm -> method
    composers: dict[tuple[str, int], ArtifactRef]
    trained: dict[tuple[str, int], Outcome]


def train_grid(cfg: PipelineConfig, common: dict[str, Any], run: Any) -> Grid:
    """[sft ->] collect -> bank -> cold-start -> train for every (arm, seed): the pipeline's training half (the
    era-shift flow replays it from the stage cache to find the students it re-trains)."""
    warm = oracle = None
    if cfg.sft is not None:
        warm_starts = [("sft", "sft (warm start)", sft_spec(cfg, common))]
        if cfg.oracle:  # the ceiling: a warm start on rule-following demonstrations, built beside the other
            warm_starts.append(("sft", "sft (oracle)", sft_spec(cfg, common, oracle=True)))
        built = run(warm_starts)
        warm = built[0].result.artifacts["model"]
        oracle = built[1].result.artifacts["model"] if cfg.oracle else None
    (c,) = run([("collect", "collect", collect_spec(cfg, common, warm))])
    dataset = c.result.artifacts["dataset"]
    (b,) = run([("bank", "bank", bank_spec(cfg, common, dataset))])
    snapshot = b.result.artifacts["bank_snapshot"]
    arms = dict(cfg.arms())
    members = [(a, s) for a in arms for s in cfg.seeds]
    composers = cold_starts(cfg, common, arms, cfg.seeds, dataset, snapshot, warm, run)
    trained = run(
        [
            (
                "train",
                f"train {a} seed {s}",
                train_spec(cfg, common, a, s, dataset, snapshot, composers.get((a, s)), warm),
            )
            for a, s in members
        ]
    )
    return Grid(warm, oracle, dataset, b, arms, composers, dict(zip(members, trained, strict=True)))


def cold_starts(
    cfg: PipelineConfig,
    common: dict[str, Any],
    arms: dict[str, str],
    seeds: list[int],
    dataset: ArtifactRef,
    snapshot: ArtifactRef,
    warm: ArtifactRef | None,
    run: Any,
) -> dict[tuple[str, int], ArtifactRef]:
    """(arm, seed) -> its cold-started composer, for every arm whose teacher reads the bank: one cold start per seed
    and composer recipe (arms that differ only in training, like fig. 3's margins, share it)."""
    wanted: dict[str, tuple[str, Any]] = {}  # stage key -> (label, spec), in order
    key_of: dict[tuple[str, int], str] = {}
    for arm, method in arms.items():
        if not METHOD_RULES[method].reads_bank:
            continue
        for s in seeds:
            spec = cold_start_spec(cfg, common, s, dataset, snapshot, warm, arm)
            key = stage_key("cold_start", spec)
            key_of[(arm, s)] = key
            if key not in wanted:
                base = cold_start_spec(cfg, common, s, dataset, snapshot, warm)
                label = f"cold-start seed {s}" if key == stage_key("cold_start", base) else f"cold-start {arm} seed {s}"
                wanted[key] = (label, spec)
    done = run([("cold_start", label, spec) for label, spec in wanted.values()]) if wanted else []
    by_key = {key: o.result.artifacts["composer"] for key, o in zip(wanted, done, strict=True)}
    return {member: by_key[key] for member, key in key_of.items()}


# ----------------------------------------------------------------------------------------- outputs and links


def _report_dir(cfg: PipelineConfig, result: StageResult) -> Path:
    """A local copy of the report directory (downloaded once from a remote artifact store)."""
    from components.artifacts import ArtifactStore

    return ArtifactStore(cfg.resolved_artifact_root()).get(result.artifacts["report"])


def publish(
    cfg: PipelineConfig,
    pipe: str,
    report: Outcome,
    outcomes: list[Outcome],
    flow_run_id: str | None,
    flow_run_url: str | None,
) -> dict[str, Any]:
    """Prefect artifacts (markdown report, evaluation table, MLflow link) and the flow's small JSON summary."""
    from flows.report import log_report

    uri = cfg.resolved_tracking_uri()
    tracker = Tracker.open(cfg.suite, run_dir=cfg.resolved_run_dir(), tracking_uri=uri, experiment=cfg.experiment)
    report_dir = _report_dir(cfg, report.result)
    if report.result.mlflow_run_id != pipe:  # a cached report: attach it to this pipeline run as well
        log_report(tracker, pipe, report_dir)
    text = (report_dir / "report.md").read_text()
    pipe_url = tracker.run_url(pipe)
    text = browser_images(text, report_dir, f"{uri.rstrip('/')}" if tracker.is_server else None, pipe)
    ui = mlflow_ui_command(uri)
    runs_url = tracker.experiment_url(None if tracker.is_server else LOCAL_UI)
    header = [
        f"MLflow pipeline run: {f'[{pipe}]({pipe_url})' if pipe_url else f'`{pipe}`'} "
        f"(experiment `{cfg.experiment}`, store `{redact(uri)}`)"
    ]
    if ui:
        header.append(f"Open the MLflow UI: `{ui}`, then {runs_url}")
    else:
        header.append(f"The runs in MLflow: {runs_url}")
    header.append(f"Artifacts: `{cfg.resolved_artifact_root()}`; this report: `{report_dir}`")
    cached = [o.label for o in outcomes if o.cached]
    header.append(f"Stages from the cache: {', '.join(cached) if cached else 'none'}")
    create_markdown_artifact(
        "\n\n".join(header) + "\n\n" + text,
        key="lopd-report",
        description="LOPD pipeline report: evaluation, equal-budget view, curves",
    )
    data = json.loads((report_dir / "comparison.json").read_text())
    from components.tracking import TrackedRun
    from flows.report import pipeline_metrics

    # on the pipeline run too: the runs MLflow's default view lists (stage runs are nested under it); a row per arm
    # in its arms.json table (the artifact view shows it as a table); the experiment's view shows the score columns
    by_arm = pipeline_metrics(data)
    TrackedRun(tracker, pipe, tracker.experiment_id, "pipeline", load_history=False).log_metrics(by_arm)
    table = arms_table(data)
    if table["data"]:
        columns = {c: [row[i] for row in table["data"]] for i, c in enumerate(table["columns"])}
        tracker.call("logging arms.json", lambda: tracker.client.log_table(pipe, columns, ARMS_TABLE))
    benches = sorted({b for r in data["evaluations"] for b in r["benchmarks"]})
    scores = [k for k in by_arm if k.endswith(tuple(f"/eval/{b}" for b in benches))]  # not the deltas, not train/
    tracker.publish_view([f"eval/{b}/headline" for b in benches] + scores)
    rows = [
        {
            "model": r["label"],
            "method": r["method"],
            "seed": r["seed"],
            **{b: c["value"] for b, c in r["benchmarks"].items()},
        }
        for r in data["evaluations"]
    ]
    if rows:
        create_table_artifact(rows, key="lopd-evaluation", description="Headline scores (0-100) per benchmark")
    if pipe_url:
        create_link_artifact(pipe_url, link_text="MLflow pipeline run", key="lopd-mlflow")
    return {
        "run_dir": str(cfg.resolved_run_dir()),
        "artifact_root": cfg.resolved_artifact_root(),
        "tracking_uri": redact(uri),
        "experiment": cfg.experiment,
        "mlflow_ui": ui,
        "mlflow_url": runs_url,
        "pipeline_run_id": pipe,
        "flow_run_id": flow_run_id,
        "flow_run_url": flow_run_url,
        "report": str(report_dir / "report.md"),
        "evaluation": section(text, "Evaluation"),
        "study": study_tables(text),
        "stages": [
            {
                "stage": o.stage,
                "label": o.label,
                "cached": o.cached,
                "key": o.key[:16],
                "mlflow_run_id": o.result.mlflow_run_id,
                "summary": o.result.summary,
            }
            for o in outcomes
        ],
    }


EMBED_MAX_BYTES = 200_000  # a figure up to this size goes into the Prefect artifact itself (a data URI)


def browser_images(text: str, report_dir: Path, server: str | None, run_id: str) -> str:
    """The report's figures as a browser shows them from the Prefect UI: a relative or file:// path does not
    load there. A figure up to EMBED_MAX_BYTES becomes a base64 PNG data URI; a larger one links to the MLflow
    server's copy (the report/ artifact of the pipeline run), or, with a local store, is named as that artifact."""
    import base64
    import re

    for png in sorted(report_dir.glob("*.png")):
        data = png.read_bytes()
        if len(data) <= EMBED_MAX_BYTES:
            target = f"](data:image/png;base64,{base64.b64encode(data).decode()})"
        elif server:
            target = f"]({server}/get-artifact?path=report/{png.name}&run_uuid={run_id})"
        else:
            target = None
        if target:
            text = text.replace(f"]({png.name})", target)
        else:  # no URL a browser can open: drop the image, keep where it is
            note = f"{png.name} ({len(data) // 1000} kB): MLflow artifact report/{png.name} of run {run_id}"
            text = re.sub(rf"!\[([^\]]*)\]\({re.escape(png.name)}\)", lambda m, n=note: f"{m.group(1)}: {n}", text)
    return text


LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow_ui_command` serves a local store
ARMS_TABLE = "arms.json"  # the pipeline run's table: a row per arm (MLflow's artifact view renders it)


def mlflow_ui_command(uri: str) -> str | None:
    """The command that opens the MLflow UI on a local store (None for a server: it has its own UI)."""
    if uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {uri} --port 5000"


def record_trained(cfg: PipelineConfig, bank: StageResult, pipe: str, flow_run_id: str | None) -> None:
    """Which bank version the models of this run_dir were trained on (bank-watch measures growth from it)."""
    snap = bank.artifacts["bank_snapshot"]
    data = {
        "bank_location": cfg.resolved_bank_location(),
        "bank_name": cfg.bank.name,
        "bank_version": int(bank.metrics["version"]),
        "bank_count": int(bank.metrics["count"]),
        "bank_snapshot": snap.sha256,
        "pipeline_run_id": pipe,
        "flow_run_id": flow_run_id,
        "trained_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (cfg.resolved_run_dir() / TRAINED_FILE).write_text(json.dumps(data, indent=2))
