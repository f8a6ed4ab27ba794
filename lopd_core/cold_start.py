"""Cold-start of the composer (app. A.2, eq. 14): next-token NLL of successful trajectories under the frozen
backbone with the latent context in its input; only the encoder LoRA and the QFormer learn (and, with
`teacher_reader`, ours, the teacher's reader LoRA, frozen after).

    losses = cold_start(models, serializer, successes, retrieve, cfg, cold)   # then models.composer is phi_0

Each training record is one of the base model's own successful trajectories; its latents come from J other
successes retrieved for its task (never its own: the retriever must exclude the task id, and this function
checks the texts it gets back do not contain the record's own trace). After the last step the composer is
frozen as the anchor phi_0 and the cold-start latents c_phi0 are computed for every record's retrieved set.

Data-parallel (under torchrun, `lopd_core.distributed`): every rank samples the same batches and trains on its
share of each; its NLL is its tokens' sum over the batch's global token count, and DDP reduces the composer's
gradients, so every rank ends with the one-rank composer (and computes the same c_phi0 cache).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from lopd_core.config import ColdStartConfig, LOPDConfig
from lopd_core.conversation import Trajectory, experience_document
from lopd_core.diagnostics import TokenMarks, marked_positions
from lopd_core.distributed import World, current_world, idle_loss
from lopd_core.loss_head import token_logprobs
from lopd_core.models import LOPDModels, hidden_at
from lopd_core.optim import adamw
from lopd_core.serialization import ChatSerializer, TeacherContext, TokenBatch, aligned_action_positions

Retriever = Callable[[str, str], list[str]]
# a record and its retrieved documents -> the same with one code drawn at random written everywhere
# (`HouseRules.relabeller`, `ColdStartConfig.relabel_codes`)
Relabel = Callable[[Trajectory, Sequence[str], random.Random], tuple[Trajectory, list[str]]]


def latent_nll(
    models: LOPDModels, serializer: ChatSerializer, batch: Sequence[Trajectory], retrieved: Sequence[Sequence[str]]
) -> torch.Tensor:
    """Token-weighted NLL of the action tokens under the teacher (adapters off) reading the composed latents."""
    total, count = latent_nll_sum(models, serializer, batch, retrieved)
    return total / count


def latent_nll_sum(
    models: LOPDModels,
    serializer: ChatSerializer,
    batch: Sequence[Trajectory],
    retrieved: Sequence[Sequence[str]],
    select: Callable[[Sequence[Trajectory], TokenBatch, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    | None = None,
    unselected_weight: float = 0.0,
) -> tuple[torch.Tensor, float]:
    """The summed NLL of `latent_nll`, and its number of action tokens; with `select` (`token_selection`), over
    the tokens it keeps: select(batch, student views, rows, positions, targets) -> a 0/1 mask over the tokens,
    each token it leaves out weighted `unselected_weight` (0: left out; 1: every token, as without `select`) in the
    sum and in the count."""
    cfg = models.cfg
    context = TeacherContext.latent(cfg.n_latents)
    s_batch = serializer.collate([serializer.student_view(t) for t in batch])
    t_batch = serializer.collate([serializer.teacher_view(t, context) for t in batch])
    rows, s_pos, t_pos, targets = aligned_action_positions(s_batch, t_batch)
    latents = models.composer([t.task for t in batch], retrieved)
    hidden = hidden_at(t_batch, rows, t_pos, lambda b, idx: models.teacher_hidden(
        b, latents if idx is None else latents[idx], models.teacher_adapter), cfg.length_grouping)  # fmt: skip
    head = models.backbone.get_output_embeddings().weight
    nll = -token_logprobs(hidden, targets, head, cfg.head_chunk_size)
    if select is None:
        return nll.sum(), float(targets.numel())
    keep = select(batch, s_batch, rows, s_pos, targets).to(nll.dtype)
    weight = keep + unselected_weight * (1 - keep)
    return (nll * weight).sum(), float(weight.sum().item())


def token_selector(
    models: LOPDModels, serializer: ChatSerializer, cold: ColdStartConfig, token_marks: TokenMarks | None = None
) -> Callable[..., torch.Tensor] | None:
    """What `cold.token_selection` trains on (None: every action token, the paper's NLL):

    * "surprising": the tokens the teacher without any context predicts with an NLL above
      `cold.surprisal_threshold`: what a context could explain (a code the prompt does not give, not the JSON
      around it), found without knowing the suite;
    * "rule": the tokens that realise a rule of the suite (`token_marks`, the teacher diagnostics' marks)."""
    if cold.token_selection == "all":
        return None
    if cold.token_selection == "rule" and token_marks is None:
        raise ValueError("cold_start.token_selection=rule needs a suite that marks its rule tokens (toolworld-rules)")
    head = models.backbone.get_output_embeddings().weight

    def select(batch: Sequence[Trajectory], s_batch: TokenBatch, rows: torch.Tensor, s_pos: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:  # fmt: skip
        if cold.token_selection == "rule":
            assert token_marks is not None
            flags = torch.zeros(s_batch.action_mask.shape)
            for b, traj in enumerate(batch):
                for pos in marked_positions(serializer.student_view(traj), traj, serializer.tok, token_marks):
                    flags[b, pos] = 1.0
            return flags[rows, s_pos + 1].to(targets.device)
        with torch.no_grad():  # the plain backbone (every adapter off) on the student's view: no context at all
            plain = models.teacher_hidden(s_batch, None, None)[rows, s_pos]
            nll = -token_logprobs(plain, targets, head, models.cfg.head_chunk_size)
        return (nll > cold.surprisal_threshold).float()

    return select


class _ColdStartLoss(torch.nn.Module):
    """One step's loss on this rank's records, as a module so that DDP sees the forward of each backward: the NLL
    summed over the rank's action tokens / the batch's global count."""

    def __init__(
        self,
        models: LOPDModels,
        serializer: ChatSerializer,
        world: World,
        select: Callable[..., torch.Tensor] | None,
        unselected_weight: float = 0.0,
    ) -> None:
        super().__init__()
        self.backbone, self.composer = models.backbone, models.composer
        self.models, self.serializer, self.world, self.select = models, serializer, world, select
        self.unselected_weight = unselected_weight

    def forward(self, batch: Sequence[Trajectory], retrieved: Sequence[Sequence[str]]) -> torch.Tensor:
        if batch:
            total, count = latent_nll_sum(self.models, self.serializer, batch, retrieved, self.select,
                                          self.unselected_weight)  # fmt: skip
        else:  # fewer records than ranks: a zero that still reaches the composer, as DDP expects
            total, count = idle_loss([p for p in self.composer.parameters() if p.requires_grad]), 0
        return total / max(float(self.world.sum(float(count))), 1.0)  # a batch with no selected token: a zero


def cold_start(
    models: LOPDModels,
    serializer: ChatSerializer,
    successes: Sequence[Trajectory],
    retrieve: Retriever,
    cfg: LOPDConfig,
    cold: ColdStartConfig,
    on_step: Callable[[int, float], None] | None = None,
    success_threshold: float = 1.0,
    world: World | None = None,
    relabel: Relabel | None = None,
    on_probe: Callable[[int], None] | None = None,
    probe_every: int = 0,
    token_marks: TokenMarks | None = None,
) -> list[float]:
    """Train the composer for `cold.steps` steps; freeze it as phi_0; fill the c_phi0 cache. Returns the losses
    (global, the same on every rank). `world` (default: torchrun's, else one rank) splits each batch over ranks.
    `relabel` (`cold.relabel_codes`) rewrites each sampled record and its documents with a code drawn at random;
    `on_probe(step)` runs after the last step, and with `probe_every` also before the first and every `probe_every`
    steps (the latent-dependence probe's curve)."""
    world = world or current_world()
    records = [t for t in successes if not t.failed and t.reward >= success_threshold]
    if not records:
        raise ValueError("cold-start needs successful trajectories; collect more or lower the success threshold")
    retrieved = {}
    for t in records:
        items = retrieve(t.task, t.task_id)[: cfg.n_retrieved]
        # Its own entry is exactly its document: a longer task on the same ids contains this one's task text and
        # trace ("2. Set thermostat_1 to 24 degrees." after another call), so containment does not identify it.
        if experience_document(t.task, t.trace) in items:
            raise ValueError(f"the retriever returned task {t.task_id!r}'s own trajectory: self-retrieval leaks")
        retrieved[t.task_id] = items
    reader = models.reader_parameters()  # teacher_reader (ours): the teacher learns to read the latents
    for p in [*models.composer.encoder_parameters(), *models.composer.qformer.parameters(), *reader]:
        p.requires_grad_(True)  # the cold-start trains the composer, whatever freeze_composer says for later
    params = [
        {"params": models.composer.encoder_parameters(), "lr": cold.lr},
        {"params": list(models.composer.qformer.parameters()), "lr": cold.lr},
    ]
    if reader:
        params.append({"params": reader, "lr": cold.lr})
    optimizer = adamw(params, weight_decay=cold.weight_decay)
    rng = random.Random(cfg.seed)
    relabel_rng = random.Random(f"relabel|{cfg.seed}|{world.rank}")  # a rank relabels its own share
    models.train()
    losses = []
    select = token_selector(models, serializer, cold, token_marks)
    forward = world.wrap(
        _ColdStartLoss(models, serializer, world, select, cold.unselected_weight), find_unused_parameters=True
    )  # idle: student
    if on_probe is not None and probe_every:
        on_probe(0)  # the curve starts at the untrained composer
    for step in tqdm(range(cold.steps), desc="cold-start", unit="step", disable=not world.is_main):
        batch = world.shard(rng.sample(records, min(cold.batch_size, len(records))))  # this rank's share
        documents = [retrieved[t.task_id] for t in batch]
        if relabel is not None:  # one random code per record, in its calls and its documents alike
            pairs = [relabel(t, docs, relabel_rng) for t, docs in zip(batch, documents, strict=True)]
            batch, documents = [p[0] for p in pairs], [p[1] for p in pairs]
        loss = forward(batch, documents)
        optimizer.zero_grad(set_to_none=True)
        world.backward(loss)
        torch.nn.utils.clip_grad_norm_(models.composer.encoder_parameters(), cold.grad_clip_lora)
        torch.nn.utils.clip_grad_norm_(models.composer.qformer.parameters(), cold.grad_clip_qformer)
        if reader:
            torch.nn.utils.clip_grad_norm_(reader, cold.grad_clip_lora)
        optimizer.step()
        losses.append(float(world.sum(loss.detach())))
        if on_step is not None:
            on_step(step, losses[-1])
        if on_probe is not None and probe_every and (step + 1) % probe_every == 0 and step + 1 < cold.steps:
            on_probe(step + 1)
    if on_probe is not None:
        on_probe(cold.steps)
    for p in reader:  # the teacher's reader stays as the cold start left it
        p.requires_grad_(False)
    models.composer.freeze_anchor()
    for i in range(0, len(records), cold.batch_size):  # c_phi0 for every retrieved set seen here
        chunk = records[i : i + cold.batch_size]
        models.composer.anchor_latents([t.task for t in chunk], [retrieved[t.task_id] for t in chunk])
    return losses
