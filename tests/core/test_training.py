"""The outer loop: the sampler's order, and exact resume after a kill (fixed seed)."""

from __future__ import annotations

import random

import pytest
import torch

from lopd_core.backbone import load_backbone
from lopd_core.config import LOPDConfig, ScheduleConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.base import Task
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.step import TrainStep, build_method
from lopd_core.training import TaskSampler, train_loop

CFG = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64, student_lr=1e-3, composer_lr=1e-3)
TASKS = [Task(f"t{i}", "files", "train", f"List the folder /f{i}") for i in range(5)]


def test_sampler_covers_every_task_per_epoch_and_resumes():
    s = TaskSampler([f"t{i}" for i in range(7)], batch_size=3, seed=1)
    first = [s.next_batch() for _ in range(7)]  # 21 draws = 3 epochs
    flat = [t for b in first for t in b]
    for e in range(3):
        assert sorted(flat[7 * e : 7 * e + 7]) == sorted(f"t{i}" for i in range(7))
    s2 = TaskSampler([f"t{i}" for i in range(7)], batch_size=3, seed=1)
    [s2.next_batch() for _ in range(4)]
    s3 = TaskSampler([f"t{i}" for i in range(7)], batch_size=3, seed=1)
    s3.load_state_dict(s2.state_dict())
    assert [s3.next_batch() for _ in range(3)] == first[4:]
    with pytest.raises(ValueError, match="seed"):
        TaskSampler(["a"], 1, seed=2).load_state_dict(s2.state_dict())


def sampling_rollout(models, tok):
    """Samples a short answer from the student's real distribution (uses the torch RNG) and scores it."""
    ser = ChatSerializer(tok)

    def rollout(tasks):
        out = []
        for task in tasks:
            msgs = [Message("system", "Answer briefly."), Message("user", task.instruction)]
            ids = torch.tensor([ser.prompt_ids(msgs)])
            sampled = []
            with torch.no_grad():
                for _ in range(6):
                    logits = models.student(torch.cat([ids, torch.tensor([sampled], dtype=torch.long)], 1)).logits
                    sampled.append(int(torch.multinomial(logits[0, -1].softmax(-1), 1)))
            text = tok.decode(sampled)
            reward = float(sum(sampled) % 3) / 2.0
            msgs.append(Message("assistant", text, token_ids=sampled, truncated=True))
            out.append(Trajectory(task.task_id, task.env_id, task.instruction, msgs, reward=reward,
                                  trace=text, metadata={"generations": 1}))  # fmt: skip
        return out

    return rollout


def run(tmp, stop_after=None, steps=4, cfg=CFG):
    torch.manual_seed(0)
    random.seed(0)
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, cfg)
    strategy, objective = build_method(models, cfg, retrieve=lambda t, i: [f"Task: other than {i}\nTrace: ls -> ok"])
    step = TrainStep(models, ChatSerializer(tok), strategy, objective, cfg)
    schedule = ScheduleConfig(steps=steps, tasks_per_step=2, samples_per_task=2, checkpoint_every=2)
    return train_loop(step, TASKS, sampling_rollout(models, tok), schedule, tmp, stop_after=stop_after)


def strip(history):
    return [{k: v for k, v in row.items() if k != "step_seconds"} for row in history]


def test_resume_after_kill_matches_an_uninterrupted_run(tmp_path):
    full = run(tmp_path / "a")
    part = run(tmp_path / "b", stop_after=2)
    assert part["steps_done"] == 2
    resumed = run(tmp_path / "b")  # a fresh process state: new models, new optimizer, new RNG seed
    assert resumed["steps_done"] == 4
    assert strip(resumed["history"]) == strip(full["history"])
    assert full["generations"] == 16 and [r["beta"] for r in full["history"]][-1] >= 0
    # each step's reward per environment (kept in the checkpoint): its sums are the step's mean reward x rollouts
    assert resumed["env_rewards"] == full["env_rewards"] and len(full["env_rewards"]) == 4
    for row, rec in zip(full["history"], full["env_rewards"], strict=True):
        assert rec["step"] == row["step"] and rec["generations_total"] == row["generations_total"]
        assert sum(n for _, n in rec["envs"].values()) == 4
        assert sum(r for r, _ in rec["envs"].values()) == pytest.approx(4 * row["reward_mean"])
        assert set(rec["envs"]) <= {t.env_id for t in TASKS}


def test_full_fine_tuning_with_tied_embeddings_resumes_exactly(tmp_path):
    # the tiny backbone ties lm_head to the embeddings; safetensors refuses shared storage, so the tied name is
    # left out of the checkpoint and restored through the other
    cfg = CFG.model_copy(update={"student_mode": "full"})
    full = run(tmp_path / "a", steps=2, cfg=cfg)
    run(tmp_path / "b", stop_after=1, steps=2, cfg=cfg)
    resumed = run(tmp_path / "b", steps=2, cfg=cfg)
    assert strip(resumed["history"]) == strip(full["history"])


def test_refuses_evaluation_tasks(tmp_path):
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    strategy, objective = build_method(models, CFG, retrieve=lambda t, i: [])
    step = TrainStep(models, ChatSerializer(tok), strategy, objective, CFG)
    bad = [*TASKS, Task("e1", "files", "eval", "held out")]
    with pytest.raises(ValueError, match="training split"):
        train_loop(step, bad, lambda ts: [], ScheduleConfig(steps=1), tmp_path)


def test_load_student_restores_the_trained_student(tmp_path):
    out = run(tmp_path / "c", steps=2)
    assert out["steps_done"] == 2
    import json

    from lopd_core.checkpoint import load_student

    state = tmp_path / "c" / "last" / "state.json"
    data = json.loads(state.read_text())
    data["backbone"] = "tiny"
    state.write_text(json.dumps(data))
    models = load_student(tmp_path / "c" / "last")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), models.acting_student() as student:
        trained = student(ids).logits
    base, _ = load_backbone("tiny")
    with torch.no_grad():
        assert not torch.allclose(trained, base(ids).logits)  # the student LoRA was restored and is live


def test_the_step_bar_shows_reward_margin_beta_and_generations():
    from lopd_core.training import progress_fields

    metrics = {"reward_mean": 0.5, "margin": 0.0123, "beta": 1.25, "loss": 3.0}
    assert progress_fields(metrics, 64) == {"reward": "0.500", "margin": "0.012", "β": "1.250", "gen": "64"}
    assert progress_fields({"reward_mean": 1.0}, 8) == {"reward": "1.000", "gen": "8"}  # a baseline: no margin or β


def test_per_env_sums_each_environments_usable_rollouts():
    from lopd_core.distributed import current_world
    from lopd_core.training import per_env

    def traj(env, reward, failed=False):
        return Trajectory("t", env, "x", [Message("user", "x")], reward=reward, failed=failed)

    batch = [traj("A", 1.0), traj("A", 0.5), traj("B", 0.0), traj("B", 1.0, failed=True), traj("Z", 1.0)]
    assert per_env(batch, ["A", "B", "C"], current_world()) == {"A": [1.5, 2.0], "B": [0.0, 1.0]}
