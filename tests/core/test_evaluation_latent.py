"""The latent teacher's generation loop: batched, left-padded, KV-cached decoding with latents spliced at the
placeholder span gives the tokens of a plain, unbatched, uncached teacher forward over the teacher view."""

from __future__ import annotations

import torch

from lopd_core.backbone import load_backbone
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message
from lopd_core.envs.base import EpisodeResult, StepResult, Task
from lopd_core.evaluation.harness import aggregate, run_tasks
from lopd_core.evaluation.latent import LatentRollout, composed_latents
from lopd_core.models import build_models
from lopd_core.rollout import RolloutConfig
from lopd_core.serialization import TeacherContext, TokenView

CFG = LOPDConfig(n_retrieved=2, n_queries=3, qformer_layers=2, encoder_max_tokens=64)


def _models():
    """Tiny models whose random weights are spread out, so that greedy tokens depend on the context."""
    model, tok = load_backbone("tiny")
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return build_models(model, tok, CFG)


def _reference_tokens(models, rollout: LatentRollout, messages, latents: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens from full teacher forwards (no batch, no padding, no cache) over the teacher view."""
    view = rollout.serializer.view(messages, TeacherContext.latent(CFG.n_latents))
    ids = view.input_ids + rollout.header_ids
    out = []
    for _ in range(steps):
        v = TokenView(ids, [0] * len(ids), view.insert_pos, view.offset, view.latent_start, view.latent_len)
        batch = rollout.serializer.collate([v])
        with torch.no_grad():
            hidden = models.teacher_hidden(batch, latents.unsqueeze(0))
            logits = models.backbone.get_output_embeddings()(hidden[0, -1])
        token = int(logits.argmax())
        out.append(token)
        ids = [*ids, token]
    return out


def test_batched_generation_matches_unbatched_teacher_forwards() -> None:
    torch.manual_seed(0)
    models = _models()
    models.eval()
    rollout = LatentRollout(models, RolloutConfig(temperature=0.0, max_new_tokens=6), lambda tasks: None)
    rollout.stop_ids = set()  # decode exactly `steps` tokens
    d = models.backbone.config.hidden_size
    conversations = [
        [Message("system", "Tools: get_balance."), Message("user", "What is the balance of savings?")],
        [Message("system", "s"), Message("user", "Transfer 20 from checking to savings and then check both.")],
    ]
    latents = torch.randn(2, CFG.n_latents, d) * 3.0
    views = [rollout.serializer.view(m, rollout.context) for m in conversations]
    prompts = [v.input_ids + rollout.header_ids for v in views]
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    generated = rollout.generate_with_latents(prompts, [v.latent_start for v in views], latents, [6, 6])
    for b, messages in enumerate(conversations):
        assert generated[b][0] == _reference_tokens(models, rollout, messages, latents[b], 6), b
        assert generated[b][1] is True  # ran to the budget without a stop token
    others = [_reference_tokens(models, rollout, m, torch.randn(CFG.n_latents, d) * 3.0, 6) for m in conversations]
    assert others != [g[0] for g in generated]  # the latents matter: the check above can fail


class _OneTurn:
    """An episode that ends after one answer; reward 1 when the answer is non-empty."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.answer = ""

    def initial_messages(self) -> list[Message]:
        return [Message("system", "Answer briefly."), Message("user", self.task.instruction)]

    def step(self, action: str) -> StepResult:
        self.answer = action
        return StepResult([], done=True, event="finish")

    def result(self) -> EpisodeResult:
        return EpisodeResult(reward=float(bool(self.answer.strip())), trace=self.answer[:20])

    def close(self) -> None:
        pass


class _Suite:
    name = "one-turn"

    def tasks(self, split: str) -> list[Task]:
        return [Task(f"q{i}", "qa", "eval", f"Question number {i}?") for i in range(3)]

    def episode(self, task: Task) -> _OneTurn:
        return _OneTurn(task)


def test_latent_rollout_as_a_harness_policy_with_composed_latents() -> None:
    torch.manual_seed(0)
    models = _models()
    calls: list[tuple[str, str]] = []

    def retrieve(task: str, task_id: str) -> list[str]:
        calls.append((task, task_id))
        return [f"Task: something like {task}\nTrace:\nget_balance() -> 3", "Task: other\nTrace:\nlist() -> []"]

    source = composed_latents(models, retrieve)
    suite = _Suite()
    tasks = suite.tasks("eval")
    latents = source(tasks[:2])
    assert latents.shape == (2, CFG.n_latents, models.backbone.config.hidden_size) and not latents.requires_grad
    calls.clear()
    policy = LatentRollout(models, RolloutConfig(temperature=0.0, max_new_tokens=8, batch_size=2), source)
    records, trajectories = run_tasks(policy, suite, tasks, "qa")
    assert [c[1] for c in calls] == ["q0", "q1", "q2"]  # retrieval keyed by task id (own entries excluded there)
    assert [t.task_id for t in trajectories] == ["q0", "q1", "q2"]
    for traj in trajectories:
        assert traj.metadata["context"] == "latent" and traj.n_turns == 1 and not traj.failed
        assistant = traj.messages[-1]
        assert assistant.role == "assistant" and assistant.token_ids is not None and len(assistant.token_ids) <= 8
    again, _ = run_tasks(policy, suite, tasks, "qa")
    assert [r.to_dict() for r in again] == [r.to_dict() for r in records]  # greedy: deterministic
    assert aggregate("qa", "agent", records)["n_episodes"] == 3
