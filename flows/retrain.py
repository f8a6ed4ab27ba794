"""Bank-growth re-training: `bank-watch` emits an event when the bank has grown; `lopd-retrain` re-trains.

    bank_watch(run_dir="runs/demo", min_growth=50)   # emits lopd.bank.grown when >= 50 new entries
    lopd_retrain(run_dir="runs/demo")                # the pipeline of run_dir again, on a fresh bank snapshot

A pipeline run records in `<run_dir>/trained.json` which bank version its models were trained on. bank-watch
(scheduled, or run by hand) compares the live bank with it and, once `grown_since(trained) >= min_growth`,
emits the event `lopd.bank.grown` for the resource `lopd.bank.<id>`; the deployment trigger of
`lopd-retrain/retrain-on-bank-growth` (prefect.yaml) starts a re-training run with the event's run_dir.
lopd-retrain re-runs the pipeline saved in `<run_dir>/pipeline.yaml`: collect comes from the stage cache, the bank
stage sees the grown bank and takes a new snapshot, and everything that reads the bank (cold-start, LOPD training, its
evaluation, the report) runs again; baselines that do not read the bank stay cached. When the growth is a new era's
experience (`lopd-era-shift` with retrain_now off: the rules changed and the students collected on them), it
finishes that re-train instead: every arm from its own student on the new era (flows/era.py).

Debounce, so that one growth burst starts one run: bank-watch emits once per growth and then waits for the
re-training to consume it (or `debounce_s` to pass); the trigger fires at most once per `within` window per
bank; the lopd-retrain deployment runs one flow run at a time and cancels new ones meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.tasks import exponential_backoff

from flows.config import load_config
from flows.era import lopd_era_shift, pending_era
from flows.lifecycle import stop_stages_on_sigterm
from flows.pipeline import PIPELINE_FILE, TRAINED_FILE, lopd_pipeline
from flows.stages import retry_transient

EVENT = "lopd.bank.grown"
WATCH_FILE = "bank-watch.json"  # bank-watch's debounce state: the last growth it announced


def bank_resource_id(location: str, name: str) -> str:
    digest = hashlib.sha256(f"{location}\n{name}".encode()).hexdigest()[:16]
    return f"lopd.bank.{name}.{digest}"


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


@task(
    name="read-bank",
    cache_policy=NO_CACHE,
    retries=3,
    retry_delay_seconds=exponential_backoff(2),
    retry_condition_fn=retry_transient,
)
def read_bank(location: str, name: str, since_version: int) -> dict[str, int]:
    """Version, size and growth since `since_version` of the live bank (a busy embedded bank is retried)."""
    from components.memory import ExperienceBank

    with ExperienceBank.open(location, name, create=False) as b:
        return {"version": b.version, "count": b.count(), "grown": b.grown_since(since_version)}


@flow(name="bank-watch", log_prints=True)
def bank_watch(run_dir: str = "runs/local", min_growth: int = 50, debounce_s: float = 3600.0) -> dict[str, Any]:
    """Emit `lopd.bank.grown` when the bank of `run_dir` has grown by >= min_growth entries since training.

    Args:
        run_dir: The pipeline run directory whose bank is watched (its trained.json names the trained version);
            one without a trained pipeline fails the run.
        min_growth: New bank entries since training that make the bank count as grown.
        debounce_s: Seconds after an event before the same bank may emit again.
    """
    root = Path(run_dir).expanduser().resolve()
    trained = _read_json(root / TRAINED_FILE)
    if trained is None:  # a schedule watching nothing must not report green every 15 minutes
        raise ValueError(
            f"run_dir={run_dir!r}: no trained pipeline there ({root / TRAINED_FILE} is missing), so there is no bank "
            "to watch. Set run_dir to the run_dir of a pipeline that has finished (`lopd run CONFIG`), or turn "
            "this schedule off"
        )
    logger = get_run_logger()
    location, name = trained["bank_location"], trained["bank_name"]
    bank = read_bank(location, name, int(trained["bank_version"]))
    out = {"run_dir": str(root), "trained_version": trained["bank_version"], **bank, "min_growth": min_growth}
    if bank["grown"] < min_growth:
        logger.info(
            "bank %s grew by %d entries since v%s (< %d): no re-training",
            name,
            bank["grown"],
            trained["bank_version"],
            min_growth,
        )
        return {**out, "status": "waiting"}
    watch = _read_json(root / WATCH_FILE) or {}
    pending = int(watch.get("announced_version", -1))
    if pending > int(trained["bank_version"]) and time.time() - float(watch.get("announced_at", 0)) < debounce_s:
        logger.info("growth up to v%d already announced; waiting for its re-training", pending)
        return {**out, "status": "pending", "announced_version": pending}
    resource = {
        "prefect.resource.id": bank_resource_id(location, name),
        "prefect.resource.name": name,
        "lopd.run_dir": str(root),
    }
    payload = {
        "run_dir": str(root),
        "bank_location": location,
        "bank_name": name,
        **bank,
        "trained_version": int(trained["bank_version"]),
    }
    event = emit_event(EVENT, resource=resource, payload=payload)
    (root / WATCH_FILE).write_text(
        json.dumps(
            {
                "announced_version": bank["version"],
                "announced_at": time.time(),
                "event_id": str(event.id) if event else None,
            }
        )
    )
    logger.info(
        "bank %s grew by %d entries (v%s -> v%d): emitted %s",
        name,
        bank["grown"],
        trained["bank_version"],
        bank["version"],
        EVENT,
    )
    return {**out, "status": "emitted", "event_id": str(event.id) if event else None}


def _retrain_run_name() -> str:
    """The flow run's name: what triggered it ("retrain bank v7 of runs/demo"), not a random "strong-uakari"."""
    from prefect.runtime import flow_run

    params = flow_run.parameters or {}
    version = params.get("bank_version")
    return f"retrain bank {f'v{version}' if version is not None else '(scheduled)'} of {params.get('run_dir')}"


@flow(name="lopd-retrain", log_prints=True, flow_run_name=_retrain_run_name)
def lopd_retrain(run_dir: str = "runs/local", bank_version: int | None = None, min_growth: int = 1) -> dict[str, Any]:
    """Re-train the pipeline of `run_dir` on a fresh snapshot of its grown bank (event-triggered or scheduled).

    `bank_version`: the version that triggered the run (from the event; informational). Runs the pipeline only
    when the bank has grown by >= `min_growth` entries since the last training.

    Args:
        run_dir: The pipeline run directory to re-train (its pipeline.yaml is the config).
        bank_version: The bank version that triggered the run (from the event; informational).
        min_growth: New bank entries since the last training needed to re-train.
    """
    with stop_stages_on_sigterm():  # SIGTERM stops the pipeline's stages first (flows.lifecycle)
        return _retrain(run_dir, bank_version, min_growth)


def _retrain(run_dir: str, bank_version: int | None, min_growth: int) -> dict[str, Any]:
    logger = get_run_logger()
    root = Path(run_dir).expanduser().resolve()
    if not (root / PIPELINE_FILE).exists():
        raise FileNotFoundError(f"{root / PIPELINE_FILE} does not exist: run the pipeline on {root} first")
    cfg = load_config(root / PIPELINE_FILE)
    trained = _read_json(root / TRAINED_FILE)
    if trained is not None:
        bank = read_bank(trained["bank_location"], trained["bank_name"], int(trained["bank_version"]))
        if bank["grown"] < min_growth:
            logger.info(
                "bank grew by %d (< %d) since v%s: models are up to date",
                bank["grown"],
                min_growth,
                trained["bank_version"],
            )
            return {"status": "up-to-date", "run_dir": str(root), **bank}
        logger.info(
            "re-training on bank v%d (%d new entries; event version %s)", bank["version"], bank["grown"], bank_version
        )
        version = bank["version"]
    else:
        version = bank_version
    trigger = f"retrain bank v{version}" if version is not None else "retrain"
    # the pipeline's flow run and its MLflow pipeline run say what started them (Tag.TRIGGER, tags retrain, bank-vN)
    with tags("retrain", *([f"bank-v{version}"] if version is not None else [])):
        era = pending_era(root)
        if era is not None:  # the rules changed and the students' new experience arrived: each re-trains (flows/era)
            summary = lopd_era_shift.with_options(flow_run_name=f"{trigger}: era {era}")(
                config=cfg, overrides=(), era=era
            )
            return {"status": f"retrained era {era}", "run_dir": str(root), "era": summary}
        summary = lopd_pipeline.with_options(flow_run_name=trigger)(config=cfg)
    return {"status": "retrained", "run_dir": str(root), "pipeline": summary}
