"""`lopd bank ...`: ingest, query, stats, snapshot, restore and audit an experience bank.

Runs on its own as `python -m components.memory.cli ingest|query|stats|snapshot|restore|audit`; the
orchestration CLI mounts `bank_app` as `lopd bank`. Every command prints one JSON object on stdout.

    python -m components.memory.cli ingest runs/collect/trajectories.jsonl --location runs/bank --name envscaler
    python -m components.memory.cli query "Book a flight to Rome" --task-id t-17 --location runs/bank
    python -m components.memory.cli audit --eval data/eval.jsonl --location runs/bank   # exit 1 on a leak

Exit codes: 0 ok; 1 an audit found evaluation data; 2 bad input (an evaluation-split record offered to
the bank, a mismatched embedder, an unreadable file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from components.memory import (
    BankDamagedError,
    BankMismatchError,
    ExperienceBank,
    IngestReport,
    SplitLeakError,
    experiences_from_jsonl,
)
from lopd_core.artifacts import ArtifactRef

bank_app = typer.Typer(help="Experience memory: ingest, query, stats, snapshot, restore, audit.", no_args_is_help=True)

Location = Annotated[
    str,
    typer.Option(
        "--location",
        "-l",
        envvar="LOPD_BANK_LOCATION",
        help='":memory:", a directory (embedded Qdrant) or an http(s) URL (Qdrant server).',
    ),
]
Name = Annotated[str, typer.Option("--name", "-n", envvar="LOPD_BANK_NAME", help="Bank (collection) name.")]
EmbedderOpt = Annotated[
    str | None,
    typer.Option(
        "--embedder",
        help="sentence-transformers model name/path, or hashing-<dim>. Default: the bank's own; MiniLM if new.",
    ),
]
Backend = Annotated[str, typer.Option("--backend", help="Embedded engine for a new directory bank: auto|edge|local.")]
DEFAULT_LOCATION = "runs/bank"
DEFAULT_NAME = "experience"


def _print(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _api_key() -> str | None:
    return os.environ.get("QDRANT_API_KEY") or None


def _open(location: str, name: str, embedder: str | None, create: bool = False, **kwargs: Any) -> ExperienceBank:
    try:
        return ExperienceBank.open(location, name, embedder, api_key=_api_key(), create=create, **kwargs)
    except (BankDamagedError, BankMismatchError, FileNotFoundError, RuntimeError) as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


@bank_app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Trajectory JSON-lines files (lopd_core.conversation).")],
    location: Location = DEFAULT_LOCATION,
    name: Name = DEFAULT_NAME,
    embedder: EmbedderOpt = None,
    min_reward: Annotated[float, typer.Option(help="Success threshold: lower rewards are skipped.")] = 1.0,
    source_run: Annotated[str, typer.Option(help="Run id recorded on each new entry.")] = "",
    backend: Backend = "auto",
) -> None:
    """Add the successful trajectories of JSON-lines files to the bank (idempotent)."""
    records, errors, skipped = [], [], 0
    for path in paths:
        if not path.is_file():
            _fail(f"no such file: {path}")
        with open(path, encoding="utf-8") as fh:
            try:
                got, errs, skip = experiences_from_jsonl(fh, min_reward, source_run=source_run, origin=str(path))
            except SplitLeakError as exc:  # an evaluate stage's episodes: nothing of the file is stored
                _fail(str(exc))
        records += got
        errors += errs
        skipped += skip
    with _open(location, name, embedder, create=True, min_reward=min_reward, backend=backend) as bank:
        try:
            report: IngestReport = bank.ingest(records)
        except SplitLeakError as exc:
            _fail(str(exc))
        _print({**report.to_dict(), "skipped_failures": skipped, "unreadable": errors, "backend": bank.backend_kind})


@bank_app.command()
def query(
    task: Annotated[str, typer.Argument(help="Task text to retrieve experiences for.")],
    task_id: Annotated[str, typer.Option("--task-id", help="The query's own task id (its entries are excluded).")],
    k: Annotated[int, typer.Option("-k", help="Number of experiences.")] = 3,
    location: Location = DEFAULT_LOCATION,
    name: Name = DEFAULT_NAME,
    embedder: EmbedderOpt = None,
    allow_self_retrieval: Annotated[
        bool, typer.Option(help="Reproduce the reference code: a task may retrieve its own entries (leaks).")
    ] = False,
) -> None:
    """Top-k experiences for a task, best first."""
    with _open(location, name, embedder) as bank:
        hits = bank.retrieve(task, task_id, k=k, allow_self_retrieval=allow_self_retrieval)
        _print([{"task_id": e.task_id, "score": e.score, "task": e.task, "trace": e.trace} for e in hits])


@bank_app.command()
def stats(location: Location = DEFAULT_LOCATION, name: Name = DEFAULT_NAME) -> None:
    """Size, version history, embedder and search mode."""
    with _open(location, name, None) as bank:
        _print(bank.stats())


@bank_app.command()
def snapshot(
    dest: Annotated[Path, typer.Option("--dest", help="Directory to write the snapshot into.")],
    location: Location = DEFAULT_LOCATION,
    name: Name = DEFAULT_NAME,
) -> None:
    """Snapshot the current bank version; prints its artifact reference."""
    with _open(location, name, None) as bank:
        _print(bank.snapshot(dest).to_dict())


@bank_app.command()
def restore(
    ref: Annotated[Path, typer.Argument(help="JSON file with the snapshot's artifact reference.")],
    location: Location = DEFAULT_LOCATION,
    name: Name = DEFAULT_NAME,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing bank directory.")] = False,
) -> None:
    """Restore a bank from a snapshot artifact reference."""
    try:
        artifact = ArtifactRef.from_json(ref.read_text())
        bank = ExperienceBank.restore(artifact, location, name, overwrite=overwrite, api_key=_api_key())
    except (OSError, ValueError) as exc:
        _fail(str(exc))
    with bank:
        _print(bank.stats())


def _eval_tasks(path: Path) -> tuple[set[str], set[str]]:
    """Task ids (and texts) from JSON lines with task_id/task fields, or a plain file of ids."""
    ids, texts = set(), set()
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("{"):
            data = json.loads(line)
            if data.get("task_id") is not None:
                ids.add(str(data["task_id"]))
            if isinstance(data.get("task"), str):
                texts.add(data["task"])
        else:
            ids.add(line)
    return ids, texts


@bank_app.command()
def audit(
    eval_files: Annotated[
        list[Path] | None, typer.Option("--eval", help="Evaluation tasks: JSON lines (task_id, task) or ids.")
    ] = None,
    location: Location = DEFAULT_LOCATION,
    name: Name = DEFAULT_NAME,
) -> None:
    """Report non-training entries and evaluation tasks found in the bank; exit 1 if any."""
    ids: set[str] = set()
    texts: set[str] = set()
    for path in eval_files or []:
        try:
            got_ids, got_texts = _eval_tasks(path)
        except (OSError, json.JSONDecodeError) as exc:
            _fail(f"cannot read {path}: {exc}")
        ids |= got_ids
        texts |= got_texts
    with _open(location, name, None) as bank:
        report = bank.audit(eval_task_ids=ids, eval_tasks=texts)
    _print({**report.to_dict(), "eval_task_ids_checked": len(ids)})
    if not report.ok:
        raise typer.Exit(1)


if __name__ == "__main__":
    bank_app()
