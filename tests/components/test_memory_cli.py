"""`python -m components.memory.cli` (mounted as `lopd bank`): ingest, query, stats, snapshot, restore, audit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from components.memory.backends import edge_available
from components.memory.cli import bank_app

runner = CliRunner()


def traj(task_id: str, task: str, reward: float = 1.0, split: str = "train", trace: str = "") -> dict:
    messages = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": f'{{"name": "solve", "arguments": {{"id": "{task_id}"}}}}'},
        {"role": "tool", "content": "done"},
    ]
    return {
        "task_id": task_id,
        "env_id": "env",
        "task": task,
        "messages": messages,
        "reward": reward,
        "split": split,
        "trace": trace,
    }


def invoke(*args: str) -> tuple[int, dict | list]:
    result = runner.invoke(bank_app, list(args))
    out = result.stdout.strip()
    return result.exit_code, (json.loads(out) if out.startswith(("{", "[")) else {"stderr": result.output})


def test_cli_round_trip(tmp_path: Path):
    data = tmp_path / "trajectories.jsonl"
    lines = [
        json.dumps(traj("t1", "Water the plants in the garden")),
        json.dumps(traj("t2", "Water the plants on the balcony", trace="water(balcony) -> ok")),
        json.dumps(traj("t3", "Feed the cat", reward=0.0)),  # a failure: skipped
        "{not json",
        json.dumps(traj("t4", "Walk the dog", reward=2.0)),  # not a valid Trajectory
        json.dumps({**traj("t5", "Empty trace and no actions"), "messages": [{"role": "user", "content": "x"}]}),
        json.dumps(traj("t6", "Walk the dog")),
    ]
    data.write_text("\n".join(lines) + "\n")
    bank = ["--location", str(tmp_path / "banks"), "--name", "garden"]

    code, report = invoke("ingest", str(data), *bank, "--embedder", "hashing-384", "--source-run", "run-1")
    assert code == 0, report
    assert (report["added"], report["skipped_failures"], report["count"], report["version"]) == (3, 1, 3, 1)
    assert len(report["unreadable"]) == 2 and any(":4: not JSON" in e for e in report["unreadable"])
    assert any("t4" in e and "reward must lie in [0, 1]" in e for e in report["unreadable"])
    assert report["rejected"] == ["record 2 (task_id='t5'): trace is empty"]
    code, again = invoke("ingest", str(data), *bank)
    assert code == 0 and (again["added"], again["duplicates"], again["version"]) == (0, 3, 1)

    code, hits = invoke("query", "Water the plants in the garden", "--task-id", "t1", "-k", "2", *bank)
    assert code == 0 and [h["task_id"] for h in hits] == ["t2", "t6"]
    code, stats = invoke("stats", *bank)
    assert code == 0 and stats["count"] == 3 and stats["embedder"] == "hashing-384" and stats["search"] == "exact"

    code, ref = invoke("snapshot", "--dest", str(tmp_path / "snaps"), *bank)
    assert code == 0 and ref["kind"] == "bank_snapshot" and ref["metadata"]["version"] == 1
    ref_file = tmp_path / "ref.json"
    ref_file.write_text(json.dumps(ref))
    code, restored = invoke("restore", str(ref_file), "--location", str(tmp_path / "copy"), "--name", "g2")
    assert code == 0 and restored["count"] == 3

    evals = tmp_path / "eval.jsonl"
    evals.write_text(json.dumps({"task_id": "e1", "task": "walk the DOG"}) + "\nt2\n")
    code, audit = invoke("audit", "--eval", str(evals), *bank)
    assert code == 1 and audit["eval_task_ids_found"] == ["t2"] and audit["eval_task_texts_found"] == ["t6"]
    evals.write_text("e1\n")
    assert invoke("audit", "--eval", str(evals), *bank)[0] == 0


def test_cli_refuses_evaluation_split_and_missing_bank(tmp_path: Path):
    data = tmp_path / "eval.jsonl"
    data.write_text(json.dumps(traj("e1", "Held-out task", split="test")) + "\n")
    bank = ["--location", str(tmp_path / "banks"), "--name", "b", "--embedder", "hashing-384"]
    result = runner.invoke(bank_app, ["ingest", str(data), *bank])
    assert result.exit_code == 2 and "only 'train'-split successes" in result.output
    result = runner.invoke(bank_app, ["stats", "--location", str(tmp_path / "nowhere"), "--name", "b"])
    assert result.exit_code == 2 and "no bank 'b'" in result.output


def test_cli_refuses_an_evaluate_stages_trajectories_and_says_why(tmp_path: Path):
    data = tmp_path / "trajectories.jsonl"  # as components/evaluate.py writes them: a benchmark and a context
    line = {**traj("h1", "Held-out task"), "benchmark": "toolworld-minimal", "context": "none"}
    data.write_text(json.dumps(traj("t1", "Training task")) + "\n" + json.dumps(line) + "\n")
    bank = ["--location", str(tmp_path / "banks"), "--name", "b", "--embedder", "hashing-64"]
    result = runner.invoke(bank_app, ["ingest", str(data), *bank])
    assert result.exit_code == 2, result.output
    assert f"{data}:2 is an evaluation episode (benchmark 'toolworld-minimal'" in result.output
    assert "must never enter the experience bank" in result.output and "collect stage" in result.output
    assert "unexpected keyword" not in result.output
    assert not (tmp_path / "banks" / "b").exists() or invoke("stats", *bank[:4])[1].get("count", 0) == 0


def test_a_record_of_the_wrong_type_is_reported_by_line_and_field(tmp_path: Path):
    """One `"reward": "1.0"` must not crash the batch: it is reported like the other bad lines."""
    data = tmp_path / "trajectories.jsonl"
    lines = [
        json.dumps(traj("t1", "Water the plants in the garden")),
        json.dumps({**traj("t2", "Feed the cat"), "reward": "1.0"}),
        json.dumps({**traj("t3", "Walk the dog"), "split": 3}),
        json.dumps(traj("t4", "Walk the dog")),
    ]
    data.write_text("\n".join(lines) + "\n")
    bank = ["--location", str(tmp_path / "banks"), "--name", "garden", "--embedder", "hashing-64"]
    code, report = invoke("ingest", str(data), *bank)
    assert code == 0, report
    assert report["added"] == 2 and report["count"] == 2
    assert report["unreadable"] == [
        f"{data}:2 (task_id='t2'): Trajectory 't2': field 'reward' must be a number in [0, 1], got str '1.0'",
        f"{data}:3 (task_id='t3'): Trajectory 't3': field 'split' must be a str, got int 3",
    ]


ENGINES = {"local": ("qdrant", "meta.json"), "edge": ("edge", "edge_config.json")}  # engine dir, a file in it


@pytest.mark.parametrize("backend", list(ENGINES))
def test_a_damaged_bank_directory_is_a_one_line_error_naming_the_file_and_the_fix(tmp_path: Path, backend: str):
    if backend == "edge" and not edge_available():
        pytest.skip("qdrant-edge-py is not installed")
    data = tmp_path / "trajectories.jsonl"
    data.write_text(json.dumps(traj("t1", "Water the plants in the garden")) + "\n")
    location = tmp_path / "banks"
    bank = ["--location", str(location), "--name", "garden"]
    assert invoke("ingest", str(data), *bank, "--embedder", "hashing-64", "--backend", backend)[0] == 0
    good = tmp_path / "good"
    shutil.copytree(location, good)
    fix = f"Restore it from a snapshot: lopd bank restore SNAPSHOT.json --location {location} --name garden --overwrite"

    def error_line() -> str:
        result = runner.invoke(bank_app, ["stats", *bank])
        assert result.exit_code == 2 and result.stdout == "", result.output
        assert result.stderr.count("\n") == 1, result.stderr
        return result.stderr.strip()

    manifest = location / "garden" / "bank.json"
    manifest.write_text('{"format": 1,')  # cut short
    assert error_line() == (
        f"error: bank 'garden' in {location} is damaged: {manifest} is not valid JSON (Expecting property name "
        f"enclosed in double quotes at line 1 column 14). {fix}"
    )
    manifest.write_text('{"format": 1, "name": "garden"}')
    assert error_line() == (
        f"error: bank 'garden' in {location} is damaged: {manifest} lacks the field(s) backend, embedder, dim, "
        f"min_reward, search. {fix}"
    )

    for damage in ("missing", "unreadable"):
        shutil.rmtree(location)
        shutil.copytree(good, location)
        engine = location / "garden" / ENGINES[backend][0]
        if damage == "missing":
            shutil.rmtree(engine)  # opened as it was, this bank would be silently empty
            assert error_line() == f"error: bank 'garden' in {location} is damaged: {engine} is missing. {fix}"
        else:
            (engine / ENGINES[backend][1]).write_text('{"collections": {"bank": ')
            line = error_line()
            assert line.startswith(f"error: bank 'garden' in {location} is damaged: {engine} cannot be read (")
            assert line.endswith(f"). {fix}")
