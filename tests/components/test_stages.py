"""The stage components chained in-process on the tiny backbone: collect -> bank -> cold-start -> train.

Real pieces throughout: the toolworld suite in its sandbox, the rollout engine, embedded Qdrant (Edge), an
MLflow sqlite store, the artifact store. The tiny random model never succeeds, so the bank takes every
trajectory (success_threshold=0): this tests the plumbing, not learning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.bank import BankSpec, bank
from components.cold_start import ColdStartSpec, cold_start
from components.collect import CollectSpec, collect
from components.train import TrainSpec, train

SMALL = {"n_queries": 4, "qformer_layers": 2, "encoder_max_tokens": 128}
ROLLOUT = {"max_new_tokens": 16, "max_turns": 2, "batch_size": 4}


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("stages"))
    common = {"run_dir": run_dir, "experiment": "stages-test"}
    c = collect(CollectSpec(**common, backbone="tiny", n_tasks=4, samples_per_task=2, rollout=ROLLOUT))
    b = bank(BankSpec(**common, dataset=c.artifacts["dataset"], success_threshold=0.0, embedder="hashing-64"))
    cold_spec = ColdStartSpec(**common, backbone="tiny", dataset=c.artifacts["dataset"],
                              bank_snapshot=b.artifacts["bank_snapshot"], success_threshold=0.0,
                              lopd=SMALL, cold={"steps": 2, "batch_size": 4})  # fmt: skip
    cs = cold_start(cold_spec)
    spec = TrainSpec(**common, backbone="tiny", dataset=c.artifacts["dataset"],
                     bank_snapshot=b.artifacts["bank_snapshot"], composer=cs.artifacts["composer"], lopd=SMALL,
                     schedule={"steps": 2, "tasks_per_step": 2, "checkpoint_every": 1}, rollout=ROLLOUT)  # fmt: skip
    t = train(spec)
    return {"collect": c, "bank": b, "cold": cs, "cold_spec": cold_spec, "train": t, "spec": spec, "run_dir": run_dir}


def test_collect_writes_every_trajectory(chain):
    c = chain["collect"]
    path = c.artifacts["dataset"].uri
    with open(path) as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 8 == c.metrics["n_trajectories"] == c.metrics["generations"]
    assert all(r["split"] == "train" and r["metadata"]["generations"] == 1 for r in rows)


def test_bank_holds_the_dataset_and_snapshots_it(chain):
    b = chain["bank"]
    assert b.metrics["count"] == 8 and b.metrics["version"] == 1
    assert b.artifacts["bank_snapshot"].kind == "bank_snapshot"


def test_train_logs_curves_and_resumes_in_the_same_run(chain):
    t, spec = chain["train"], chain["spec"]
    assert t.metrics["steps"] == 2 and t.metrics["generations_total"] == 4
    client = MlflowClient(f"sqlite:///{chain['run_dir']}/mlflow.db")
    margins = client.get_metric_history(t.mlflow_run_id, "train/margin")
    assert [m.step for m in margins] == [0, 1]
    more = train(spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"steps": 3})}))
    assert more.mlflow_run_id == t.mlflow_run_id and more.metrics["steps"] == 3
    assert [m.step for m in client.get_metric_history(t.mlflow_run_id, "train/beta")] == [0, 1, 2]
    with pytest.raises(ValueError, match="another method config"):
        train(spec.model_copy(update={"lopd": spec.lopd.model_copy(update={"top_m": 5})}))


def test_distributed_train_stage_with_two_gloo_ranks(chain):
    """nproc=2: the stage relaunches itself under torchrun (gloo on CPU); rank 0 logs one MLflow run and writes
    the checkpoint, whose generation count sums both ranks' rollouts."""
    spec = chain["spec"].model_copy(update={"nproc": 2, "lopd": chain["spec"].lopd.model_copy(update={"seed": 1})})
    t = train(spec)
    assert t.metrics["steps"] == 2 and t.metrics["generations_total"] == 4  # 2 steps x 2 tasks, one per rank
    client = MlflowClient(f"sqlite:///{chain['run_dir']}/mlflow.db")
    assert [m.step for m in client.get_metric_history(t.mlflow_run_id, "train/beta")] == [0, 1]
    assert [m.value for m in client.get_metric_history(t.mlflow_run_id, "train/generations")] == [2.0, 2.0]
    state = json.loads((Path(chain["run_dir"]) / "train" / "lopd-seed1" / "last" / "state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 2 and state["generations"] == 4
    with pytest.raises(ValueError, match="tasks_per_step=2 is below nproc=3"):
        TrainSpec(**{**spec.model_dump(), "nproc": 3})


def test_distributed_fsdp_train_stage_with_two_gloo_ranks(chain):
    """Full fine-tuning with nproc=2 shards the student with FSDP2: real rollouts, where the ranks run different
    numbers of forward passes (the student gathered whole), a checkpoint of whole tensors, and a resume."""
    from safetensors.torch import load_file

    from lopd_core.backbone import load_backbone

    lopd = chain["spec"].lopd.model_copy(update={"seed": 2, "student_mode": "full"})
    spec = chain["spec"].model_copy(update={"nproc": 2, "lopd": lopd})
    t = train(spec)
    assert t.metrics["steps"] == 2 and t.metrics["generations_total"] == 4
    last = Path(chain["run_dir"]) / "train" / "lopd-seed2" / "last"
    assert json.loads((last / "state.json").read_text())["world_size"] == 2
    weights = load_file(str(last / "weights.safetensors"))
    backbone, _ = load_backbone("tiny")
    for name, p in backbone.named_parameters():  # every student weight whole, not a rank's shard
        if name != "lm_head.weight":  # tied to the embedding
            assert weights[f"student.{name}"].shape == p.shape, name
    more = train(spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"steps": 3})}))
    assert more.mlflow_run_id == t.mlflow_run_id and more.metrics["steps"] == 3
    client = MlflowClient(f"sqlite:///{chain['run_dir']}/mlflow.db")
    assert [m.step for m in client.get_metric_history(t.mlflow_run_id, "train/loss")] == [0, 1, 2]


def test_pytorchjob_ranks_run_the_stage_and_rank0_caches_its_result(chain, tmp_path):
    """What every pod of a multi-node train stage's PyTorchJob runs (flows.pytorchjob): `torchrun -m flows.stages
    train SPEC RESULT --cache-root ROOT --cache-key KEY`. Here one host with 2 gloo ranks stands for nodes=2 x
    nproc=1: rank 0 stores the result in the stage cache, where the submitting stage flow reads it."""
    from flows.cache import StageCache

    lopd = chain["spec"].lopd.model_copy(update={"seed": 4})
    spec = chain["spec"].model_copy(update={"nodes": 2, "nproc": 1, "lopd": lopd})
    with pytest.raises(ValueError, match="a multi-node run is a PyTorchJob"):
        train(spec)  # not under torchrun: only the PyTorchJob runs it
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    key, root = "c" * 64, str(tmp_path / "stage-cache")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "flows.stages",
           "train", str(tmp_path / "spec.json"), str(tmp_path / "result.json"), "--cache-root", root, "--cache-key",
           key]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = StageCache(root).get("train", key)
    assert result is not None and result.metrics["steps"] == 2 and result.metrics["generations_total"] == 4
    assert result.artifacts["checkpoint"].kind == "checkpoint"  # rank 0's, not a rank > 0 placeholder
    state = json.loads((Path(chain["run_dir"]) / "train" / "lopd-seed4" / "last" / "state.json").read_text())
    assert state["world_size"] == 2


def test_distributed_cold_start_stage_with_two_gloo_ranks(chain):
    """The composer's cold start with nproc=2: rank 0 logs one run with every step and writes the composer."""
    spec = ColdStartSpec(**{**chain["cold_spec"].model_dump(), "nproc": 2, "run_dir": chain["run_dir"] + "/dp"})
    result = cold_start(spec)
    assert result.artifacts["composer"].kind == "checkpoint" and result.metrics["anchor_cache"] > 0
    client = MlflowClient(f"sqlite:///{chain['run_dir']}/dp/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("stages-test").experiment_id])
    assert [r.info.run_id for r in runs] == [result.mlflow_run_id]  # rank 1 logged nothing
    assert [m.step for m in client.get_metric_history(result.mlflow_run_id, "cold_start/nll")] == [0, 1]
    with pytest.raises(ValueError, match=r"cold\.batch_size=4 is below nproc=5"):
        ColdStartSpec(**{**spec.model_dump(), "nproc": 5})


def test_distributed_sft_stage_with_two_gloo_ranks(tmp_path):
    """The warm start with nproc=2: torchrun, gloo, FSDP2; rank 0 logs one MLflow run (every step) and stores the
    model whole, loadable as the plain architecture."""
    from transformers import AutoModelForCausalLM

    from components.sft import SFTSpec, run_sft

    spec = SFTSpec(run_dir=str(tmp_path), experiment="stages-test", backbone="tiny", suite="toolworld-compact",
                   sft={"steps": 3, "batch_size": 4, "n_demonstrations": 6, "warmup_steps": 1}, nproc=2)  # fmt: skip
    result = run_sft(spec)
    assert result.artifacts["model"].kind == "model" and result.metrics["n_demonstrations"] == 6
    config = json.loads((Path(result.artifacts["model"].uri) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not FSDP's wrapper class
    _, info = AutoModelForCausalLM.from_pretrained(result.artifacts["model"].uri, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("stages-test").experiment_id])
    assert [r.info.run_id for r in runs] == [result.mlflow_run_id]  # rank 1 logged nothing
    assert [m.step for m in client.get_metric_history(result.mlflow_run_id, "sft/nll")] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"sft\.batch_size=4 is below nproc=5"):
        SFTSpec(**{**spec.model_dump(), "nproc": 5})


def test_lopd_train_needs_bank_and_composer(chain):
    with pytest.raises(ValueError, match="needs bank_snapshot"):
        TrainSpec(dataset=chain["collect"].artifacts["dataset"])
    for method in ("grpo", "sdpo"):  # both need a group of rollouts per task
        with pytest.raises(ValueError, match=f"'{method}' needs schedule.samples_per_task >= 2"):
            TrainSpec(dataset=chain["collect"].artifacts["dataset"], lopd={"method": method},
                      schedule={"samples_per_task": 1})  # fmt: skip
    TrainSpec(dataset=chain["collect"].artifacts["dataset"], lopd={"method": "sdpo"}, schedule={"samples_per_task": 2})


def test_stage_cli_help_and_spec_errors():
    out = subprocess.run([sys.executable, "-m", "components.train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "lopd.top_m" in out.stdout and "schedule.steps" in out.stdout
    assert out.stdout.startswith("usage: python -m components.train ")  # not `python -m __main__`
    assert "PydanticUndefined" not in out.stdout and "  dataset = (required)" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "components.collect", "n_tasks=0", "--print-spec"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "n_tasks" in bad.stderr


def test_a_failed_train_run_releases_the_bank_lock(chain, monkeypatch):
    """The train stage's bank is locked while it runs; a run that fails must not leave it locked."""
    import lopd_core.training
    from components.memory import LOCK_FILE
    from components.memory.storage import lock_dir

    def broken_loop(*args, **kwargs):
        raise RuntimeError("rollout worker died")

    monkeypatch.setattr(lopd_core.training, "train_loop", broken_loop)  # the stage imports it when it runs
    spec = chain["spec"]
    with pytest.raises(RuntimeError, match="rollout worker died") as failed:
        train(spec.model_copy(update={"resume": True, "schedule": spec.schedule.model_copy(update={"steps": 9})}))
    assert failed.traceback  # the failed call's frames (and anything they still reference) are alive here
    locks = sorted(spec.stage_dir("train").glob(f"**/{LOCK_FILE}"))
    assert locks, "the train stage restored no bank"
    for lock in locks:
        lock_dir(lock.parent).close()  # raises "in use by another process" if still held


def test_lopd_refuses_an_empty_bank_unless_allowed(chain, tmp_path, caplog):
    """An empty bank is an error naming the snapshot and the fix; allowed, the placeholders are a metric."""
    from components.memory import ExperienceBank

    spec = chain["spec"]
    with ExperienceBank.open(tmp_path / "banks", "experience", "hashing-64") as empty:
        snapshot = empty.snapshot(tmp_path / "snapshots")
    ref = spec.store().put(snapshot.uri, "bank_snapshot", snapshot.metadata)
    other = spec.model_copy(update={"run_dir": str(tmp_path / "run"), "artifact_root": str(spec.store().root),
                                    "bank_snapshot": ref})  # fmt: skip
    with pytest.raises(ValueError) as info:
        train(other)
    assert str(info.value) == (
        f"bank snapshot {ref.uri} holds 0 entries, fewer than LOPD needs (3: lopd.min_bank_size, by default "
        "n_retrieved = J): its teacher would read placeholder items instead of past successes. Fill the bank "
        "(collect more successes, or lower the bank stage's success_threshold), or set lopd.min_bank_size=0 to "
        "train with it anyway"
    )
    allowed = other.model_copy(update={"lopd": other.lopd.model_copy(update={"min_bank_size": 0})})
    with caplog.at_level("WARNING", logger="components.train"):
        result = train(allowed)
    assert (
        f"bank snapshot {ref.uri} holds 0 entries, fewer than n_retrieved=3 (allowed by lopd.min_bank_size=0): "
        "LOPD's teacher reads placeholder items for the missing ones (n_placeholder_experiences)"
    ) in caplog.messages
    records = result.metrics["n_records"]
    assert records > 0 and result.metrics["n_placeholder_experiences"] == 3 * records  # J slots, all placeholders
    assert chain["train"].metrics["n_placeholder_experiences"] == 0.0  # the chain's bank fills every slot


def test_one_stage_contract_and_one_rollout_type():
    """Every stage spec subclasses StageSpec; every `rollout` field, in stage specs and the pipeline form, is
    lopd_core.rollout.RolloutConfig, and the stage's seed reaches the engine without entering dumps or forms."""
    import typing

    from components.common import StageSpec
    from components.evaluate import EvaluateSpec
    from components.sft import SFTSpec
    from flows.config import CollectParams, EvalParams, TrainParams
    from flows.report import ReportSpec
    from lopd_core.rollout import RolloutConfig

    for spec in (CollectSpec, BankSpec, ColdStartSpec, TrainSpec, SFTSpec, EvaluateSpec, ReportSpec):
        assert issubclass(spec, StageSpec), spec
    for model in (CollectSpec, TrainSpec, EvaluateSpec, CollectParams, TrainParams, EvalParams):
        annotation = model.model_fields["rollout"].annotation
        assert RolloutConfig in (annotation, *typing.get_args(annotation)), model
    config = RolloutConfig(temperature=0.5).seeded(7, progress=False)
    assert (config.seed, config.progress, config.temperature) == (7, False, 0.5)
    assert "seed" not in config.model_dump() and "seed" not in RolloutConfig.model_json_schema()["properties"]
    with pytest.raises(ValueError, match="engine"):
        RolloutConfig(engine="sglang")


@pytest.mark.parametrize("stage", ["sft", "collect", "bank", "cold_start", "train", "evaluate"])
def test_stage_help_loads_no_heavy_module(stage):
    """`python -m components.<stage> --help` is instant: torch, transformers, MLflow and Qdrant load when the stage
    runs, not when its spec and help are read (issue 16: help took ~24 s)."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", f"components.{stage}", "--help"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert out.stdout.startswith(f"usage: python -m components.{stage} ") and "exit codes" in out.stdout
    assert not loaded & {"torch", "transformers", "mlflow", "qdrant_client"}, sorted(loaded)


def test_artifact_fields_take_a_result_a_run_directory_or_the_artifact_itself(chain, tmp_path):
    """`dataset=PATH` on a stage's CLI (issue 16): a result JSON, a folder holding one, a pipeline's stage cache, or
    the artifact's own file; ambiguity and missing paths are errors that say what to pass."""
    collected = chain["collect"]
    ref = collected.artifacts["dataset"]
    result_file = tmp_path / "collect.json"
    result_file.write_text(collected.model_dump_json())
    (tmp_path / "stage").mkdir()
    (tmp_path / "stage" / "result.json").write_text(collected.model_dump_json())
    for given in (result_file, tmp_path / "stage"):
        assert BankSpec(dataset=str(given)).dataset == ref

    run_dir = tmp_path / "run"
    entry = {"stage": "collect", "key": "k1", "result": collected.model_dump(mode="json")}
    cache = run_dir / "artifacts" / "stage-cache"  # flows.cache's layout: under the artifact root
    (cache / "collect").mkdir(parents=True)
    (cache / "collect" / "k1.json").write_text(json.dumps(entry))
    (cache / "bank").mkdir()
    banked = {"result": chain["bank"].model_dump(mode="json")}
    (cache / "bank" / "k2.json").write_text(json.dumps(banked))
    assert BankSpec(dataset=str(run_dir)).dataset == ref
    cold = ColdStartSpec(dataset=str(run_dir), bank_snapshot=str(run_dir))
    assert (cold.dataset, cold.bank_snapshot) == (ref, chain["bank"].artifacts["bank_snapshot"])
    with pytest.raises(ValueError, match="none of stage 'cold_start'"):
        TrainSpec(dataset=str(run_dir), bank_snapshot=str(run_dir), composer=str(run_dir))

    other = json.loads(json.dumps(entry))
    other["result"]["artifacts"]["dataset"]["sha256"] = "0" * 64
    (cache / "collect" / "k3.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match=r"2 different collect results; pass one of these files:\n.*k1\.json"):
        BankSpec(dataset=str(run_dir))

    own = BankSpec(dataset=ref.uri).dataset  # the artifact's own file: hashed, the same digest
    assert (own.sha256, own.kind) == (ref.sha256, "dataset")
    with pytest.raises(ValueError, match="does not exist: give an ArtifactRef mapping"):
        BankSpec(dataset=str(tmp_path / "nope"))
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "empty-run" / "mlflow.db").write_text("")  # a run directory, never hashed as an artifact
    with pytest.raises(ValueError, match="holds no stage results, none of stage 'collect'"):
        BankSpec(dataset=str(tmp_path / "empty-run"))
    with pytest.raises(ValueError, match="has no 'composer' artifact"):
        TrainSpec(dataset=ref.uri, bank_snapshot=str(run_dir), composer=str(result_file))

    shown = subprocess.run([sys.executable, "-m", "components.bank", f"dataset={result_file}", "--print-spec"],
                           capture_output=True, text=True)  # fmt: skip
    assert shown.returncode == 0 and ref.sha256 in shown.stdout, shown.stderr


def test_grpo_policy_temperature_defaults_to_the_rollouts():
    from lopd_core.artifacts import ArtifactRef
    from lopd_core.config import LOPDConfig, RolloutConfig, ScheduleConfig
    from lopd_core.methods import GRPOObjective

    grpo = LOPDConfig(method="grpo")
    spec = TrainSpec(dataset=ArtifactRef(uri="file:///d", kind="dataset", sha256="0" * 64), lopd=grpo,
                     schedule=ScheduleConfig(samples_per_task=4), rollout=RolloutConfig(temperature=0.7))  # fmt: skip
    assert spec.lopd.baseline.policy_temperature is None  # the spec (and its cache key) keeps what was asked
    assert spec.method_config().baseline.policy_temperature == 0.7
    assert GRPOObjective(spec.method_config()).temperature == 0.7
    greedy = spec.model_copy(update={"rollout": RolloutConfig(temperature=0.0)})
    assert greedy.method_config().baseline.policy_temperature == 1.0  # greedy rollouts: the raw logits
    fixed = grpo.model_copy(update={"baseline": grpo.baseline.model_copy(update={"policy_temperature": 1.3})})
    assert spec.model_copy(update={"lopd": fixed}).method_config().baseline.policy_temperature == 1.3


def test_text_teacher_solutions_without_the_reference_fallback(chain):
    """`reference_solutions`: OPSD's teacher reads the dataset's verified successes and, by default, the suite's
    reference solution for every other task; off, only the successes (the tiny model has none: no solution)."""
    from components.train import _set_up

    spec = chain["spec"].model_copy(update={"lopd": chain["spec"].lopd.model_copy(update={"method": "opsd"}),
                                            "bank_snapshot": None, "composer": None, "resume": False,
                                            "run_dir": str(Path(chain["run_dir"]) / "opsd-solutions")})  # fmt: skip
    with_reference = _set_up(spec).solutions
    assert with_reference and {source for _, source in with_reference.values()} == {"reference"}
    assert _set_up(spec.model_copy(update={"reference_solutions": False})).solutions == {}
