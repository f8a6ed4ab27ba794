"""Latent evaluation (a diagnostic): the teacher — the frozen backbone, every adapter off — acting with its latent
context, on the same tasks as the student.

    latents = composed_latents(models, retrieve)             # task -> [J*K, d] from the top-J retrieved successes
    trajectories = LatentRollout(models, RolloutConfig(temperature=0), latents)(episodes)

The rollout engine feeds token ids only, so this module has its own small generation loop: each turn's prompt
is the teacher view of the conversation so far (`ChatSerializer.view` with `TeacherContext.latent(J*K)`: the
fixed framing and a placeholder span of exactly J*K positions at the start of the first user message, as at
training time), the input embeddings of the placeholder span are replaced by the task's latents
(`lopd_core.models.splice_latents`), and the turn is decoded with a KV cache (left padding, per-row stop at the
end-of-turn token and token budget). Episodes run in batches of `batch_size`; the latents of a task are
composed once (no gradient) and reused on every turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.base import Episode, Task
from lopd_core.models import LOPDModels, splice_latents
from lopd_core.rollout import RolloutConfig
from lopd_core.serialization import ChatSerializer, TeacherContext

LatentSource = Callable[[Sequence[Task]], torch.Tensor]  # tasks -> [B, J*K, d]


def composed_latents(models: LOPDModels, retrieve: Callable[[str, str], list[str]]) -> LatentSource:
    """Latents from the composer over each task's top-J retrieved experiences (the task's own are never retrieved)."""

    @torch.no_grad()
    def latents(tasks: Sequence[Task]) -> torch.Tensor:
        J = models.cfg.n_retrieved
        retrieved = [list(retrieve(t.instruction, t.task_id))[:J] for t in tasks]
        return models.composer([t.instruction for t in tasks], retrieved).detach()

    return latents


@dataclass
class _State:
    episode: Episode
    latents: torch.Tensor  # [J*K, d]
    messages: list[Message] = field(default_factory=list)
    n_turns: int = 0
    n_calls: int = 0
    gen_tokens: int = 0
    truncated_turns: int = 0
    finish_reason: str = ""
    error: str | None = None
    started: float = field(default_factory=time.monotonic)


class LatentRollout:
    """Roll out episodes with the latent teacher (see the module docstring). Callable as a harness policy."""

    def __init__(
        self,
        models: LOPDModels,
        config: RolloutConfig,
        latents: LatentSource,
        serializer: ChatSerializer | None = None,
    ) -> None:
        self.models = models
        self.config = config
        self.latents = latents
        self.serializer = serializer or ChatSerializer(models.tokenizer, max_seq_len=models.cfg.max_seq_len)
        self.context = TeacherContext.latent(models.cfg.n_latents)
        self.header_ids = models.tokenizer(self.serializer.generation_header, add_special_tokens=False)["input_ids"]
        self.stop_ids = {self.serializer.end_of_turn_id} | _eos_ids(models)
        pad = models.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.serializer.end_of_turn_id)

    def __call__(self, episodes: Sequence[Episode]) -> list[Trajectory]:
        return self.run(episodes)

    def run(self, episodes: Sequence[Episode]) -> list[Trajectory]:
        cfg = self.config
        generator = torch.Generator(device=self.models.backbone.device).manual_seed(cfg.seed)
        out: list[Trajectory] = []
        was_training = self.models.backbone.training
        self.models.backbone.eval()
        try:
            for start in range(0, len(episodes), cfg.batch_size):
                batch = list(episodes[start : start + cfg.batch_size])
                latents = self.latents([e.task for e in batch])
                states = [self._open(e, latents[i]) for i, e in enumerate(batch)]
                try:
                    self._play(states, generator)
                finally:
                    out.extend(self._close(s) for s in states)
        finally:
            self.models.backbone.train(was_training)
        return out

    def _open(self, episode: Episode, latents: torch.Tensor) -> _State:
        state = _State(episode, latents)
        try:
            state.messages = list(episode.initial_messages())
        except Exception as exc:
            state.finish_reason, state.error = "error", f"initial_messages: {exc!r}"
        return state

    def _play(self, states: list[_State], generator: torch.Generator) -> None:
        cfg = self.config
        while True:
            rows: list[tuple[_State, list[int], int, int]] = []
            for s in states:
                if s.finish_reason:
                    continue
                view = self.serializer.view(s.messages, self.context)
                ids = view.input_ids + self.header_ids
                budget = min(cfg.max_new_tokens, cfg.max_total_tokens - len(ids))
                if budget <= 0:
                    s.finish_reason = "max_tokens"
                    continue
                rows.append((s, ids, view.latent_start, budget))
            if not rows:
                return
            generations = self.generate(
                [r[1] for r in rows], [r[2] for r in rows], torch.stack([r[0].latents for r in rows]),
                [r[3] for r in rows], generator,
            )  # fmt: skip
            for (s, _, _, _), (tokens, truncated) in zip(rows, generations, strict=True):
                self._advance(s, tokens, truncated)

    def _advance(self, s: _State, tokens: list[int], truncated: bool) -> None:
        text = self.models.tokenizer.decode(tokens, skip_special_tokens=True)
        s.messages.append(Message("assistant", text, token_ids=list(tokens), truncated=truncated))
        s.n_turns += 1
        s.gen_tokens += len(tokens)
        s.truncated_turns += int(truncated)
        try:
            step = s.episode.step(text)
        except Exception as exc:
            s.finish_reason, s.error = "error", f"step: {exc!r}"
            return
        s.messages.extend(step.messages)
        s.n_calls += step.n_calls
        if step.done:
            s.finish_reason = step.event if step.event not in ("call", "") else "finish"
        elif s.n_turns >= self.config.max_turns:
            s.finish_reason = "max_turns"

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        latent_starts: Sequence[int],
        latents: torch.Tensor,
        budgets: Sequence[int],
        generator: torch.Generator | None = None,
    ) -> list[tuple[list[int], bool]]:
        """One turn per prompt from the teacher with `latents` spliced at each prompt's placeholder span."""
        model = self.models.backbone
        device = model.device
        n, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attention[b, width - len(p) :] = 1
        ids, attention = ids.to(device), attention.to(device)
        starts = torch.tensor([width - len(p) + s for p, s in zip(prompts, latent_starts, strict=True)])
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        sampled: list[list[int]] = [[] for _ in range(n)]
        done: list[tuple[list[int], bool] | None] = [None] * n
        with self.models.switch.use(None):  # the teacher: every adapter off
            embeds = splice_latents(model.get_input_embeddings()(ids), latents.to(device), starts)
            out = model(inputs_embeds=embeds, attention_mask=attention, position_ids=positions, use_cache=True)
            next_pos = positions[:, -1]
            for _ in range(max(budgets)):
                tokens = _sample(out.logits[:, -1, :], self.config.temperature, self.config.top_p, generator)
                for b, token in enumerate(tokens.tolist()):
                    if done[b] is not None:
                        continue
                    if token in self.stop_ids:
                        done[b] = (sampled[b], token != self.serializer.end_of_turn_id)
                    else:
                        sampled[b].append(token)
                        if len(sampled[b]) >= budgets[b]:
                            done[b] = (sampled[b], True)
                if all(d is not None for d in done):
                    break
                attention = torch.cat([attention, attention.new_ones((n, 1))], dim=1)
                next_pos = next_pos + 1
                out = model(
                    input_ids=tokens.view(-1, 1), attention_mask=attention, position_ids=next_pos.view(-1, 1),
                    past_key_values=out.past_key_values, use_cache=True,
                )  # fmt: skip
        return [d if d is not None else (sampled[b], True) for b, d in enumerate(done)]

    def _close(self, s: _State) -> Trajectory:
        task = s.episode.task
        meta: dict[str, Any] = {
            "generations": 1,
            "suite": task.suite,
            "difficulty": task.difficulty,
            "generated_tokens": s.gen_tokens,
            "truncated_turns": s.truncated_turns,
            "seconds": round(time.monotonic() - s.started, 3),
            "context": "latent",
        }
        reward, checks, trace, n_calls, n_errors, error = 0.0, [], "", s.n_calls, 0, s.error
        if error is None:
            try:
                result = s.episode.result()
                reward, checks, trace = float(result.reward), list(result.checks), result.trace
                n_calls, n_errors = result.n_calls, result.n_errors
                meta["error_counts"] = dict(result.error_counts)
            except Exception as exc:
                error = f"result: {exc!r}"
        try:
            s.episode.close()
        except Exception:
            pass
        return Trajectory(
            task_id=task.task_id,
            env_id=task.env_id,
            task=task.instruction,
            messages=s.messages or [Message("user", task.instruction)],
            reward=reward if error is None else 0.0,
            split=task.split,
            checks=checks,
            trace=trace,
            failed=error is not None,
            error=error,
            finish_reason="error" if error is not None else (s.finish_reason or "finish"),
            n_turns=s.n_turns,
            n_calls=n_calls,
            n_errors=n_errors,
            metadata=meta,
        )


def _sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _eos_ids(models: LOPDModels) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(models.backbone, "generation_config", None), models.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
