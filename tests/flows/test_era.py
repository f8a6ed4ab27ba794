"""`lopd-era-shift` (flows/era.py) on the tiny backbone under prefect_test_harness: era 0's pipeline, the rule change,
the era-0 students' collection into the shared bank, every arm re-trained from its own student, the verdict split
by shifted environments; a re-run takes everything from the cache and never re-trains era 0 on the grown bank. The
tiny random model never succeeds (success_threshold 0: the bank takes every trajectory), so this tests the scenario's
plumbing; docs/study.md has what the methods do on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.flows.presets import LEAN

ROOT = Path(__file__).resolve().parents[2]
SUITE = "toolworld-rules-s1-digits"
pytestmark = pytest.mark.slow


def config(run_dir: Path):
    from flows.config import load_config

    return load_config(ROOT / "configs" / "tiny.yaml", [
        *LEAN, f"run_dir={run_dir}", f"suite={SUITE}", "methods=[grpo, lopd]", "budget=2",
        "overrides={grpo: {train.schedule.samples_per_task: 2}}", "execution.retry_delay_s=0.2",
        f"evaluate.benchmarks=[{{name: {SUITE}, key: held-out, sample: 16}}]",
    ])  # fmt: skip


@pytest.fixture(scope="module")
def shifted(harness, tmp_path_factory):
    """The production path: the era flow stops once the students' experience has grown the bank; bank-watch
    announces the growth; lopd-retrain (which the automation starts) finishes the era's re-train."""
    from flows.era import lopd_era_shift
    from flows.retrain import bank_watch, lopd_retrain

    run_dir = tmp_path_factory.mktemp("era")
    waiting = lopd_era_shift(config=config(run_dir), overrides=(), era=1, retrain_now=False)
    assert waiting["status"] == "waiting" and not any(s["stage"] == "train" and "era" in s["label"]
                                                      for s in waiting["stages"])  # fmt: skip
    watched = bank_watch(run_dir=str(run_dir), min_growth=1)
    assert watched["status"] == "emitted" and watched["version"] == waiting["bank_version"], watched
    retrained = lopd_retrain(run_dir=str(run_dir), bank_version=watched["version"])
    assert retrained["status"] == "retrained era 1", retrained
    assert bank_watch(run_dir=str(run_dir), min_growth=1)["status"] == "waiting"  # trained on the grown bank now
    return run_dir, retrained["era"], waiting


def test_students_collect_into_the_shared_bank_and_every_arm_retrains_from_its_own(shifted):
    from components.memory import ExperienceBank
    from lopd_core.envs.toolworld.rules import parse_rules_name

    run_dir, summary, waiting = shifted
    state = json.loads((run_dir / "era1" / "state.json").read_text())
    assert set(state["era0"]["trained"]) == {"grpo|0", "lopd|0"} and set(state["grown"]["datasets"]) == {
        "grpo|0",
        "lopd|0",
    }
    with ExperienceBank.open(str(run_dir / "bank"), "experience", create=False) as bank:
        eras = bank.era_counts()
    # the students' era-1 trajectories entered as era 1 (new traces added; those era 0 already held moved there)
    assert any(1 in counts for counts in eras.values()), eras
    grown = [s["label"] for s in waiting["stages"]]
    assert "collect era 1 by grpo seed 0" in grown and "collect era 1 by lopd seed 0" in grown
    assert "cold-start lopd new cold start seed 0" in [s["label"] for s in summary["stages"]]
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    runs = client.search_runs(client.get_experiment_by_name("lopd").experiment_id,
                              f"tags.stage = 'train' and tags.suite = '{SUITE}-era1'")  # fmt: skip
    assert sorted(r.data.tags.get("lopd.arm") for r in runs) == ["grpo", "lopd", "lopd new cold start"]
    era = summary["era"]
    assert era["shifted"] == parse_rules_name(f"{SUITE}-era1").shifted()
    rows = era["benchmarks"]["held-out"]
    assert set(rows) == {"warm start (base)", "grpo (era0)", "lopd (era0)", "grpo (before)", "lopd (before)",
                         "grpo (after)", "lopd (after)", "lopd new cold start (after)"}  # fmt: skip
    after = rows["lopd new cold start (after)"]
    assert after["shifted"]["n_tasks"] + after["unshifted"]["n_tasks"] == 16
    assert "vs_era0_student" in after["shifted"] and "vs_era0_student" not in rows["lopd (before)"]["shifted"]
    assert "| lopd new cold start (after) |" in Path(summary["report"]).read_text()
    recovered = era["recovery"]  # every re-trained run against its era-0 run's level on the shifted environments
    assert set(recovered) == {"grpo", "lopd", "lopd new cold start"}
    assert all(set(r) == {"target", "budget", "generations"} and r["budget"] > 0
               for seeds in recovered.values() for r in seeds.values())  # fmt: skip
    assert "## Recovery on the shifted environments" in Path(summary["report"]).read_text()


def test_a_rerun_is_cached_and_keeps_era_0(shifted):
    from flows.era import lopd_era_shift

    run_dir, first, _ = shifted
    again = lopd_era_shift(config=config(run_dir), overrides=(), era=1)
    assert [s["label"] for s in again["stages"] if not s["cached"]] == []
    assert again["era"] == first["era"]
    with pytest.raises(ValueError, match="holds an era shift of arms"):  # its saved students are not these arms'
        lopd_era_shift(config=config(run_dir), overrides=("methods=[grpo]",), era=1)
