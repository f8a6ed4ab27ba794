"""The rollout engine: batched KV-cache generation equals plain forwards, exact sampled ids, stops, bookkeeping."""

from __future__ import annotations

import pytest
import torch

from lopd_core.conversation import Message
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.rollout import RolloutConfig, RolloutEngine, summarize
from lopd_core.serialization import ChatSerializer


class ScriptedEpisode:
    """A minimal real episode: answers every action with an observation and finishes after `finish_after` turns
    (never if None). Reward = turns / 4, capped at 1."""

    def __init__(
        self,
        name: str,
        finish_after: int | None = None,
        fail_at: int | None = None,
        system: str = "You are a test agent.",
    ) -> None:
        self.task = Task(
            task_id=name,
            env_id="scripted",
            split="train",
            instruction=f"Task {name}: say something.",
            suite="scripted",
            difficulty=1,
        )
        self.finish_after, self.fail_at, self.system = finish_after, fail_at, system
        self.actions: list[str] = []
        self.closed = False

    def initial_messages(self) -> list[Message]:
        return [Message("system", self.system), Message("user", self.task.instruction)]

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        if self.fail_at is not None and len(self.actions) >= self.fail_at:
            raise RuntimeError("environment exploded")
        if self.finish_after is not None and len(self.actions) >= self.finish_after:
            return StepResult([], done=True, event="finish")
        return StepResult([Message("tool", f"observation {len(self.actions)}")], done=False, n_calls=1)

    def result(self) -> EpisodeResult:
        turns = len(self.actions)
        return EpisodeResult(
            reward=min(1.0, turns / 4),
            checks=[{"name": "turns", "passed": turns >= 4, "detail": ""}],
            trace=f"{turns} turns",
            n_calls=turns,
            n_errors=0,
        )

    def close(self) -> None:
        self.closed = True


def engine_for(tiny, **overrides) -> RolloutEngine:
    model, tok = tiny
    config = RolloutConfig(**{"max_turns": 3, "max_new_tokens": 12, "batch_size": 3, "progress": False, **overrides})
    return RolloutEngine(model, tok, config)


def test_batched_kv_cache_generation_matches_plain_forwards(tiny):
    model, _ = tiny
    engine = engine_for(tiny, temperature=1.0)
    ser = engine.serializer
    prompts = [
        ser.prompt_ids([Message("user", text)])
        for text in ("hi", "a much longer prompt " * 6, "the task is done, thanks")
    ]
    assert len({len(p) for p in prompts}) == 3  # different lengths: left padding is exercised
    outputs = engine.generate(prompts, [9, 4, 7], torch.Generator().manual_seed(0))
    for out, budget in zip(outputs, [9, 4, 7], strict=True):  # truncated exactly when the budget ran out
        assert len(out.token_ids) <= budget and out.truncated == (len(out.token_ids) == budget)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        # the log-probabilities seen while sampling (padded batch, KV cache) equal those of a plain forward
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids).view(-1, 1)).view(-1)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


class RecordingEngine(RolloutEngine):
    """The engine, keeping each turn's token log-probabilities as computed during generation."""

    def generate(self, prompts, max_new_tokens, generator=None, pasts=None):
        outputs = super().generate(prompts, max_new_tokens, generator, pasts)
        self.turns = getattr(self, "turns", []) + [(list(p), o) for p, o in zip(prompts, outputs, strict=True)]
        return outputs


def test_cache_reuse_across_turns_and_shared_prefixes_changes_nothing(tiny):
    model, tok = tiny
    system = "You are a careful test agent that calls tools and reports. " * 6
    episodes = lambda: [ScriptedEpisode(str(i), finish_after=3, system=system) for i in range(4)]  # noqa: E731
    config = RolloutConfig(temperature=1.0, max_turns=3, batch_size=4, max_new_tokens=8, progress=False)
    reuse = RecordingEngine(model, tok, config)
    plain = RolloutEngine(model, tok, config.model_copy(update={"reuse_cache": False}))
    trajectories = reuse.run(episodes())
    plain.run(episodes())
    assert reuse.stats["prefilled_tokens"] < plain.stats["prefilled_tokens"] / 2
    assert all(t.n_turns == 3 for t in trajectories) and len(reuse.turns) == 12
    for prompt, out in reuse.turns:  # log-probabilities under reused caches = those of one plain forward
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids).view(-1, 1)).view(-1)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_trajectories_keep_exact_sampled_ids_and_training_views_reproduce_every_prompt(tiny):
    _, tok = tiny
    engine = engine_for(tiny, temperature=1.0, max_turns=3)
    episodes = [ScriptedEpisode("a", finish_after=3), ScriptedEpisode("b", finish_after=2), ScriptedEpisode("c", 1)]
    trajectories = engine.run(episodes)
    ser = ChatSerializer(tok)
    assert [t.n_turns for t in trajectories] == [3, 2, 1]  # per-episode stop inside one batch
    for traj, episode in zip(trajectories, episodes, strict=True):
        view = ser.student_view(traj)
        supervised = [i for i, m in zip(view.input_ids, view.action_mask, strict=True) if m]
        sampled = []
        for i, message in enumerate(traj.messages):
            if message.role != "assistant":
                continue
            sampled += message.token_ids + ([] if message.truncated else [ser.end_of_turn_id])
            # the prompt this turn was generated from is exactly a prefix of the training view
            prompt = ser.prompt_ids(traj.messages[:i])
            assert view.input_ids[: len(prompt)] == prompt
            assert view.input_ids[len(prompt) : len(prompt) + len(message.token_ids)] == message.token_ids
            assert message.content == tok.decode(message.token_ids, skip_special_tokens=True)
        assert supervised == sampled and len(sampled) > 0
        # the episode saw the decoded text of exactly those ids
        assert episode.actions == [m.content for m in traj.messages if m.role == "assistant"]
        assert episode.closed


def test_turn_and_token_limits(tiny):
    engine = engine_for(tiny, temperature=1.0, max_turns=2, max_new_tokens=5, max_total_tokens=4096)
    (never,) = engine.run([ScriptedEpisode("never")])
    assert never.finish_reason == "max_turns" and never.n_turns == 2
    for message in never.messages:
        if message.role == "assistant":  # stopped at the per-turn limit unless end-of-turn was sampled
            assert len(message.token_ids) <= 5 and (message.truncated == (len(message.token_ids) == 5))
    ser = ChatSerializer(tiny[1])
    first_prompt = len(ser.prompt_ids(never.messages[:2]))
    budget = first_prompt + 8
    tight = engine_for(tiny, temperature=1.0, max_turns=10, max_new_tokens=5, max_total_tokens=budget)
    (capped,) = tight.run([ScriptedEpisode("capped")])
    assert capped.finish_reason == "max_tokens" and capped.n_turns >= 1
    for i, message in enumerate(capped.messages):  # no turn was generated past the episode's token budget
        if message.role == "assistant":
            assert len(ser.prompt_ids(capped.messages[:i])) + len(message.token_ids) <= budget


def test_bookkeeping_failures_and_summary(tiny):
    engine = engine_for(tiny, temperature=1.0, max_turns=4)
    episodes = [ScriptedEpisode("ok", finish_after=4), ScriptedEpisode("boom", fail_at=2), ScriptedEpisode("one", 1)]
    ok, boom, one = engine.run(episodes)
    assert ok.reward == 1.0 and ok.checks == [{"name": "turns", "passed": True, "detail": ""}]
    assert ok.trace == "4 turns" and ok.n_calls == 4 and ok.finish_reason == "finish" and not ok.failed
    assert ok.metadata["generations"] == 1 and ok.metadata["difficulty"] == 1 and ok.split == "train"
    assert ok.task == "Task ok: say something." and ok.env_id == "scripted"
    assert boom.failed and boom.finish_reason == "error" and "environment exploded" in boom.error
    assert boom.reward == 0.0 and boom.n_turns == 2 and episodes[1].closed
    assert one.reward == 0.25 and one.n_turns == 1
    stats = summarize([ok, boom, one])
    assert stats["all"]["failed"] == 1 and stats["all"]["mean_reward"] == round((1.0 + 0.25) / 2, 4)
    assert stats["all"]["success_rate"] == 0.5 and stats["by_difficulty"]["1"]["episodes"] == 3
    assert engine.stats["generated_tokens"] == sum(
        len(m.token_ids) for t in (ok, boom, one) for m in t.messages if m.role == "assistant"
    )


def test_same_seed_same_rollouts_and_more_episodes_than_the_batch(tiny):
    episodes = lambda: [ScriptedEpisode(str(i), finish_after=1 + i % 3) for i in range(7)]  # noqa: E731
    first = engine_for(tiny, temperature=1.0, top_p=0.9, seed=3, batch_size=3).run(episodes())
    second = engine_for(tiny, temperature=1.0, top_p=0.9, seed=3, batch_size=3).run(episodes())
    assert [t.task_id for t in first] == [str(i) for i in range(7)]
    assert [m.token_ids for t in first for m in t.messages] == [m.token_ids for t in second for m in t.messages]
    other = engine_for(tiny, temperature=1.0, top_p=0.9, seed=4, batch_size=3).run(episodes())
    assert [m.token_ids for t in first for m in t.messages] != [m.token_ids for t in other for m in t.messages]


def test_peft_model_with_adapter_and_training_mode_restored(tiny):
    peft = pytest.importorskip("peft")
    model, tok = tiny
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    lora.train()
    engine = RolloutEngine(lora, tok, RolloutConfig(max_turns=2, max_new_tokens=6, progress=False))
    (traj,) = engine.run([ScriptedEpisode("peft", finish_after=2)])
    assert traj.n_turns == 2 and not traj.failed
    assert lora.training  # the trainer's mode is restored after the rollout


def test_progress_bar_over_episodes(tiny, capsys):
    engine = engine_for(tiny, progress=True)
    engine.run([ScriptedEpisode("p1", 1), ScriptedEpisode("p2", 1)], desc="collect")
    err = capsys.readouterr().err
    assert "collect" in err and "2/2" in err


def test_toolworld_episodes_end_to_end(tiny):
    from lopd_core.envs.toolworld import load_toolworld

    suite = load_toolworld()
    tasks = [t for t in suite.tasks("eval") if t.difficulty == 2][:2]
    trajectories = engine_for(tiny, temperature=1.0, max_turns=2, max_new_tokens=16).run(
        [suite.episode(t) for t in tasks]
    )
    for task, traj in zip(tasks, trajectories, strict=True):
        assert not traj.failed, traj.error
        assert traj.task_id == task.task_id and traj.split == "eval" and 0.0 <= traj.reward <= 1.0
        assert len(traj.checks) == len(suite.scenario(task.task_id)["checklist_with_func"])
        assert traj.messages[0].role == "system" and traj.messages[1].content.startswith(task.instruction)
        assert traj.metadata["generations"] == 1 and traj.metadata["difficulty"] == 2
