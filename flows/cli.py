"""`lopd`: one command over the platform's flows and components.

lopd run configs/demo.yaml                        # the whole pipeline in this process (Prefect's ephemeral API)
lopd run configs/tiny.yaml -s seeds='[0, 1]'      # dotted overrides
lopd run configs/demo.yaml -d lopd-pipeline/pipeline-on-this-machine # as a run of a deployment on a Prefect server
lopd bank stats -l runs/demo/bank                 # the experience memory (components.memory.cli)
lopd study configs/study-cpu.yaml               # methods x seeds at an equal budget from one warm start
lopd eval backbone=smollm2-135m 'benchmarks=[toolworld]'   # the evaluate stage on its own
lopd compare --run-dir runs/demo                  # compare runs from MLflow
lopd deploy                                       # work pools + every deployment of prefect.yaml
lopd watch --run-dir runs/demo --min-growth 50    # bank-watch once: emit the re-training event if grown
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from components.memory.cli import bank_app

ROOT = Path(__file__).resolve().parents[1]
PROCESS_POOL = "lopd-process"
GPU_POOL = "lopd-gpu"
GPU_TEMPLATE = ROOT / "k8s" / "prefect" / "gpu-job-template.json"

app = typer.Typer(
    name="lopd",
    help="LOPD platform: run the pipeline, manage the experience bank, evaluate, compare runs, deploy.\n\n"
    "Start with `lopd run configs/tiny.yaml` (a one-minute look on a tiny model) or `lopd run configs/demo.yaml` "
    "(SmolLM2-135M on CPU, ~10 minutes). Configs: configs/*.yaml; see docs/orchestration.md.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bank_app, name="bank", help="Experience memory: ingest, query, stats, snapshot, restore, audit.")


def _prefect_defaults() -> None:
    """Settings for Prefect's ephemeral API on small machines (an explicit environment wins)."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def print_summary(summary: dict[str, Any], elapsed: float | None = None) -> None:
    """What a finished pipeline run tells its user: the evaluation, where things are, how to look at them."""
    echo = typer.echo
    echo("")
    echo(summary.get("evaluation") or "(no evaluation table)")
    if summary.get("study"):  # a warm start or an equal budget: each arm against the warm start, paired per task
        echo("\n" + summary["study"] + "\n")
    stages = summary.get("stages", [])
    cached = [s["label"] for s in stages if s["cached"]]
    echo(
        f"Stages: {len(stages)} ({len(cached)} from the cache{': ' + ', '.join(cached) if cached else ''})"
        + (f"; {elapsed:.0f} s" if elapsed is not None else "")
    )
    echo(f"Run directory:  {summary['run_dir']}")
    echo(f"Artifacts:      {summary['artifact_root']}")
    echo(f"Report:         {summary['report']}")
    echo(
        f"MLflow:         experiment {summary['experiment']!r}, pipeline run {summary['pipeline_run_id']} "
        f"in {summary['tracking_uri']}"
    )
    if summary.get("mlflow_ui"):
        echo(f"  open the MLflow UI:  {summary['mlflow_ui']}")
    if summary.get("mlflow_url"):  # training mode, score columns, the generations x axis
        echo(f"  the runs:            {summary['mlflow_url']}")
    flow_run_id = summary.get("flow_run_id")
    if os.environ.get("PREFECT_API_URL"):
        echo(f"Prefect:        flow run {summary.get('flow_run_url') or flow_run_id}")
    elif flow_run_id:
        echo(f"Prefect:        flow run {flow_run_id} (recorded in {os.environ.get('PREFECT_HOME', '~/.prefect')})")
        echo(f"  open the Prefect UI: prefect server start   then http://127.0.0.1:4200/runs/flow-run/{flow_run_id}")


@app.command()
def run(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Pipeline YAML: configs/tiny.yaml, configs/demo.yaml, configs/paper.yaml, or your own. "
            "Default: the paper's defaults."
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            "-s",
            help="key=value override with dotted keys, repeatable: -s train.schedule.steps=3 "
            "-s 'methods=\\[lopd, grpo]' -s 'seeds=\\[0, 1]'.",  # \\[: a bracket, not rich markup
        ),
    ] = None,
    run_dir: Annotated[str | None, typer.Option(help="Shortcut for -s run_dir=DIR.")] = None,
    deployment: Annotated[
        str | None,
        typer.Option(
            "--deployment",
            "-d",
            help="Run as a flow run of this deployment (e.g. lopd-pipeline/pipeline-on-this-machine) on "
            "the Prefect server at $PREFECT_API_URL, instead of in this process.",
        ),
    ] = None,
    wait: Annotated[bool, typer.Option(help="With --deployment: wait for the run to finish.")] = True,
    print_config: Annotated[bool, typer.Option(help="Print the resolved config as YAML and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON.")] = False,
) -> None:
    """Run the pipeline: collect -> bank -> cold-start -> train -> evaluate -> report.

    By default everything runs in this process on embedded services: Prefect's ephemeral API, embedded Qdrant,
    an MLflow sqlite store and the artifacts under the run directory. Completed stages are cached: running the
    same config again takes seconds, and a changed parameter re-runs that stage and what depends on it.
    """
    from flows.config import load_config

    items = list(overrides or []) + ([f"run_dir={run_dir}"] if run_dir else [])
    try:
        cfg = load_config(config, items)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    if print_config:
        typer.echo(cfg.to_yaml())
        return
    _prefect_defaults()
    if deployment:
        _run_deployment(deployment, cfg.model_dump(mode="json"), wait, as_json)
        return

    from flows.console import logs_above_bars
    from flows.pipeline import lopd_pipeline

    t0 = time.monotonic()
    with logs_above_bars(), _explained(t0):
        summary = lopd_pipeline(config=cfg)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
    else:
        print_summary(summary, time.monotonic() - t0)


@app.command()
def study(
    config: Annotated[Path, typer.Argument(help="Study YAML, e.g. configs/study-cpu.yaml (needs a budget).")],
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="key=value override with dotted keys, repeatable (as in `lopd run`)."),
    ] = None,
    run_dir: Annotated[str | None, typer.Option(help="Shortcut for -s run_dir=DIR.")] = None,
    ablation: Annotated[
        bool, typer.Option(help="Add the fig. 3 arms: LOPD with m = 0, 0.01, 0.1 and with a frozen composer.")
    ] = False,
    family: Annotated[
        bool,
        typer.Option(
            help="Add the OPD family's arms: OPSD with forward KL, JSD, vOPD, sign; LOPD balanced, RA-OPD; the "
            "hybrids DiffGate (OPSD's and LOPD's teacher) and SCOPE."
        ),
    ] = False,
    controls: Annotated[
        bool,
        typer.Option(help="Add the shuffled-reward control: GRPO with its rewards permuted across each batch."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON.")] = False,
) -> None:
    """Run a study: vanilla (the warm start) and every method x seed at one equal generation budget.

    The grid goes through the stage cache: run it again after an interruption and it continues where it
    stopped; finished cells are never recomputed. Prints the study table (held-out reward and success with 95%
    intervals over tasks and over seeds, the paired difference to the warm start, generations, wall time), the
    sample-efficiency table, and where the curves are.
    """
    from flows.config import load_config

    items = list(overrides or []) + ([f"run_dir={run_dir}"] if run_dir else [])
    try:
        cfg = load_config(config, items)
    except (ValueError, FileNotFoundError) as exc:
        _fail(str(exc))
    if cfg.budget is None:
        _fail(f"{config}: a study compares methods at an equal generation budget: set budget (e.g. -s budget=1600)")
    _prefect_defaults()

    from flows.console import logs_above_bars
    from flows.study import lopd_study, with_arms

    try:
        with_arms(cfg, ablation, family, controls)
    except ValueError as exc:
        _fail(f"{config}: {exc}")
    t0 = time.monotonic()
    with logs_above_bars(), _explained(t0):
        summary = lopd_study(config=cfg, ablation=ablation, family=family, controls=controls)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    from flows.report import section

    report = Path(summary["report"]).read_text()
    typer.echo(section(report, "Study") or report)
    print_summary({**summary, "evaluation": ""}, time.monotonic() - t0)


@app.command("era-shift")
def era_shift(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="Era-0 config on a toolworld-rules suite with a budget (default: configs/study-rules.yaml "
            "with the scenario's arms, GRPO, OPSD and LOPD, in runs/era-shift)."
        ),
    ] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Option("--set", "-s", help="key=value override with dotted keys, repeatable (as in `lopd run`)."),
    ] = None,
    era: Annotated[int, typer.Option(help="The era the house rules change to (<suite>-era<N>).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the run's summary as JSON.")] = False,
) -> None:
    """Re-training as the bank grows: era 0's pipeline, then the house rules change in half of the environments,
    the era-0 students collect on the new era into the bank, and every arm re-trains from its own student (LOPD
    with its era-0 cold start and with a new one). Prints reward and rule pass on the shifted and the unshifted
    environments, and each re-trained arm against its era-0 student (recovery, forgetting)."""
    from flows.config import load_config, preset_config
    from flows.era import ERA_SHIFT

    items = list(overrides or [])
    try:
        cfg = load_config(config, items) if config else preset_config("study-rules", [*ERA_SHIFT, *items])
        cfg.for_era(era)
    except (ValueError, FileNotFoundError) as exc:
        _fail(f"{config or 'study-rules'}: {exc}")
    _prefect_defaults()

    from flows.console import logs_above_bars
    from flows.era import lopd_era_shift

    t0 = time.monotonic()
    with logs_above_bars(), _explained(t0):
        summary = lopd_era_shift(config=cfg, overrides=(), era=era)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    typer.echo(Path(summary["report"]).read_text())
    typer.echo(f"era report: {summary['report']}; every run's tables: {summary['tables']} "
               f"({time.monotonic() - t0:.0f} s)")  # fmt: skip


@contextlib.contextmanager
def _explained(t0: float) -> Iterator[None]:
    """An error that explains itself (flows.console.clear_errors) ends the command with its message and how long
    the run tried (retries included), without a traceback. A stop (SIGTERM, Ctrl-C: flows.lifecycle) ends it with
    one line that says how to resume, and exit code 143 or 130."""
    import signal

    from prefect.exceptions import TerminationSignal

    from flows.console import clear_errors
    from flows.lifecycle import Stopped, exit_code, fast_exit, quiet_prefect_logs, stop_on_signals, stop_signal

    def stopped_line() -> str:
        name = signal.Signals(stop_signal() or signal.SIGINT).name
        return (f"stopped by {name} after {time.monotonic() - t0:.0f} s: finished stages are in the stage cache and "
                "a cut training run keeps its last checkpoint; run the same command again to resume")  # fmt: skip

    try:
        with stop_on_signals(stopped_line):  # SIGTERM as Ctrl-C: the stages stop too (flows.lifecycle)
            yield
    except clear_errors() as exc:
        _fail(f"{exc}\n(the run stopped after {time.monotonic() - t0:.0f} s, retries included: execution.retries)", 1)
    except (KeyboardInterrupt, Stopped, TerminationSignal):
        quiet_prefect_logs()  # nothing is sent to the API while the interpreter shuts down
        fast_exit()
        _fail(stopped_line(), exit_code(stop_signal()))


def _run_deployment(name: str, config: dict[str, Any], wait: bool, as_json: bool) -> None:
    """A flow run of the deployment; waiting, it prints what a local run prints: the evaluation table, where the
    report and the MLflow run are (from the run's `lopd-report` artifact), and the flow run's UI link."""
    if not os.environ.get("PREFECT_API_URL"):
        _fail("--deployment needs a Prefect server: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    from prefect.deployments import run_deployment
    from prefect.utilities.urls import url_for

    from flows.lifecycle import remote_stage
    from flows.stages import cancel_flow_run, wait_for_flow_run

    run_ = run_deployment(name, parameters={"config": config}, timeout=0, as_subflow=False)
    if wait:  # a stop while waiting (SIGTERM, Ctrl-C) cancels the flow run: its worker stops it
        with _explained(time.monotonic()), remote_stage(str(run_.id), lambda: cancel_flow_run(run_.id)):
            run_ = wait_for_flow_run(run_.id, None)
    state = run_.state
    info = {"flow_run_id": str(run_.id), "name": run_.name, "state": state.name if state else None}
    url = url_for(run_)
    if url:
        info["flow_run_url"] = url
    report = _report_artifact(run_.id) if state is not None and state.is_completed() else None
    if as_json:
        typer.echo(json.dumps(info | ({"report": report} if report else {})))
    else:
        typer.echo(f"flow run {run_.name} ({run_.id}): {info['state']}")
        if report:  # the artifact: where things are, then the report (its title, "## Evaluation", ...)
            from flows.report import section

            where, _, text = report.partition("\n\n# ")
            if table := section(text, "Evaluation"):
                typer.echo("\n" + table)
            typer.echo(where)
        if url:
            typer.echo(f"Prefect UI:     {url}")
    if wait and (state is None or not state.is_completed()):
        raise typer.Exit(1)


def _report_artifact(flow_run_id: Any) -> str | None:
    """The markdown of the flow run's `lopd-report` artifact (the pipeline's last step writes it), or None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    found = ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=ArtifactFilterKey(any_=["lopd-report"])
    )
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=found)
    return str(artifacts[0].data) if artifacts else None


@app.command(
    name="eval",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def eval_(ctx: typer.Context) -> None:
    """Evaluate a checkpoint or a backbone: a spec file and key=value overrides (`lopd eval --help`: every field).

    The same evaluate stage the pipeline runs (components.evaluate), e.g.
    lopd eval backbone=smollm2-135m 'benchmarks=[{name: toolworld, sample: 20}]'
    """
    from components.evaluate import main

    raise typer.Exit(main(list(ctx.args)))


@app.command()
def compare(
    run_dir: Annotated[str | None, typer.Option(help="A pipeline run directory (its MLflow sqlite store).")] = None,
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow store; default $MLFLOW_TRACKING_URI, else the run directory's.")
    ] = None,
    experiment: Annotated[str, typer.Option(help="MLflow experiment.")] = "lopd",
    pipeline_run: Annotated[str | None, typer.Option(help="Only the evaluations of this MLflow pipeline run.")] = None,
    method: Annotated[str | None, typer.Option(help="Only this method (lopd, grpo, ..., base).")] = None,
    budget: Annotated[
        float | None, typer.Option(help="Equal-budget view at this many generations (default: the smallest).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Write report.md, comparison.json and the curves here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the data as JSON instead of markdown.")] = False,
) -> None:
    """Compare evaluated runs from MLflow: methods x seeds x benchmarks, and training at an equal budget."""
    from components.tracking import resolve_tracking_uri
    from flows.report import compare as compare_runs

    if tracking_uri is None and run_dir is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        _fail("give --run-dir or --tracking-uri (or set MLFLOW_TRACKING_URI)")
    if run_dir is not None and tracking_uri is None and not (Path(run_dir) / "mlflow.db").exists():
        parent = Path(run_dir).resolve().parent
        stores = sorted(str(p.parent) for p in parent.glob("*/mlflow.db"))
        _fail(f"{run_dir} holds no MLflow store (no mlflow.db); run directories in {parent}: "
              f"{', '.join(stores) if stores else 'none'}")  # fmt: skip
    uri = resolve_tracking_uri(tracking_uri, Path(run_dir).resolve() if run_dir else None)
    from mlflow.tracking import MlflowClient

    names = sorted(e.name for e in MlflowClient(uri).search_experiments())
    if experiment not in names:
        _fail(f"no experiment {experiment!r} in {uri}; it has: {', '.join(names) if names else 'none'}")
    if out is None and not as_json:
        typer.echo("(curves: add --out DIR to write report.md, comparison.json and the PNG curves there)", err=True)
    try:
        text, data = compare_runs(
            uri, experiment, pipeline_run_id=pipeline_run, method=method, budget=budget, out_dir=out
        )
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(json.dumps(data, indent=2, default=str) if as_json else text)


DEFAULT_DEPLOYMENT = "lopd-pipeline/pipeline-on-this-machine"


@app.command()
def deploy(
    prefect_file: Annotated[Path, typer.Option(help="The deployments file.")] = ROOT / "prefect.yaml",
    name: Annotated[
        list[str] | None, typer.Option(help="Only these deployments ('flow/name'), repeatable. Default: all.")
    ] = None,
    registry: Annotated[
        str | None,
        typer.Option(
            envvar="LOPD_REGISTRY",
            help="Registry prefix of the lopd-platform images, e.g. registry.example.internal/lopd.",
        ),
    ] = None,
    pools: Annotated[bool, typer.Option(help="Create the work pools lopd-process and lopd-gpu first.")] = True,
) -> None:
    """Register the deployments of prefect.yaml on the Prefect server at $PREFECT_API_URL.

    Creates the work pools first: lopd-process (type process, local runs) and lopd-gpu (type kubernetes, from
    k8s/prefect/gpu-job-template.json: nvidia.com/gpu limits, node selector, tolerations). Then runs
    `prefect deploy --all` from the repository root. Start a local worker with
    `prefect worker start --pool lopd-process`.
    """
    if not os.environ.get("PREFECT_API_URL"):
        _fail("set PREFECT_API_URL to the Prefect server's API (e.g. http://127.0.0.1:4200/api)")
    if not prefect_file.exists():
        _fail(f"{prefect_file} does not exist")
    env = {**os.environ, "PREFECT_CLI_PROMPT": "false"}
    prefect = [sys.executable, "-m", "prefect"]
    if pools:
        if subprocess.run([*prefect, "work-pool", "inspect", PROCESS_POOL], env=env, capture_output=True).returncode:
            _check([*prefect, "work-pool", "create", PROCESS_POOL, "--type", "process"], env)
        _check(
            [
                *prefect,
                "work-pool",
                "create",
                GPU_POOL,
                "--type",
                "kubernetes",
                "--base-job-template",
                str(GPU_TEMPLATE),
                "--overwrite",
            ],
            env,
        )
    source = prefect_file.resolve()
    if registry:
        text = source.read_text().replace("image: lopd-platform:", f"image: {registry.rstrip('/')}/lopd-platform:")
        source = source.parent / f".{source.stem}.deploy.yaml"
        source.write_text(text)
    targets = [arg for n in name for arg in ("--name", n)] if name else ["--all"]
    try:
        _check([*prefect, "deploy", *targets, "--prefect-file", str(source)], env, cwd=ROOT)
    finally:
        if registry:
            source.unlink(missing_ok=True)
    typer.echo(deploy_summary(os.environ["PREFECT_API_URL"]))


def deploy_summary(api_url: str) -> str:
    """What `lopd deploy` leaves on the server, read back from it: each deployment with its pool and what it
    does, then the next steps (a worker, a first run, the UI)."""
    from textwrap import shorten

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deps = client.read_deployments()
        flows = {f.id: f.name for f in client.read_flows()}
    rows = sorted((f"{flows.get(d.flow_id, '?')}/{d.name}", d.work_pool_name or "-", d.description or "") for d in deps)
    width = max((len(r[0]) for r in rows), default=0)
    ui = api_url.rstrip("/").removesuffix("/api")
    lines = [f"\n{len(rows)} deployments on {ui}:"]
    lines += [f"  {name:<{width}}  {pool:<12}  {shorten(desc, 70, placeholder=' ...')}" for name, pool, desc in rows]
    lines += [
        "Next:",
        f"  prefect worker start --pool {PROCESS_POOL}          # runs the *-on-this-machine deployments here",
        f"  prefect deployment run {DEFAULT_DEPLOYMENT}   # or the UI: Quick run (the tiny preset, ~1 min)",
        f"  UI: {ui}/deployments",
    ]
    return "\n".join(lines)


def _check(cmd: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
    typer.echo("$ " + " ".join(cmd[2:] if cmd[:2] == [sys.executable, "-m"] else cmd))
    done = subprocess.run(cmd, env=env, cwd=cwd)
    if done.returncode:
        raise typer.Exit(done.returncode)


@app.command()
def watch(
    run_dir: Annotated[str, typer.Option(help="The pipeline run directory whose bank to watch.")] = "runs/local",
    min_growth: Annotated[int, typer.Option(help="New bank entries that start a re-training.")] = 50,
    debounce_s: Annotated[float, typer.Option(help="Do not announce again within this many seconds.")] = 3600.0,
) -> None:
    """Run bank-watch once: emit `lopd.bank.grown` when the bank grew by >= N entries since training.

    With the deployments of prefect.yaml on a server, the event starts lopd-retrain/retrain-on-bank-growth.
    Scheduled watching is the bank-watch/watch-bank-growth deployment (its interval schedule is off until you
    turn it on).
    """
    _prefect_defaults()
    from flows.retrain import bank_watch

    with _explained(time.monotonic()):
        result = bank_watch(run_dir=run_dir, min_growth=min_growth, debounce_s=debounce_s)
    typer.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    app()
