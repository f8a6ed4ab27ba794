"""The learning-regression test: short GRPO and LOPD runs on the study testbed must beat their warm start.

The testbed is configs/study-cpu.yaml's: toolworld-1m on toolworld-minimal, levels 1-3. Its warm start (the
sft stage, ~15 minutes on one core) is built once per machine and code version into the cache directory
(`$LOPD_CACHE/warm-starts/`, rebuilt when missing); the test proper is the pipeline from that warm start with
two arms (grpo, lopd), one seed and a short equal budget, then the held-out evaluation. Each arm's paired
difference to the warm start (per held-out task, greedy, the same tasks) must have the lower end of its 95%
interval above 0: a flipped sign in an objective, a broken advantage or a teacher that does not reach the
student makes it fail.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "configs" / "study-cpu.yaml"
BUDGET = 800  # student generations per arm (the study's is 1,600)
pytestmark = [pytest.mark.slow, pytest.mark.learning]


def study_warm_start(tmp: Path) -> Path:
    """The study's warm start as a Hugging Face folder under the cache directory (built when missing)."""
    from components.sft import SFTSpec, run_sft
    from flows.cache import code_version
    from flows.config import load_config
    from lopd_core.artifacts import sha256_json
    from lopd_core.backbone import cache_dir

    cfg = load_config(STUDY, [f"run_dir={tmp}"])
    spec = SFTSpec(
        run_dir=str(tmp),
        tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
        backbone=cfg.backbone,
        suite=cfg.suite,
        validation_fraction=cfg.validation_fraction,
        difficulties=cfg.train.difficulties,
        sft=cfg.sft,
    )
    recipe = spec.model_dump(mode="json", exclude={"run_dir", "tracking_uri"})
    key = sha256_json({"spec": recipe, "code": code_version()})
    folder = cache_dir() / "warm-starts" / key[:16]
    if not (folder / "config.json").exists():
        result = run_sft(spec)
        built = spec.store().get(result.artifacts["model"])
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(built, partial)
        partial.rename(folder)
    return folder


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def test_grpo_and_lopd_improve_on_their_warm_start(harness, tmp_path):
    from flows.config import load_config
    from flows.pipeline import lopd_pipeline

    warm = study_warm_start(tmp_path / "sft")
    cfg = load_config(
        STUDY,
        [
            f"run_dir={tmp_path / 'study'}",
            f"backbone={warm}",
            "sft=null",
            "methods=[grpo, lopd]",
            "seeds=[0]",
            f"budget={BUDGET}",
        ],
    )
    summary = lopd_pipeline(cfg)
    study = json.loads((Path(summary["report"]).parent / "study.json").read_text())
    table = study["benchmarks"]["toolworld-minimal"]
    lines = [f"{arm}: reward {table[arm]['reward_tasks']['value']:.1f} vs warm start "
             f"{table['vanilla']['reward_tasks']['value']:.1f}, paired delta {table[arm]['delta_reward']}"
             for arm in ("grpo", "lopd")]  # fmt: skip
    print("\n".join(lines))
    for arm, line in zip(("grpo", "lopd"), lines, strict=True):
        assert table[arm]["delta_reward"]["lo"] > 0, f"{arm} did not improve on the warm start: {line}"
