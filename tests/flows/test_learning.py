"""The learning-regression test: short GRPO and LOPD runs on the study testbed must raise the reward of the tasks
they train on, measured against their warm start on the same fixed tasks.

The testbed is configs/study-cpu.yaml's: toolworld-1m on toolworld-minimal, levels 1-2. Its warm start (the sft
stage, ~15 minutes on one core) is built once per machine and code version into the cache directory
(`$LOPD_CACHE/warm-starts/`, rebuilt when missing). The test proper is the pipeline from that warm start with two
arms (grpo, lopd), one seed, a fixed set of N_TASKS training tasks (`train.n_train_tasks`, the same seeded sample
for both arms) and BUDGET generations each. Then the warm start and both trained students roll out on those tasks
K times each at the training temperature, and each arm's per-task mean reward minus the warm start's (paired over
tasks, t interval) must have its lower end above 0. A flipped sign in an objective, a broken advantage or a
teacher that does not reach the student makes it fail.

This is a regression test, not the study's claim: the held-out comparison is `lopd study` (README). Measured
here (2026-12-04, GRPO's log-probs at the sampling temperature): grpo +0.113 [+0.023, +0.203]; with GRPO's sign
flipped, -0.240 [-0.358, -0.121]: fails. The margin is thin (seed 2: +0.053 [-0.026, +0.132]; at 768
generations 1 of 3 seeds passed, docs/study.md). LOPD lowers its training tasks' reward on this testbed (-0.085
[-0.167, -0.002]): its test is a strict xfail, so it fails the day LOPD starts to pass and the mark must go.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "configs" / "study-cpu.yaml"
N_TASKS = 24  # the fixed training tasks (levels 1-2) both arms train on and are scored on
BUDGET = 1536  # student generations per arm (768 passed GRPO for only some seeds: docs/study.md, fifth round)
K = 8  # rollouts per task when scoring
TEMPERATURE = 0.7  # the study's rollout temperature
pytestmark = [pytest.mark.slow, pytest.mark.learning]


def study_warm_start(tmp: Path, threads: int = 1) -> Path:
    """The study's warm start as a Hugging Face folder under the cache directory (built when missing)."""
    from components.sft import SFTSpec, run_sft
    from flows.cache import code_version
    from flows.config import load_config
    from lopd_core.artifacts import cache_dir, sha256_json

    cfg = load_config(STUDY, [f"run_dir={tmp}"])
    spec = SFTSpec(
        run_dir=str(tmp),
        tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}",
        backbone=cfg.backbone,
        suite=cfg.suite,
        validation_fraction=cfg.validation_fraction,
        difficulties=cfg.train.difficulties,
        sft=cfg.sft,
        threads=threads,
    )
    recipe = spec.model_dump(mode="json", exclude={"run_dir", "tracking_uri", "threads"})
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


def task_rewards(source: Path, tasks: list, warm: Path) -> dict[str, float]:  # type: ignore[type-arg]
    """Mean reward per task over K rollouts at TEMPERATURE; `source` is a train checkpoint or the warm start."""
    from components.common import open_suite
    from lopd_core.backbone import load_backbone
    from lopd_core.checkpoint import load_student
    from lopd_core.rollout import RolloutConfig, RolloutEngine

    if (source / "state.json").exists():
        models = load_student(source, backbone=str(warm))
        with models.acting_student() as student:
            model, tok = student, models.tokenizer
    else:
        model, tok = load_backbone(str(source))
    suite = open_suite("toolworld-minimal", 0.2)
    config = RolloutConfig(temperature=TEMPERATURE, max_turns=4, max_new_tokens=64, max_total_tokens=1024,
                           batch_size=16, seed=1234, progress=False)  # fmt: skip
    trajectories = RolloutEngine(model, tok, config).run([suite.episode(t) for t in tasks for _ in range(K)])
    rewards: dict[str, list[float]] = {}
    for t in trajectories:
        rewards.setdefault(t.task_id, []).append(t.reward)
    return {task: statistics.fmean(r) for task, r in rewards.items()}


def paired_interval(after: dict[str, float], before: dict[str, float]) -> tuple[float, float, float]:
    """Mean of after - before over tasks, with its 95% t interval (the study's `mean_interval`)."""
    from lopd_core.evaluation.stats import mean_interval

    est = mean_interval([after[k] - before[k] for k in sorted(before)], scale=1.0, bounds=(-1.0, 1.0))
    return est.value, est.lo, est.hi


@pytest.fixture(scope="module")
def scores(tmp_path_factory):
    """Run the pipeline (grpo, lopd) from the warm start on N_TASKS fixed training tasks; score all three on them."""
    from prefect.testing.utilities import prefect_test_harness

    from components.common import open_suite
    from components.train import TrainSpec, _tasks
    from flows.config import load_config
    from flows.pipeline import lopd_pipeline

    tmp = tmp_path_factory.mktemp("learning")
    warm = study_warm_start(tmp / "sft")
    run_dir = tmp / "study"
    cfg = load_config(
        STUDY,
        [
            f"run_dir={run_dir}",
            f"backbone={warm}",
            "sft=null",
            "methods=[grpo, lopd]",
            "seeds=[0]",
            f"budget={BUDGET}",
            f"train.n_train_tasks={N_TASKS}",
            "evaluate.benchmarks=[{name: toolworld-minimal, key: validation, split: validation, sample: 8}]",
        ],
    )
    with prefect_test_harness(server_startup_timeout=180):
        lopd_pipeline(cfg)
    checkpoints, task_sets = {}, {}
    for cell in sorted((run_dir / "stages" / "train").glob("*/result.json")):
        ref = json.loads(cell.read_text())["artifacts"]["checkpoint"]
        spec = TrainSpec.model_validate_json((cell.parent / "spec.json").read_text())
        method = ref["metadata"]["method"]
        checkpoints[method] = Path(ref["uri"])
        task_sets[method] = _tasks(spec, open_suite(spec.suite, spec.validation_fraction))  # what it trained on
    assert set(checkpoints) == {"grpo", "lopd"}, checkpoints
    tasks = task_sets["grpo"]
    assert len(tasks) == N_TASKS and [t.task_id for t in task_sets["lopd"]] == [t.task_id for t in tasks]
    before = task_rewards(warm, tasks, warm)
    out = {}
    for arm, path in sorted(checkpoints.items()):
        after = task_rewards(path, tasks, warm)
        mean, lo, hi = paired_interval(after, before)
        out[arm] = (lo, f"{arm}: reward {statistics.fmean(after.values()):.3f} vs warm start "
                        f"{statistics.fmean(before.values()):.3f} on {N_TASKS} training tasks x {K}; "
                        f"paired delta {mean:+.3f} [{lo:+.3f}, {hi:+.3f}]")  # fmt: skip
        print(out[arm][1])
    return out


def test_grpo_raises_the_reward_of_its_training_tasks(scores):
    lo, line = scores["grpo"]
    assert lo > 0, f"grpo did not raise the reward of its training tasks: {line}"


@pytest.mark.xfail(
    strict=True,
    reason="known, measured: LOPD lowers its training tasks' reward on this testbed (-0.085 [-0.167, -0.002]); "
    "the latent teacher stays worse than the student (privilege -0.03 to -0.1 per token), docs/study.md",
)
def test_lopd_raises_the_reward_of_its_training_tasks(scores):
    lo, line = scores["lopd"]
    assert lo > 0, f"lopd did not raise the reward of its training tasks: {line}"
