"""Latent evaluation (a diagnostic): the teacher — the frozen backbone, every adapter off — acting with its latent
context, on the same tasks as the student.

    latents = composed_latents(models, retrieve)             # task -> [J*K, d] from the top-J retrieved successes
    trajectories = LatentRollout(models, RolloutConfig(temperature=0), latents)(episodes)

`LatentRollout` is a `RolloutEngine` (same episode bookkeeping: turns, calls, stops, trajectories) with its own
generation step, because the engine feeds token ids only: each turn's prompt
is the teacher view of the conversation so far (`ChatSerializer.view` with `TeacherContext.latent(J*K)`: the
fixed framing and a placeholder span of exactly J*K positions at the start of the first user message, as at
training time), the input embeddings of the placeholder span are replaced by the task's latents
(`lopd_core.models.splice_latents`), and the turn is decoded with a KV cache (left padding, per-row stop at the
end-of-turn token and token budget). Episodes run in batches of `batch_size`; the latents of a task are
composed once (no gradient) and reused on every turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lopd_core.conversation import Trajectory
from lopd_core.envs.base import Episode, Task
from lopd_core.models import LOPDModels, splice_latents
from lopd_core.rollout import Generation, LiveEpisode, RolloutConfig, RolloutEngine, sample_tokens
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


class LatentRollout(RolloutEngine):
    """Roll out episodes with the latent teacher (see the module docstring). Callable as a harness policy."""

    def __init__(
        self,
        models: LOPDModels,
        config: RolloutConfig,
        latents: LatentSource,
        serializer: ChatSerializer | None = None,
    ) -> None:
        serializer = serializer or ChatSerializer(models.tokenizer, max_seq_len=models.cfg.max_seq_len)
        super().__init__(models.backbone, models.tokenizer, config, serializer)
        self.models = models
        self.latents = latents
        self.context = TeacherContext.latent(models.cfg.n_latents)
        self.header_ids = models.tokenizer(self.serializer.generation_header, add_special_tokens=False)["input_ids"]

    def __call__(self, episodes: Sequence[Episode]) -> list[Trajectory]:
        return self.run(episodes)

    def run(self, episodes: Sequence[Episode], desc: str = "latent rollout") -> list[Trajectory]:
        cfg = self.config
        generator = torch.Generator(device=self.model.device).manual_seed(cfg.seed)
        out: list[Trajectory] = []
        self._reset_stats()
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(episodes), cfg.batch_size):
                batch = list(episodes[start : start + cfg.batch_size])
                latents = self.latents([e.task for e in batch])
                states = [self._open(start + i, e) for i, e in enumerate(batch)]
                try:
                    self._play(states, latents, generator)
                finally:
                    for state in states:
                        trajectory = self._close(state)
                        trajectory.metadata["context"] = "latent"
                        out.append(trajectory)
        finally:
            self.model.train(was_training)
        return out

    def _play(self, states: list[LiveEpisode], latents: torch.Tensor, generator: torch.Generator) -> None:
        cfg = self.config
        while True:
            rows: list[tuple[LiveEpisode, list[int], int, int, int]] = []
            for i, s in enumerate(states):
                if s.finish_reason:
                    continue
                view = self.serializer.view(s.messages, self.context)
                ids = view.input_ids + self.header_ids
                budget = min(cfg.max_new_tokens, cfg.max_total_tokens - len(ids))
                if budget <= 0:
                    s.finish_reason = "max_tokens"
                    continue
                rows.append((s, ids, view.latent_start, budget, i))
            if not rows:
                return
            generations = self.generate_with_latents(
                [r[1] for r in rows], [r[2] for r in rows], latents[[r[4] for r in rows]], [r[3] for r in rows],
                generator,
            )  # fmt: skip
            for row, (tokens, truncated) in zip(rows, generations, strict=True):
                self._advance(row[0], Generation(tokens, truncated))

    @torch.inference_mode()
    def generate_with_latents(
        self,
        prompts: Sequence[Sequence[int]],
        latent_starts: Sequence[int],
        latents: torch.Tensor,
        budgets: Sequence[int],
        generator: torch.Generator | None = None,
    ) -> list[tuple[list[int], bool]]:
        """One turn per prompt from the teacher with `latents` spliced at each prompt's placeholder span."""
        model = self.model
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
        with self.models.switch.use(self.models.teacher_adapter):  # the teacher: adapters off (or its reader)
            embeds = splice_latents(model.get_input_embeddings()(ids), latents.to(device), starts)
            out = model(inputs_embeds=embeds, attention_mask=attention, position_ids=positions, use_cache=True)
            next_pos = positions[:, -1]
            for _ in range(max(budgets)):
                tokens = sample_tokens(out.logits[:, -1, :], self.config.temperature, self.config.top_p, generator)
                for b, token in enumerate(tokens.tolist()):
                    if done[b] is not None:
                        continue
                    if token in self.stop_ids:
                        done[b] = (sampled[b], token != self.end_of_turn_id)
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
