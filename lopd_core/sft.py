"""The warm start: supervised fine-tuning on verified demonstrations (next-token NLL of the action tokens).

    demos, dropped = demonstrations(suite, suite.tasks("train"))   # reference solutions replayed; reward 1.0 only
    losses = sft(model, tokenizer, demos, SFTConfig(steps=600))   # every weight of `model` trained, in place

A demonstration is a task's reference solution (from the suite's scenario) played through the suite's own
episode by `ScriptedPolicy`: the observations are real tool results and a short final answer closes the
episode, so demonstrations have exactly the format of the student's rollouts and the prompt the student will
see. A replay that does not score 1.0 is dropped and counted. Only training-split tasks can be demonstrations:
`demonstrations` refuses any other split, so neither a held-out task nor its instance reaches the SFT data.

Data-parallel (under torchrun, `lopd_core.distributed`): every rank draws the same seeded batches and trains on
its share of each batch's demonstrations; its NLL is its tokens' sum over the batch's *global* token count, so the
ranks' losses add up to the one-rank loss and DDP's reduced gradient is exactly the one-rank gradient.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lopd_core.adapters import decoder_layers
from lopd_core.config import SFTConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.distributed import World, current_world, idle_loss, is_sharded, scalar
from lopd_core.envs.actions import ToolCall, format_call
from lopd_core.envs.base import Suite, Task
from lopd_core.evaluation.harness import ScriptedPolicy
from lopd_core.loss_head import token_logprobs
from lopd_core.methods import privileged_text, solution_text
from lopd_core.optim import adamw
from lopd_core.serialization import ChatSerializer, TokenView


def reference_actions(scenario: dict[str, Any], answer: str = "Done.", style: str = "flat") -> list[str]:
    """The assistant turns of a scenario's reference solution: one JSON call per turn, then the answer."""
    calls = scenario.get("reference_solution") or []
    return [format_call(ToolCall(c["name"], dict(c.get("arguments") or {})), style) for c in calls] + [answer]


def demonstrations(
    suite: Suite, tasks: Sequence[Task], answer: str = "Done.", style: str = "flat"
) -> tuple[list[Trajectory], list[str]]:
    """Verified demonstrations of `tasks` (training split only): (trajectories with reward 1.0, dropped ids)."""
    leaked = [t.task_id for t in tasks if t.split != "train"]
    if leaked:
        raise ValueError(f"demonstrations come from the training split only; got {len(leaked)} others: {leaked[:3]}")
    return verified_replays(suite, tasks, answer, style)


def verified_replays(
    suite: Suite, tasks: Sequence[Task], answer: str = "Done.", style: str = "flat"
) -> tuple[list[Trajectory], list[str]]:
    """The reference solutions of `tasks` (any split) replayed through their episodes: (those that score 1.0,
    dropped ids). Training data only through `demonstrations`; probes of a trained model use the validation slice."""
    scenario = getattr(suite, "scenario", None)
    if scenario is None:
        raise ValueError(f"suite {suite.name!r} has no scenarios with reference solutions to demonstrate")
    with_solution = [t for t in tasks if scenario(t.task_id).get("reference_solution")]
    policy = ScriptedPolicy(lambda task: reference_actions(scenario(task.task_id), answer, style))
    replays = policy([suite.episode(t) for t in with_solution])
    kept = [t for t in replays if t.reward >= 1.0 and not t.failed]
    kept_ids = {k.task_id for k in kept}
    dropped = [t.task_id for t in tasks if t.task_id not in kept_ids]
    return kept, dropped


def reference_traces(suite: Suite, tasks: Sequence[Task], answer: str = "Done.") -> dict[str, str]:
    """task id -> the compact trace of the task's reference solution replayed through its own episode, for tasks
    whose replay verifies (reward 1.0): the form of a successful rollout's trace (OPSD's and SDFT's solutions when
    the model never solved a task; the text teacher's solutions in `teacher_eval`). Any split: nothing trains on
    these tasks here."""
    scenario = getattr(suite, "scenario", None)
    if scenario is None:
        return {}
    with_solution = [t for t in tasks if scenario(t.task_id).get("reference_solution")]
    policy = ScriptedPolicy(lambda task: reference_actions(scenario(task.task_id), answer))
    replays = policy([suite.episode(t) for t in with_solution])
    return {r.task_id: r.trace for r in replays if r.reward >= 1.0 and not r.failed and r.trace}


def nll(model: PreTrainedModel, serializer: ChatSerializer, batch: Sequence[Trajectory], chunk: int = 1024) -> Any:
    """Token-weighted mean NLL of the assistant tokens (content and end-of-turn) of `batch`."""
    total, count = nll_sum(model, serializer, batch, chunk)
    return total / count


def nll_sum(
    model: PreTrainedModel,
    serializer: ChatSerializer,
    batch: Sequence[Trajectory],
    chunk: int = 1024,
    views: Mapping[int, TokenView] | None = None,
) -> tuple[Any, int]:
    """The summed NLL of the assistant tokens (content and end-of-turn) of `batch`, and how many there are.
    `views` (optional): each trajectory's student view by `id()`, tokenised once for a whole training run."""
    views = serializer.collate([views[id(t)] if views else serializer.student_view(t) for t in batch])
    rows, cols = views.action_mask.nonzero(as_tuple=True)
    device = model.device
    hidden = model.model(
        input_ids=views.input_ids.to(device), attention_mask=views.attention_mask.to(device), use_cache=False
    ).last_hidden_state
    targets = views.input_ids[rows, cols].to(device)
    h = hidden[rows.to(device), (cols - 1).to(device)]
    return -token_logprobs(h, targets, model.get_output_embeddings().weight, chunk).sum(), int(targets.numel())


def copy_pretrain(
    model: PreTrainedModel,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 32,
    span: int = 16,
    length: int = 64,
    seed: int = 0,
    progress: bool = True,
) -> list[float]:
    """A from-scratch model's first lesson: copying. Each sequence is random tokens with a random span repeated
    later; the loss is on the repeat. Induction (find the earlier occurrence, continue it) forms in a few hundred
    steps here, whereas demonstrations alone, where ids to copy are a few tokens per turn, did not teach it in
    600 steps (docs/study.md). Nothing about any task is in this data."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = adamw(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.requires_grad_(True)
    model.train()
    for _ in tqdm(range(steps), desc="copy pretraining", unit="step", disable=not progress):
        loss = copy_loss(model, generator, batch_size, span, length)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses


def copy_loss(model: PreTrainedModel, generator: torch.Generator, batch_size: int, span: int, length: int) -> Any:
    """Mean NLL of the repeat of a random span hidden in random tokens (see `copy_pretrain`)."""
    vocab = model.get_input_embeddings().weight.shape[0]
    noise = torch.randint(3, vocab, (batch_size, length), generator=generator)
    repeat = torch.randint(3, vocab, (batch_size, span), generator=generator)
    # Where the span sits changes every batch, so only content (induction), not a fixed offset, predicts the repeat.
    cut = int(torch.randint(1, length, (1,), generator=generator))
    seq = torch.cat([noise[:, :cut], repeat, noise[:, cut:], repeat], dim=1).to(model.device)
    logits = model(input_ids=seq).logits[:, -span - 1 : -1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, -span:].reshape(-1))


def with_privileged_solution(demo: Trajectory) -> Trajectory:
    """The demonstration as OPSD's teacher reads it (`sft.privileged_fraction`): its own trace as the verified
    solution, in front of the first user message. Its token view equals the teacher view of the original."""
    messages = list(demo.messages)
    i = next(k for k, m in enumerate(messages) if m.role == "user")
    messages[i] = Message("user", privileged_text(solution_text(demo.trace)) + messages[i].content)
    return replace(demo, messages=messages, task_id=demo.task_id + "#privileged")


def privileged_copies(
    demos: Sequence[Trajectory],
    fraction: float,
    seed: int,
    recode: Callable[[Trajectory, random.Random], Trajectory] | None = None,
) -> list[Trajectory]:
    """`sft.privileged_fraction`: a seeded share of `demos` (those with a trace), each with its solution in front.
    `recode` (`sft.privileged_codes: pool`) first rewrites each chosen copy, its solution and its own calls alike."""
    if fraction <= 0:
        return []
    rng = random.Random(seed + 1)
    chosen = rng.sample(list(demos), round(fraction * len(demos)))
    if recode is not None:
        chosen = [recode(d, rng) for d in chosen]
    return [with_privileged_solution(d) for d in chosen if d.trace]


def lr_at(step: int, cfg: SFTConfig) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    demos: Sequence[Trajectory],
    cfg: SFTConfig,
    max_seq_len: int = 40_960,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    progress: bool = True,
    world: World | None = None,
) -> list[float]:
    """Train every weight of `model` for `cfg.steps` AdamW steps on seeded batches of `demos`; returns the losses
    (global, the same on every rank). `world` (default: torchrun's, else one rank) splits each batch over ranks;
    under FSDP (`cfg.data_parallel`) `model` is left sharded: `lopd_core.distributed.full_state_dict` gathers it."""
    world = world or current_world()
    if not demos:
        raise ValueError("sft needs at least one demonstration")
    if world.active and cfg.batch_size < world.world_size:
        raise ValueError(f"sft.batch_size={cfg.batch_size} is below the world size {world.world_size}: "
                         "every rank needs a demonstration per step")  # fmt: skip
    serializer = ChatSerializer(tokenizer, max_seq_len)
    views = {id(d): serializer.student_view(d) for d in demos}  # tokenised once (a tenth of a step's time)
    over = [d.task_id for d in demos if serializer.is_overlength(views[id(d)])]
    if over:
        raise ValueError(f"{len(over)} demonstrations exceed max_seq_len={max_seq_len}: {over[:3]}")
    model.requires_grad_(True)
    copy_rng = torch.Generator().manual_seed(cfg.seed)
    loss_of = _SFTLoss(model, serializer, cfg, copy_rng, world, views)
    # several ranks: FSDP2 shards every weight, one unit per decoder layer (cfg.data_parallel), or DDP replicates
    units = decoder_layers(model) if cfg.data_parallel != "ddp" and world.active else None
    forward = world.wrap(loss_of, shard_units=units)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]  # after sharding: FSDP's parameters
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = adamw(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr
    )
    rng = random.Random(cfg.seed)
    lengths = {key: len(view) for key, view in views.items()}
    batches: list[list[Trajectory]] = []
    losses = []
    model.train()
    for step in tqdm(range(cfg.steps), desc="sft", unit="step", disable=not (progress and world.is_main)):
        if not batches:
            batches = _length_buckets(list(demos), lengths, cfg.batch_size, rng)
        batch = batches.pop()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = forward(world.shard(batch))  # this rank's share of the global loss
        optimizer.zero_grad(set_to_none=True)
        world.backward(loss)
        norm = scalar(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        optimizer.step()
        losses.append(float(world.sum(loss.detach())))
        if on_step is not None:
            on_step(step, {"nll": losses[-1], "grad_norm": norm, "lr": optimizer.param_groups[0]["lr"]})
    model.eval()
    return losses


class _SFTLoss(torch.nn.Module):
    """One step's loss on this rank's demonstrations, as a module so that DDP sees the forward of each backward:
    the NLL summed over the rank's tokens / the batch's global token count, plus (`cfg.copy_batch_size`) the copy
    loss, which every rank computes alike and weighs 1/world so that the ranks' terms add up to it once."""

    def __init__(
        self,
        model: PreTrainedModel,
        serializer: ChatSerializer,
        cfg: SFTConfig,
        copy_rng: torch.Generator,
        world: World,
        views: Mapping[int, TokenView],
    ) -> None:
        super().__init__()
        self.model, self.serializer, self.cfg, self.copy_rng, self.world = model, serializer, cfg, copy_rng, world
        self.views = views

    def forward(self, batch: Sequence[Trajectory]) -> torch.Tensor:
        if batch:
            total, count = nll_sum(self.model, self.serializer, batch, views=self.views)
        else:  # a batch's tail shorter than the world: a zero that still reaches every weight, as DDP expects
            total, count = idle_loss(list(self.model.parameters()), self.model if is_sharded(self) else None), 0
        loss = total / float(self.world.sum(float(count)))
        if self.cfg.copy_batch_size:  # keep the copying circuit while the demonstrations are learnt
            c = self.cfg
            copy = copy_loss(self.model, self.copy_rng, c.copy_batch_size, c.copy_span, 4 * c.copy_span)
            loss = loss + copy / self.world.world_size
        return loss


def _length_buckets(
    items: list[Trajectory], lengths: dict[int, int], batch_size: int, rng: random.Random
) -> list[list[Trajectory]]:
    """One epoch of batches with little padding: a seeded permutation, sorted by length within windows of
    8 batches, cut into batches, the batches shuffled."""
    rng.shuffle(items)
    window = 8 * batch_size
    batches = []
    for start in range(0, len(items), window):
        chunk = sorted(items[start : start + window], key=lambda t: lengths[id(t)])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    rng.shuffle(batches)
    return batches


def demonstration_stats(demos: Sequence[Trajectory]) -> dict[str, Any]:
    """Counts for logs: demonstrations, per environment and difficulty, turns."""
    by_env: dict[str, int] = {}
    by_level: dict[str, int] = {}
    for d in demos:
        by_env[d.env_id] = by_env.get(d.env_id, 0) + 1
        level = str(d.metadata.get("difficulty"))
        by_level[level] = by_level.get(level, 0) + 1
    return {"n": len(demos), "by_env": by_env, "by_difficulty": by_level, "turns": sum(d.n_turns for d in demos)}
