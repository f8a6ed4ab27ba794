"""Stages as Prefect tasks: the stage cache, retries on transient failures, in-process or as deployment runs.

Every stage is a component function `fn(spec) -> StageResult` (components/). The `stage` task wraps one call:

1. key = digests of the spec's input artifacts + its parameters + the code version (flows/cache.py);
2. a usable cache entry for the key -> the task ends in state "Cached" with the stored result (nothing runs);
3. else the component runs, in this process, or (mode=deployments) as a run of the stage's deployment
   (`lopd-stage/train-gpu-pod`, ...: a Kubernetes pod at scale) through `run_deployment`; the stage run writes its
   result into the cache, where the task reads it back. Results are small JSON, never tensors.

Each stage execution works in its own directory `<run_dir>/stages/<stage>/<key[:16]>`, so a retried or re-run
stage with the same key continues where it stopped (training resumes from its last checkpoint). Its
`timing.json` there says where the stage's time went (`lopd_core.timing`; `bench/study_profile.py` reads them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State
from prefect.tasks import exponential_backoff
from pydantic import BaseModel

from components.bank import BankSpec, bank
from components.cold_start import ColdStartSpec, cold_start
from components.collect import CollectSpec, collect
from components.common import StageResult
from components.evaluate import EvaluateSpec, evaluate
from components.sft import SFTSpec, run_sft
from components.train import TrainSpec, train
from flows.cache import StageCache, code_version, key_material, stage_key
from flows.lifecycle import (
    STOP,
    RunDirLock,
    Stopped,
    as_child_stage,
    check_stopped,
    fast_exit,
    remote_stage,
    run_child,
    stop_stages_on_sigterm,
)
from lopd_core.timing import SECTIONS

StageName = Literal["sft", "collect", "bank", "cold_start", "train", "evaluate", "report"]


def _run_report(spec: BaseModel) -> StageResult:
    from flows.report import build_report

    return build_report(spec)  # type: ignore[arg-type]


def _report_spec_cls() -> type[BaseModel]:
    from flows.report import ReportSpec

    return ReportSpec


RUNNERS: dict[str, tuple[Callable[[], type[BaseModel]], Callable[[Any], StageResult]]] = {
    "sft": (lambda: SFTSpec, run_sft),
    "collect": (lambda: CollectSpec, collect),
    "bank": (lambda: BankSpec, bank),
    "cold_start": (lambda: ColdStartSpec, cold_start),
    "train": (lambda: TrainSpec, train),
    "evaluate": (lambda: EvaluateSpec, evaluate),
    "report": (_report_spec_cls, _run_report),
}


def parse_spec(stage: str, spec: dict[str, Any] | BaseModel) -> BaseModel:
    cls = RUNNERS[stage][0]()
    return spec if isinstance(spec, cls) else cls.model_validate(spec)


# ------------------------------------------------------------------------------------- state outside the spec


def bank_version(location: str, name: str) -> int | None:
    """The live bank's version (None when there is no such bank yet)."""
    from components.memory import ExperienceBank

    try:
        with ExperienceBank.open(location, name, create=False) as b:
            return b.version
    except FileNotFoundError:
        return None


def current_state(stage: str, spec: BaseModel) -> dict[str, Any] | None:
    """What a cached result of `stage` depends on beyond its spec: the bank stage snapshots the live bank."""
    if stage == "bank":
        assert isinstance(spec, BankSpec)
        return {"bank_version": bank_version(_bank_location(spec), spec.bank_name)}
    return None


def result_state(stage: str, result: StageResult) -> dict[str, Any] | None:
    if stage == "bank":
        return {"bank_version": int(result.metrics["version"])}
    return None


def _bank_location(spec: BankSpec) -> str:
    return spec.bank_location or str(Path(spec.run_dir) / "bank" / "store")


def restore_missing_bank(spec: BankSpec, cache: StageCache, key: str) -> bool:
    """A directory bank that is gone (a fresh pod, a wiped run_dir) comes back from the cached stage's snapshot,
    so that an unchanged pipeline stays cached; the snapshot in the artifact store is the durable copy."""
    from components.memory import ExperienceBank

    location = _bank_location(spec)
    if location == ":memory:" or "://" in location or bank_version(location, spec.bank_name) is not None:
        return False
    result = cache.get("bank", key)
    if result is None:
        return False
    ref = result.artifacts["bank_snapshot"]
    local = dataclasses.replace(ref, uri=str(spec.store().get(ref)))
    ExperienceBank.restore(local, location, spec.bank_name, overwrite=True).close()
    get_run_logger().info("bank %s restored from the snapshot of the cached bank stage", location)
    return True


# ---------------------------------------------------------------------------------------------- running


TIMING_FILE = "timing.json"


def timed_run(stage: str, spec: BaseModel) -> StageResult:
    """The stage's component, with where its time went written to `<run_dir>/timing.json`: the stage's wall
    time and its sections (`lopd_core.timing`, exclusive seconds), which `bench/study_profile.py` adds up."""
    SECTIONS.reset()
    t0 = time.perf_counter()
    result = RUNNERS[stage][1](spec)
    folder = getattr(spec, "run_dir", None)
    if folder and int(os.environ.get("RANK", "0")) == 0:
        doc = {"stage": stage, "stage_s": time.perf_counter() - t0, "sections": SECTIONS.totals(),
               "calls": SECTIONS.calls()}  # fmt: skip
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, TIMING_FILE).write_text(json.dumps(doc, indent=1))
    return result


def execute_stage(stage: str, spec: BaseModel, cache_root: str, key: str) -> StageResult:
    """Run the component and record its result under `key` (used in-process and by the stage deployment)."""
    result = timed_run(stage, spec)
    StageCache(cache_root).put(stage, key, result, result_state(stage, result), key_material(stage, spec))
    return result


@flow(name="lopd-stage", log_prints=True)
def lopd_stage(stage: StageName, spec: dict[str, Any], cache_key: str, cache_root: str) -> dict[str, Any]:
    """One stage in its own process or pod (the deployments lopd-stage/collect-gpu-pod, /cold-start, /train, /evaluate).

    Called by the pipeline with `run_deployment`; the result goes into the stage cache under `cache_key`.

    Args:
        stage: The stage to run (sft, collect, bank, cold_start, train, evaluate, report).
        spec: The stage's spec as JSON (its StageSpec fields; the pipeline fills it).
        cache_key: The stage cache key the pipeline computed for this spec and code version.
        cache_root: The stage cache directory or s3://... prefix the result is stored under.
    """
    with stop_stages_on_sigterm():  # a pod's SIGTERM stops a PyTorchJob's wait too (flows.lifecycle)
        return _lopd_stage(stage, spec, cache_key, cache_root)


def _lopd_stage(stage: str, spec: dict[str, Any], cache_key: str, cache_root: str) -> dict[str, Any]:
    parsed = parse_spec(stage, spec)
    if stage_key(stage, parsed) != cache_key:
        get_run_logger().warning(
            "stage %s: this worker's code version %s gives another cache key than the pipeline's; the result is "
            "stored under the pipeline's key %s",
            stage,
            code_version()[:12],
            cache_key[:12],
        )
    if getattr(parsed, "nodes", 1) > 1:  # multi-node: a PyTorchJob whose rank 0 stores the result under the key
        result = run_pytorchjob_stage(stage, parsed, cache_root, cache_key)
    else:
        result = execute_stage(stage, parsed, cache_root, cache_key)
    print(result.summary)
    return result.model_dump(mode="json")


def run_pytorchjob_stage(stage: str, spec: BaseModel, cache_root: str, key: str) -> StageResult:
    """Submit the stage as a PyTorchJob (flows.pytorchjob), wait for it, and read what its rank 0 cached."""
    import asyncio

    from flows.pytorchjob import stage_job, submit_and_wait

    job = stage_job(stage, spec, cache_root, key)
    asyncio.run(submit_and_wait(job, log=get_run_logger().info))
    result = StageCache(cache_root).get(stage, key)
    if result is None:
        raise StageRunError(f"stage {stage}: PyTorchJob {job['metadata']['name']} succeeded but left no result "
                            f"under {cache_root}")  # fmt: skip
    return result


# ------------------------------------------------------------------------------------------------- retries


class StageRunError(RuntimeError):
    """A stage deployment run did not complete."""

    def __init__(self, message: str, crashed: bool = False) -> None:
        super().__init__(message)
        self.crashed = crashed


def _transient_types() -> tuple[type[BaseException], ...]:
    from components.tracking import TrackingError

    types: list[type[BaseException]] = [ConnectionError, TimeoutError, socket.gaierror, TrackingError]
    try:
        import httpx

        types.append(httpx.TransportError)
    except ImportError:  # pragma: no cover - a Prefect dependency
        pass
    try:
        from qdrant_client.http.exceptions import ResponseHandlingException

        types.append(ResponseHandlingException)
    except ImportError:  # pragma: no cover - an optional extra
        pass
    return tuple(types)


def is_transient(exc: BaseException | None) -> bool:
    """Worth retrying: a service that cannot be reached (MLflow, Qdrant, the Prefect API), a busy embedded bank,
    a stage pod that crashed. Errors in the inputs or the code are not."""
    seen: set[int] = set()
    types = _transient_types()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, types):
            return True
        if isinstance(exc, StageRunError) and exc.crashed:
            return True
        if isinstance(exc, RuntimeError) and "in use by another process" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_transient(task_: Any, task_run: Any, state: State) -> bool:
    """Prefect retry condition: retry only transient failures, and nothing once the run is stopping."""
    if STOP.is_set():
        return False
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as raised:
            exc = raised
    return is_transient(exc)


# -------------------------------------------------------------------------------------------- the stage task


@dataclass
class StageContext:
    """How the pipeline runs its stages (from PipelineConfig.execution and the resolved locations)."""

    run_dir: str
    cache_root: str
    use_cache: bool = True
    remote_stages: tuple[str, ...] = ()
    mode: str = "in_process"  # how remote_stages run: "subprocess" (children of this process) or "deployments"
    max_parallel: int = 1  # subprocess mode: cores' worth of stages at once (a stage takes threads x nproc)
    deployments: dict[str, str] = field(default_factory=dict)
    job_variables: dict[str, dict[str, Any]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None

    def stage_dir(self, stage: str, key: str) -> str:
        return str(Path(self.run_dir) / "stages" / stage / key[:16])

    def job_variables_for(self, stage: str) -> dict[str, Any]:
        """A stage run's job variables: config's "default" and per-stage ones, env with the service URLs."""
        variables = {**self.job_variables.get("default", {}), **self.job_variables.get(stage, {})}
        variables["env"] = {**self.env, **variables.get("env", {})}
        return variables


def gpu_variables(stage: str, spec: BaseModel, variables: dict[str, Any]) -> dict[str, Any]:
    """A data-parallel stage's pod requests one GPU per rank: `gpu_count` follows the spec's `nproc` (the one
    setting in the Prefect form; torchrun in the pod starts that many ranks). A `gpu_count` job variable that
    says otherwise is an error naming both. Multi-node (`nodes > 1`): the stage pod submits a PyTorchJob and
    requests no GPU."""
    nproc = getattr(spec, "nproc", 1)
    if getattr(spec, "nodes", 1) > 1:  # the pod only submits the PyTorchJob and waits: the job's pods hold the GPUs
        return {**variables, "gpu_count": 0}
    if nproc <= 1:
        return variables
    given = variables.get("gpu_count")
    if given not in (None, 1, nproc):
        raise ValueError(f"execution.job_variables.{stage}.gpu_count={given} differs from {stage}.nproc={nproc}: "
                         f"the pod runs one rank per GPU; set only {stage}.nproc")  # fmt: skip
    return {**variables, "gpu_count": nproc}


def _run_remote(stage: str, spec: BaseModel, key: str, ctx: StageContext) -> StageResult:
    from prefect.deployments import run_deployment

    logger = get_run_logger()
    name = ctx.deployments[stage]
    variables = gpu_variables(stage, spec, ctx.job_variables_for(stage))
    logger.info("stage %s -> deployment %s (job variables %s)", stage, name, sorted(variables))
    if STOP.is_set():
        raise Stopped(f"the run is stopping: stage {stage} does not start")
    run = run_deployment(
        name,
        parameters={
            "stage": stage,
            "spec": spec.model_dump(mode="json"),
            "cache_key": key,
            "cache_root": ctx.cache_root,
        },
        job_variables=variables,
        timeout=0,  # created, not awaited: a stop must be able to cancel it (flows.lifecycle.remote_stage)
        flow_run_name=f"{stage}-{key[:10]}",
    )
    with remote_stage(str(run.id), lambda: cancel_flow_run(run.id)):
        run = wait_for_flow_run(run.id, ctx.timeout_s)
    if STOP.is_set():
        raise Stopped(f"stage {stage}: deployment run {run.name} ({run.id}) was cancelled by the stop")
    state = run.state
    if state is None or not state.is_completed():
        crashed = state is not None and state.is_crashed()
        raise StageRunError(f"stage {stage}: deployment run {run.name} ({run.id}) ended {state}", crashed=crashed)
    result = StageCache(ctx.cache_root).get(stage, key)
    if result is None:
        raise StageRunError(f"stage {stage}: run {run.id} completed but left no result in {ctx.cache_root}")
    return result


def cancel_flow_run(flow_run_id: Any) -> None:
    """Ask the server to cancel a flow run: its worker sends the run's process (or pod) SIGTERM."""
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(message="the pipeline that started it was stopped"))


def wait_for_flow_run(flow_run_id: Any, timeout_s: float | None, poll_s: float = 2.0) -> Any:
    """The flow run once it is final (or when `timeout_s` has passed, as run_deployment's timeout)."""
    from prefect.client.orchestration import get_client

    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if (run.state is not None and run.state.is_final()) or (
                timeout_s is not None and time.monotonic() - t0 > timeout_s
            ):
                return run
            time.sleep(poll_s)


class Slots:
    """`capacity` cores' worth of child stages at once (`execution.max_parallel`). A stage takes one unit per torch
    thread of each of its ranks (`threads` x `nproc`, at most `capacity`), so the warm start's and the cold starts'
    two-thread stages run one at a time on two cores, while one-thread arms still run two at a time. Four threads
    on two cores, a study's cold starts side by side, ran at 4.7 s a step (docs/performance.md)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self._cond = threading.Condition()

    @staticmethod
    def units_of(spec: BaseModel) -> int:
        return (getattr(spec, "threads", None) or 1) * (getattr(spec, "nproc", None) or 1)

    @contextlib.contextmanager
    def take(self, units: int) -> Any:
        units = min(max(units, 1), self.capacity)
        with self._cond:
            while not self._cond.wait_for(lambda: self.free >= units or STOP.is_set(), timeout=0.5):
                pass
            if STOP.is_set():  # a stage waiting for a slot when the run stops never starts
                raise Stopped("the run is stopping: no new stage starts")
            self.free -= units
        try:
            yield
        finally:
            with self._cond:
                self.free += units
                self._cond.notify_all()


_SLOTS: dict[int, Slots] = {}
_SLOTS_LOCK = threading.Lock()


def _slots(n: int) -> Slots:
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(n, Slots(n))


def _run_subprocess(stage: str, spec: BaseModel, key: str, ctx: StageContext) -> StageResult:
    """The stage's component CLI in a child process (at most ctx.max_parallel cores' worth at once: `Slots`); its
    log goes to `<stage dir>/stage.log`, its result into the stage cache like any other run."""
    logger = get_run_logger()
    folder = Path(getattr(spec, "run_dir", None) or ctx.stage_dir(stage, key))
    folder.mkdir(parents=True, exist_ok=True)
    spec_file, out_file, log_file = folder / "spec.json", folder / "result.json", folder / "stage.log"
    spec_file.write_text(spec.model_dump_json(indent=2))
    out_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "flows.stages", stage, str(spec_file), str(out_file)]
    env = {**os.environ, **ctx.env, "TQDM_MININTERVAL": "30"}
    with _slots(ctx.max_parallel).take(Slots.units_of(spec)):
        logger.info("stage %s -> child process (log %s)", stage, log_file)
        t0 = time.perf_counter()
        with open(log_file, "wb") as log:
            code = run_child(command, log, env)
        process_s = time.perf_counter() - t0
    check_stopped(f"stage {stage}", code)
    if code == 0 and (timing := folder / TIMING_FILE).exists():  # the child's wall time, start-up and exit included
        timing.write_text(json.dumps({**json.loads(timing.read_text()), "process_s": process_s}, indent=1))
    if code != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace")[-3000:]
        raise StageRunError(f"stage {stage} exited with code {code}; the end of {log_file}:\n{tail}", crashed=code < 0)
    result = StageResult.model_validate_json(out_file.read_text())
    StageCache(ctx.cache_root).put(stage, key, result, result_state(stage, result), key_material(stage, spec))
    return result


@task(
    name="stage",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=exponential_backoff(10),
    retry_condition_fn=retry_transient,
)
def stage_task(stage: str, spec: BaseModel, ctx: StageContext) -> StageResult | State:
    """Run one stage unless its cache entry is usable; see the module docstring."""
    if STOP.is_set():
        raise Stopped(f"the run is stopping: stage {stage} does not start")
    logger = get_run_logger()
    key = stage_key(stage, spec)
    spec = spec.model_copy(update={"run_dir": ctx.stage_dir(stage, key)})
    cache = StageCache(ctx.cache_root)
    if ctx.use_cache:
        if stage == "bank":
            restore_missing_bank(spec, cache, key)  # type: ignore[arg-type]
        hit = cache.get(stage, key, current_state(stage, spec))
        if hit is not None:
            logger.info("%s: cache hit %s (%s)", stage, key[:12], hit.summary)
            return Completed(name="Cached", data=hit, message=f"stage cache hit {key[:12]}")
    if stage in ctx.remote_stages and ctx.mode == "subprocess":
        result = _run_subprocess(stage, spec, key, ctx)
    elif stage in ctx.remote_stages:
        result = _run_remote(stage, spec, key, ctx)
    else:
        result = execute_stage(stage, spec, ctx.cache_root, key)
    logger.info("%s: %s", stage, result.summary)
    return result


def stage_options(retries: int, retry_delay_s: float) -> dict[str, Any]:
    return {"retries": retries, "retry_delay_seconds": exponential_backoff(retry_delay_s) if retries else 0}


def main(argv: list[str] | None = None) -> int:
    """`python -m flows.stages STAGE SPEC.json RESULT.json [--cache-root ROOT --cache-key KEY]`: run one stage's
    component (what subprocess mode runs, and each rank of a PyTorchJob under torchrun). With the cache options
    the result is also stored in the stage cache under KEY. Under torchrun only rank 0 writes either."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m flows.stages", description=main.__doc__)
    ap.add_argument("stage", choices=list(RUNNERS))
    ap.add_argument("spec_file", metavar="SPEC.json")
    ap.add_argument("out_file", metavar="RESULT.json")
    ap.add_argument("--cache-root")
    ap.add_argument("--cache-key")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if (args.cache_root is None) != (args.cache_key is None):
        ap.error("--cache-root and --cache-key go together")
    as_child_stage()  # SIGTERM stops it at once; it dies with its parent
    spec = parse_spec(args.stage, json.loads(Path(args.spec_file).read_text()))
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as held:
            if int(os.environ.get("RANK", "0")) == 0:  # one writer per stage directory (rank 0 of a multi-pod job)
                held.enter_context(RunDirLock(Path(args.spec_file).parent, f"stage {args.stage}"))
            result = timed_run(args.stage, spec)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C (as_child_stage): one line, not a traceback
        print(f"stage {args.stage} stopped after {time.monotonic() - t0:.0f} s; its last checkpoint is kept")
        fast_exit()
        return 128 + signal.SIGTERM
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: the other ranks only trained
        return 0
    Path(args.out_file).write_text(result.model_dump_json(indent=2))
    if args.cache_key is not None:
        StageCache(args.cache_root).put(
            args.stage, args.cache_key, result, result_state(args.stage, result), key_material(args.stage, spec)
        )
    print(result.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
