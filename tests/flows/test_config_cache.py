"""Pipeline config, stage cache keys and the cache index, retry classification: fast, no Prefect server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.bank import BankSpec
from components.common import StageResult
from components.tracking import TrackingError, TrackingUnavailableError
from components.train import TrainSpec
from flows.cache import StageCache, code_version, stage_key
from flows.config import PipelineConfig, load_config
from flows.stages import StageRunError, is_transient
from lopd_core.artifacts import ArtifactRef

ROOT = Path(__file__).resolve().parents[2]
SHA = "a" * 64


def ref(sha: str = SHA, uri: str = "/store/dataset/x/trajectories.jsonl", **meta: object) -> ArtifactRef:
    return ArtifactRef(uri=uri, kind="dataset", sha256=sha, metadata=dict(meta))


@pytest.mark.parametrize("name", ["tiny", "demo", "demo-smollm2", "study-cpu", "study-rules", "paper"])
def test_presets_load(name):
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    assert cfg.methods and cfg.seeds
    assert cfg.run_dir == f"runs/{name}"


def test_paper_preset_has_the_reference_settings():
    cfg = load_config(ROOT / "configs" / "paper.yaml")
    lopd = cfg.lopd
    assert (lopd.n_retrieved, lopd.n_queries, lopd.top_m) == (3, 32, 20)
    assert (lopd.margin_target, lopd.anchor_weight, lopd.dual_lr, lopd.composer_lr) == (0.05, 0.2, 0.5, 1e-5)
    assert (cfg.train.schedule.tasks_per_step, cfg.train.schedule.steps) == (32, 100)
    assert PipelineConfig().lopd == lopd.model_copy(update={"method": "lopd"})  # the defaults are the paper's


def test_overrides_and_errors(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        ["train.schedule.steps=7", "methods=[lopd, grpo]", "train.schedule.samples_per_task=2", f"run_dir={tmp_path}"],
    )
    assert cfg.train.schedule.steps == 7 and cfg.methods == ["lopd", "grpo"]
    assert cfg.resolved_run_dir() == tmp_path.resolve()
    assert cfg.resolved_tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    with pytest.raises(ValueError, match="top_m"):
        load_config(None, ["lopd.top_m=0"])
    with pytest.raises(ValueError, match="group size"):
        load_config(None, ["methods=[grpo]"])
    with pytest.raises(ValueError, match=r"arm 'sdpo' \(sdpo\) needs train.schedule.samples_per_task >= 2"):
        load_config(None, ["methods=[sdpo]"])  # the registry's rule, the same for every method that has one
    with pytest.raises(ValueError, match=r"(?i)extra"):
        load_config(None, ["trian.steps=3"])
    with pytest.raises(FileNotFoundError, match="configs/"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["run_dir=runs/x", "bank.location=banks/b"]).resolved()
    assert cfg.run_dir == str(tmp_path / "runs/x") and cfg.bank.location == str(tmp_path / "banks/b")
    assert load_config(None, ["bank.location=http://qdrant:6333"]).resolved().bank.location == "http://qdrant:6333"


def _train_spec(**update: object) -> TrainSpec:
    base = {"dataset": ref(), "lopd": {"method": "sdft"}, "run_dir": "/runs/a", "schedule": {"steps": 2}}
    return TrainSpec.model_validate({**base, **update})


def test_key_ignores_bookkeeping_and_locations():
    key = stage_key("train", _train_spec())
    same = _train_spec(
        run_dir="/elsewhere",
        tracking_uri="http://mlflow:5000",
        experiment="x",
        parent_run_id="p",
        tags={"prefect.flow_run_id": "f"},
        artifact_root="s3://bucket/a",
    )
    assert stage_key("train", same) == key
    moved = _train_spec(dataset=ref(uri="s3://bucket/dataset/x/t.jsonl", source_run="another-run"))
    assert stage_key("train", moved) == key  # inputs count by digest, not by location or metadata


def test_key_changes_with_inputs_parameters_code_and_stage(monkeypatch):
    key = stage_key("train", _train_spec())
    assert stage_key("train", _train_spec(dataset=ref(sha="b" * 64))) != key
    assert stage_key("train", _train_spec(schedule={"steps": 3})) != key
    assert stage_key("collect", _train_spec()) != key
    monkeypatch.setenv("LOPD_CODE_VERSION", "v-test")
    assert code_version() == "v-test" and stage_key("train", _train_spec()) != key


def test_code_version_is_a_digest_of_the_sources(monkeypatch):
    monkeypatch.delenv("LOPD_CODE_VERSION", raising=False)
    assert len(code_version()) == 64 and code_version() == code_version()


def test_cache_roundtrip_and_invalidation(tmp_path):
    artifact = tmp_path / "store" / "x.jsonl"
    artifact.parent.mkdir()
    artifact.write_text("{}\n")
    result = StageResult(stage="collect", artifacts={"dataset": ref(uri=str(artifact))}, metrics={"n": 1.0})
    cache = StageCache(str(tmp_path / "store"))
    assert cache.get("collect", "k1") is None
    path = cache.put("collect", "k1", result, state={"bank_version": 2}, material={"spec": {"n_tasks": 4}})
    assert json.loads(Path(path).read_text())["material"] == {"spec": {"n_tasks": 4}}
    assert cache.get("collect", "k1", {"bank_version": 2}) == result
    assert cache.get("collect", "k1", {"bank_version": 3}) is None  # the outside state moved on (the bank grew)
    assert cache.get("collect", "k2") is None
    artifact.unlink()
    assert cache.get("collect", "k1", {"bank_version": 2}) is None  # an artifact it names is gone


def test_bank_spec_key_covers_the_bank_location():
    a = BankSpec(dataset=ref(), bank_location="/banks/a")
    assert stage_key("bank", a) != stage_key("bank", a.model_copy(update={"bank_location": "/banks/b"}))


def test_transient_errors_are_retried_others_are_not():
    assert is_transient(TrackingUnavailableError("MLflow unreachable"))
    assert is_transient(TrackingError("log_batch kept failing"))
    assert is_transient(ConnectionRefusedError())
    assert is_transient(RuntimeError("bank directory /x is in use by another process; ..."))
    assert is_transient(StageRunError("pod evicted", crashed=True))
    wrapped = ValueError("stage failed")
    wrapped.__cause__ = TimeoutError()
    assert is_transient(wrapped)
    assert not is_transient(ValueError("method 'lopd' needs bank_snapshot"))
    assert not is_transient(FileNotFoundError("no such checkpoint"))
    assert not is_transient(StageRunError("the stage raised", crashed=False))
    assert not is_transient(None)


def test_prefect_links_are_written_only_when_there_is_a_ui():
    from flows.pipeline import ui_link

    assert ui_link("None/flow-runs/flow-run/123") is None  # an in-process run without PREFECT_UI_URL
    assert ui_link(None) is None and ui_link("") is None
    url = "http://127.0.0.1:4200/flow-runs/flow-run/123"
    assert ui_link(url) == url


def test_compare_names_what_exists_instead_of_creating_stores_or_experiments(tmp_path):
    from mlflow.tracking import MlflowClient
    from typer.testing import CliRunner

    from flows.cli import app

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    MlflowClient(f"sqlite:///{run / 'mlflow.db'}").create_experiment("lopd")
    runner = CliRunner()
    missing = runner.invoke(app, ["compare", "--run-dir", str(tmp_path / "runs" / "r2")])
    assert missing.exit_code == 2 and "holds no MLflow store" in missing.output and str(run) in missing.output
    assert not (tmp_path / "runs" / "r2").exists()
    typo = runner.invoke(app, ["compare", "--run-dir", str(run), "--experiment", "lopdd"])
    assert typo.exit_code == 2 and "no experiment 'lopdd'" in typo.output and "it has: Default, lopd" in typo.output
    assert sorted(e.name for e in MlflowClient(f"sqlite:///{run / 'mlflow.db'}").search_experiments()) == [
        "Default",
        "lopd",
    ]


def test_config_errors_name_the_field_suggest_a_near_miss_and_carry_no_urls():
    with pytest.raises(ValueError) as err:
        load_config(ROOT / "configs" / "tiny.yaml", ["train.schedule.stepz=3", "lopd.top_m=abc"])
    text = str(err.value)
    assert "train.schedule.stepz: Extra inputs are not permitted (did you mean 'train.schedule.steps'?)" in text
    assert "lopd.top_m: Input should be a valid integer" in text
    assert "errors.pydantic.dev" not in text


def test_presets_are_the_config_files_and_overrides_apply_on_top():
    from typing import get_args

    from flows.config import CONFIG_DIR, Preset, load_config, preset_config, with_overrides

    assert {f"{p}.yaml" for p in get_args(Preset)} <= {f.name for f in CONFIG_DIR.glob("*.yaml")}
    tiny = preset_config("tiny", ["seeds=[0, 1]", "lopd.gradient_checkpointing=true"])
    assert tiny.backbone == "tiny" and tiny.seeds == [0, 1] and tiny.lopd.gradient_checkpointing is True
    assert tiny.collect == load_config(CONFIG_DIR / "tiny.yaml").collect
    with pytest.raises(ValueError, match=r"preset='tiniest': choose one of tiny, demo"):
        preset_config("tiniest")
    with pytest.raises(ValueError, match=r"train\.schedule\.stepz"):
        with_overrides(tiny, ["train.schedule.stepz=3"])
    assert with_overrides(tiny, ["train.schedule.steps=7"]).train.schedule.steps == 7
    assert with_overrides(tiny, []) is tiny


def test_arms_share_a_cold_start_unless_their_composer_or_cold_start_differs():
    """fig. 3's arms (another margin, a frozen composer) read LOPD's cold-started composer; an arm whose composer
    settings or cold_start.* differ gets a cold start of its own (a memorising reader, another latent space)."""
    from flows.config import Variant, load_config
    from flows.specs import cold_start_spec
    from flows.stages import stage_key
    from lopd_core.artifacts import ArtifactRef

    variants = {
        "lopd m=0": Variant(method="lopd", overrides={"lopd.margin_target": 0.0, "lopd.freeze_composer": True}),
        "lopd memorising": Variant(
            method="lopd", overrides={"lopd.latent_values": "states", "cold_start.relabel_codes": "none"}
        ),
    }
    cfg = load_config("configs/study-rules.yaml", ["lopd.latent_values=tokens", "cold_start.relabel_codes=pool"])
    cfg = cfg.model_copy(update={"variants": variants})
    ref = ArtifactRef(uri="/x", kind="dataset", sha256="0" * 64)
    common = {"run_dir": "/tmp/r", "artifact_root": "/tmp/r/a", "tracking_uri": "sqlite:///x", "parent_run_id": "p"}

    def key(arm, seed=0):
        return stage_key("cold_start", cold_start_spec(cfg, common, seed, ref, ref, None, arm))

    assert key("lopd m=0") == key("lopd") != key("lopd", seed=1)
    assert key("lopd memorising") != key("lopd")
    lopd, cold = cfg.arm_cold_start("lopd memorising", 0)
    assert lopd.latent_values == "states" and cold.relabel_codes == "none" and lopd.margin_target == 0.05
    with pytest.raises(ValueError, match="keys are dotted under"):
        cfg.model_copy(update={"variants": {"x": Variant(method="lopd", overrides={"sft.steps": 1})}}).arm_config("x")


def test_a_benchmark_on_other_house_rules_than_the_suite_is_refused():
    from flows.config import load_config

    with pytest.raises(ValueError, match=r"evaluate.benchmarks\[0\].name='toolworld-rules-s1-digits' scores other"):
        load_config("configs/study-rules.yaml", ["suite=toolworld-rules-s3-digits"])
    cfg = load_config("configs/study-rules.yaml", ["suite=toolworld-rules-s3-digits", "evaluate.benchmarks=[{name: "
                      "toolworld-rules-s3-digits, key: toolworld-rules, difficulties: [1, 2]}]"])  # fmt: skip
    assert cfg.suite == "toolworld-rules-s3-digits"


def test_a_draw_moves_the_suite_its_benchmarks_and_its_bank_but_not_the_warm_start():
    from flows.config import load_config
    from flows.specs import sft_spec

    cfg = load_config("configs/study-rules.yaml", ["draws=[1, 3]"])
    three = cfg.for_draw(3)
    assert three.suite == "toolworld-rules-s3-digits" and three.draws is None and three.bank.name == "experience-s3"
    assert {b.name for b in three.evaluate.benchmarks} == {"toolworld-rules-s3-digits"}
    common = {"run_dir": "/tmp/r", "artifact_root": "/tmp/r/a", "tracking_uri": "sqlite:///x", "parent_run_id": "p"}
    vanilla = {d: sft_spec(cfg.for_draw(d), common) for d in (1, 3)}
    assert vanilla[1] == vanilla[3] and vanilla[1].suite == "toolworld-rules-digits"  # one warm start for every draw
    assert sft_spec(cfg.for_draw(1), common, oracle=True) != sft_spec(cfg.for_draw(3), common, oracle=True)
    with pytest.raises(ValueError, match="draws: rule draws need a toolworld-rules suite"):
        load_config("configs/study-cpu.yaml", ["draws=[1]"])


def test_the_vanilla_and_oracle_warm_starts_write_their_own_folders_at_once(tmp_path):
    """Issue 41 (no stale state): the two warm starts of a rules study, built at the same time as the pipeline
    builds them (its stage tasks run side by side), each write their own stage folder (<run_dir>/stages/sft/<key>),
    so neither overwrites the other's model or demonstrations."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow.tracking import MlflowClient

    from flows.cache import stage_key
    from flows.config import load_config
    from flows.specs import common_fields, sft_spec
    from flows.stages import StageContext, execute_stage

    small = ["sft.steps=2", "sft.batch_size=4", "sft.n_demonstrations=6", "sft.pool_per_level=0", "sft.warmup_steps=1"]
    cfg = load_config("configs/study-rules.yaml", [f"run_dir={tmp_path}", "backbone=tiny", *small])
    common = common_fields(cfg, "", {})
    MlflowClient(common["tracking_uri"]).search_experiments()  # the store exists, as the pipeline's run makes it
    ctx = StageContext(run_dir=str(tmp_path), cache_root=str(tmp_path / "cache"))
    specs = {}
    for name, spec in (("vanilla", sft_spec(cfg, common)), ("oracle", sft_spec(cfg, common, oracle=True))):
        key = stage_key("sft", spec)
        specs[name] = (spec.model_copy(update={"run_dir": ctx.stage_dir("sft", key)}), key)
    assert specs["vanilla"][1] != specs["oracle"][1]
    with ThreadPoolExecutor(2) as pool:
        runs = {n: pool.submit(execute_stage, "sft", s, ctx.cache_root, k) for n, (s, k) in specs.items()}
        results = {n: f.result() for n, f in runs.items()}
    models = {n: Path(r.artifacts["model"].uri) for n, r in results.items()}
    assert models["vanilla"] != models["oracle"] and all((m / "config.json").is_file() for m in models.values())
    demos = {n: (Path(s.run_dir) / "sft" / "demonstrations.jsonl").read_text() for n, (s, _) in specs.items()}
    assert demos["vanilla"] != demos["oracle"]  # uniform codes vs the right ones: each kept its own
