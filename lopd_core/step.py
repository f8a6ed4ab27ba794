"""One training step (Algorithm 1, steps 2-8) on a batch of the student's own trajectories, for any method.

A method is a teacher-context strategy plus an objective (`lopd_core.methods`); LOPD is `LatentContext` +
`LOPDObjective`:

    strategy, objective = build_method(models, cfg, retrieve=bank_retriever)
    step = TrainStep(models, serializer, strategy, objective, cfg, sink)
    metrics = step(trajectories)     # one optimizer update over (theta, phi), then the dual step on beta

Inside: student forward (student adapter) -> the strategy's teacher inputs (LOPD: latents from the encoder
adapter + QFormer over the top-J retrieved experiences) -> teacher forward ONCE, with gradient when the
teacher's side has trainable parameters (adapters off, latents spliced into the placeholder span) -> fused loss
head over the aligned action tokens (top-M support from the teacher's detached logits) -> objective -> one
AdamW step over two parameter groups (student lr, composer lr) -> the objective's and strategy's post-step
updates (beta; an EMA teacher). Failed rollouts, over-length sequences and records without privileged
context are left out of the loss and counted. The student's and the teacher's passes run on groups of records of
similar length (`lopd.length_grouping`: a short record is not padded to the batch's longest), and the step's parts
are timed (`lopd_core.timing` sections `step/student`, `step/teacher`, `step/backward`, ...).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from lopd_core.adapters import decoder_layers
from lopd_core.batch import DistillBatch, TeacherInputs
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Trajectory
from lopd_core.diagnostics import TokenMarks, marked_positions, teacher_diagnostics
from lopd_core.distributed import World, current_world, gathered, idle_loss, is_sharded, merge_metrics, scalar
from lopd_core.loss_head import HeadOutputs, distill_head, token_logprobs
from lopd_core.losses import advantages_from_rewards
from lopd_core.methods import (  # re-exported: the step's public vocabulary
    ContextStrategy,
    LatentContext,
    LOPDObjective,
    Objective,
    Retriever,
    build_method,
)
from lopd_core.models import LOPDModels, hidden_at
from lopd_core.optim import adamw
from lopd_core.serialization import ChatSerializer, TokenBatch, aligned_action_positions
from lopd_core.timing import section

__all__ = [
    "DistillBatch",
    "LOPDObjective",
    "LatentContext",
    "MetricsSink",
    "Retriever",
    "TeacherInputs",
    "TrainStep",
    "build_method",
]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...


def teacher_side(
    h_teacher: torch.Tensor,
    rows: torch.Tensor,
    n_records: int,
    normalization: str,
    n_tokens_global: int | None = None,
    n_records_global: int | None = None,
) -> torch.Tensor:
    """The teacher's hidden states as the loss sees them. For "reference", an identity whose gradient is rescaled
    per token by N / (B n_b): the token-weighted loss then reaches the teacher side (the composer) as the mean
    over the B records of per-record token means (N tokens in all), the reference code's split (worker.py:
    student loss token-weighted, composer loss per record). Other normalisations: unchanged. Data-parallel, N
    and B are the global counts.
    """
    if normalization != "reference" or not h_teacher.requires_grad:
        return h_teacher
    counts = torch.bincount(rows, minlength=n_records).to(h_teacher.dtype)
    n_tokens = rows.numel() if n_tokens_global is None else n_tokens_global
    n_all = n_records if n_records_global is None else n_records_global
    scale = (n_tokens / (n_all * counts))[rows].unsqueeze(-1)
    out = h_teacher.view_as(h_teacher)
    out.register_hook(lambda grad: grad * scale.to(grad.dtype))
    return out


class StepInputs(NamedTuple):
    """One rank's supervised batch, collated: the records, both views, and the aligned action positions."""

    trajs: list[Trajectory]
    s_batch: TokenBatch
    t_batch: TokenBatch
    rows: torch.Tensor
    s_pos: torch.Tensor
    t_pos: torch.Tensor
    targets: torch.Tensor
    rewards: torch.Tensor
    groups: torch.Tensor
    marked: torch.Tensor | None = None  # [N] 1 where the token realises a rule (`token_marks`), else 0


class _StepModule(nn.Module):
    """Every module of the step under one root, so that DDP sees one forward (the whole loss) per backward."""

    def __init__(self, models: LOPDModels, losses: Callable[..., Any]) -> None:
        super().__init__()
        self.backbone, self.student, self.composer = models.backbone, models.student, models.composer
        self.losses = losses

    def forward(self, *args: Any) -> Any:
        return self.losses(*args)


def shuffled(rewards: torch.Tensor, seed: int, step: int) -> torch.Tensor:
    """`rewards` permuted across the batch by a generator seeded with (seed, step): the same permutation for every
    forward of one step (ppo_epochs), another at the next step (`baseline.shuffle_rewards`)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return rewards[torch.randperm(rewards.numel(), generator=generator).to(rewards.device)]


class TrainStep:
    def __init__(
        self,
        models: LOPDModels,
        serializer: ChatSerializer,
        strategy: ContextStrategy,
        objective: Objective,
        cfg: LOPDConfig,
        sink: MetricsSink | None = None,
        world: World | None = None,
        token_marks: TokenMarks | None = None,
    ) -> None:
        """`token_marks` (optional): an action's text -> character spans of the tokens that realise a rule of the
        suite (toolworld-rules' `rule_spans`), which the teacher diagnostics split the privilege by."""
        self.models = models
        self.token_marks = token_marks
        self.serializer = serializer
        self.strategy = strategy
        self.objective = objective
        self.cfg = cfg
        self.sink = sink
        self.step_index = 0
        # Called after every optimizer step (e.g. loading the new student weights into a vLLM rollout engine);
        # their time is logged as `sync_seconds`.
        self.after_update: list[Callable[[], object]] = []
        # data-parallel (lopd_core.distributed): DDP reduces the student's and the composer's gradients (GRPO leaves
        # the composer unused); FSDP2 (`cfg.data_parallel`, full fine-tuning) shards them, one unit per student layer
        self.world = world or current_world()
        units = decoder_layers(models.student) if cfg.sharded and self.world.active else None
        self.forward = self.world.wrap(_StepModule(models, self._losses), find_unused_parameters=True,
                                       shard_units=units)  # fmt: skip
        self.optimizer = adamw(  # after sharding: FSDP replaces the parameters by their shards
            [
                {"params": models.student_parameters(), "lr": cfg.student_lr, "name": "student"},
                {"params": models.composer_parameters(), "lr": cfg.composer_lr, "name": "composer"},
            ],
            weight_decay=cfg.weight_decay,
        )

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        """The models whole for use outside the step (rollouts, weight syncs): a no-op unless FSDP shards them."""
        return gathered(self.forward)

    def __call__(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        with section("step"):  # what the sections inside leave: views, collation, diagnostics, metrics
            return self._step(trajectories)

    def _step(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        usable = [t for t in trajectories if not t.failed]
        metrics: dict[str, float] = {
            "failed_rollouts": float(len(trajectories) - len(usable)),
            "reward_mean": _mean([t.reward for t in usable]),
            "success_rate": _mean([float(t.reward >= 1.0) for t in usable]),
            "generations": float(sum(t.metadata.get("generations", 1) for t in trajectories)),
        }
        self._weights = {"reward_mean": len(usable), "success_rate": len(usable)}  # for the ranks' weighted means
        contexts = self.strategy.contexts(usable)
        views, n_over, n_no_context, over_ids = [], 0, 0, []
        for traj, ctx in zip(usable, contexts, strict=True):
            if ctx is None and self.strategy.requires_context:
                n_no_context += 1
                continue
            student = self.serializer.student_view(traj)
            teacher = self.serializer.view(traj.messages, ctx)
            if self.serializer.is_overlength(student) or self.serializer.is_overlength(teacher):
                n_over += 1
                over_ids.append(traj.task_id)
            elif student.n_action_tokens > 0:
                views.append((traj, student, teacher))
        if over_ids and self.cfg.fail_on_overlength:
            raise ValueError(
                f"{n_over} sequences exceed max_seq_len={self.cfg.max_seq_len}: {over_ids}; raise max_seq_len, or "
                "set fail_on_overlength=false to leave them out of the loss and count them (n_overlength)"
            )
        metrics.update(n_overlength=float(n_over), n_no_context=float(n_no_context), n_records=float(len(views)))
        inputs = self._collate(views) if views else None
        if inputs is not None and self.cfg.gradient_checkpointing == "auto":  # on for long sequences
            longest = max(inputs.s_batch.input_ids.shape[1], inputs.t_batch.input_ids.shape[1])
            self.models.set_gradient_checkpointing(longest >= self.cfg.gradient_checkpointing_min_len)
        totals = self._global_totals(inputs)
        if not (totals["n_records_global"] if totals else views):
            return self._finish(metrics, t0, updated=False)

        self.models.train()
        old_logp, stats, head, loss = None, {}, None, None
        for _ in range(self.objective.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            loss, stats, head, old_logp = self.forward(inputs, old_logp, totals)
            with section("step/backward"):
                self.world.backward(loss)
            if not self._trains_composer:  # FSDP reduces unused parameters as zero gradients: AdamW's weight decay
                for p in self.models.composer_parameters():  # would then move a composer the method never uses
                    p.grad = None
            with section("step/optimizer"):
                metrics.update(self._clip())
                self.optimizer.step()
        shared = {**stats, "loss": loss.item()} if inputs is not None else {}
        if self.world.active:  # every rank's shares summed: the global Delta, so every rank takes the same beta step
            shared = merge_metrics(self.world, shared, {})
        self.objective.after_step(shared)
        self.strategy.after_step()
        if self.after_update:
            t_sync = time.perf_counter()
            with self.gathered(), section("step/sync"):
                for hook in self.after_update:
                    hook()
            metrics["sync_seconds"] = time.perf_counter() - t_sync

        metrics.update(self.strategy.metrics())
        if inputs is not None:
            metrics["n_action_tokens"] = float(inputs.targets.numel())
        if head is not None and head.teacher_logp is not None and head.teacher_topm_mass is not None:
            metrics.update(
                privilege=head.privilege.mean().item(),
                teacher_topm_mass=head.teacher_topm_mass.mean().item(),
                tail_mass=(1.0 - head.teacher_topm_mass).mean().item(),
                kl_token_max=head.kl.max().item() if head.kl is not None and head.kl.numel() else 0.0,
            )
            n_tokens = metrics["n_action_tokens"]
            self._weights.update(privilege=n_tokens, teacher_topm_mass=n_tokens, tail_mass=n_tokens)
            if self.strategy.requires_context:  # a privileged teacher: what it knows (lopd_core.diagnostics)
                assert inputs is not None
                diagnostics, weights = teacher_diagnostics(head.privilege, inputs.rows, inputs.rewards, inputs.marked)
                metrics.update(diagnostics)
                self._weights.update(weights)
        shared.update(self.objective.metrics())  # its state after the step (LOPD: beta after the dual step)
        return self._finish(metrics, t0, updated=True, shared=shared)

    def _collate(self, views: list[tuple[Trajectory, Any, Any]]) -> StepInputs:
        trajs = [v[0] for v in views]
        s_batch = self.serializer.collate([v[1] for v in views])
        t_batch = self.serializer.collate([v[2] for v in views])
        device = self.models.backbone.device
        rows, s_pos, t_pos, targets = (x.to(device) for x in aligned_action_positions(s_batch, t_batch))
        task_ids = {tid: i for i, tid in enumerate(dict.fromkeys(t.task_id for t in trajs))}
        rewards = torch.tensor([t.reward for t in trajs], device=device)
        groups = torch.tensor([task_ids[t.task_id] for t in trajs], device=device)
        marked = None
        if self.token_marks is not None:
            flags = torch.zeros(s_batch.action_mask.shape, device=device)
            for b, (traj, view, _) in enumerate(views):
                for pos in marked_positions(view, traj, self.serializer.tok, self.token_marks):
                    flags[b, pos] = 1.0
            marked = flags[rows, s_pos + 1]
        return StepInputs(trajs, s_batch, t_batch, rows, s_pos, t_pos, targets, rewards, groups, marked)

    def _global_totals(self, inputs: StepInputs | None) -> dict[str, Any]:
        """Data-parallel: the step's token and record counts and the mean advantage over every rank ({} on one)."""
        if not self.world.active:
            return {}
        local = {"tokens": 0.0, "records": 0.0, "advantage": 0.0, "success": 0.0, "failure": 0.0}
        if inputs is not None:
            adv = advantages_from_rewards(inputs.rewards)
            local = {"tokens": inputs.targets.numel(), "records": len(inputs.trajs), "advantage": adv.sum().item(),
                     "success": (adv > 0).sum().item(), "failure": (adv < 0).sum().item()}  # fmt: skip
        total = self.world.sum_floats(local)
        records = round(total["records"])
        return {
            "n_tokens_global": round(total["tokens"]),
            "n_records_global": records,
            "advantage_mean_global": total["advantage"] / max(records, 1),
            "n_success_global": round(total["success"]),
            "n_failure_global": round(total["failure"]),
            "world_size": self.world.world_size,
        }

    def _losses(
        self, inputs: StepInputs | None, old_logp: torch.Tensor | None, totals: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, float], HeadOutputs | None, torch.Tensor | None]:
        """The forward of one update: (loss, stats, head outputs, the sampling policy's log-probs)."""
        if inputs is None:  # data-parallel, no usable record on this rank: a zero loss keeps it in step with DDP
            if not is_sharded(self.forward):
                return idle_loss(self._idle_parameters()), {}, None, None
            with self.models.acting_student() as student:  # FSDP: the student's layers gather on every rank
                return idle_loss([], student), {}, None, None
        trajs, s_batch, t_batch, rows, s_pos, t_pos, targets, rewards, groups, _ = inputs
        with section("step/student"):
            h_student = self._hidden_at(s_batch, rows, s_pos, lambda b, idx: self.models.student_hidden(b),
                                        sharded=is_sharded(self.forward))  # fmt: skip
        w_student, w_teacher = self.models.head_weights()
        teacher_inputs = TeacherInputs()
        if self.objective.needs_teacher:
            with torch.set_grad_enabled(self._trains_composer):
                with section("step/composer"):  # LOPD: retrieval, the encoder and the QFormer (others: nothing)
                    teacher_inputs = self.strategy.inputs(trajs)
                latents, adapter = teacher_inputs.latents, self.strategy.teacher_adapter
                with section("step/teacher"):
                    h_t = self._hidden_at(t_batch, rows, t_pos, lambda b, idx: self.models.teacher_hidden(
                        b, latents if latents is None or idx is None else latents[idx], adapter))  # fmt: skip
                h_teacher = teacher_side(h_t, rows, len(trajs), self.cfg.loss_normalization,
                                         totals.get("n_tokens_global"), totals.get("n_records_global"))  # fmt: skip
            with section("step/loss_head"):
                head = distill_head(
                    h_student, h_teacher, targets, w_student, w_teacher, self.cfg.top_m, self.cfg.kl_support,
                    self.cfg.head_chunk_size, self.cfg.tail_floor, self.objective.temperature,
                    self.cfg.opd.divergence, self.cfg.opd.divergence_coef,
                )  # fmt: skip
        else:
            with section("step/loss_head"):
                logp = token_logprobs(h_student, targets, w_student, self.cfg.head_chunk_size,
                                      self.objective.temperature)  # fmt: skip
            head = HeadOutputs(student_logp=logp)
        old_logp = head.student_logp.detach() if old_logp is None else old_logp
        if self.cfg.baseline.shuffle_rewards:  # the control arm: the objective sees the rewards permuted
            rewards = shuffled(rewards, self.cfg.seed, self.step_index)
        batch = DistillBatch(rows, len(trajs), rewards, groups, teacher_inputs, old_logp, **totals)
        with section("step/loss_head"):
            loss, stats = self.objective.loss(head, batch)
        return loss, stats, head, old_logp

    def _hidden_at(
        self, batch: TokenBatch, rows: torch.Tensor, pos: torch.Tensor, run: Callable[..., torch.Tensor],
        sharded: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """`run`'s hidden states at (rows, pos), on length groups. A model that FSDP shards gathers its layers in a
        collective at every pass, so every rank must make the same number of passes: one, the whole batch."""
        return hidden_at(batch, rows, pos, run, None if sharded else self.cfg.length_grouping)

    @property
    def _trains_composer(self) -> bool:
        """Whether the step's loss reaches the composer: the teacher is needed, back-propagates into it, and the
        objective trains it (the hybrids keep their teacher as it is)."""
        return self.objective.needs_teacher and self.objective.trains_teacher and self.strategy.teacher_requires_grad

    def _idle_parameters(self) -> list[nn.Parameter]:
        """The parameters a step's loss reaches: the student's, and the composer's when the teacher needs it."""
        return self.models.student_parameters() + (self.models.composer_parameters() if self._trains_composer else [])

    def _clip(self) -> dict[str, float]:
        composer = self.models.composer
        return clip_gradients(
            self.models.student_parameters(), composer.encoder_parameters(), composer.qformer.parameters(), self.cfg
        )

    def _finish(
        self, metrics: dict[str, float], t0: float, updated: bool, shared: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Complete the step's metrics (`shared`: values already global) and log them (rank 0 only)."""
        metrics["updated"] = float(updated)
        metrics["step_seconds"] = time.perf_counter() - t0
        if self.world.active:
            metrics = merge_metrics(self.world, metrics, getattr(self, "_weights", {}))
        metrics.update(shared or {})
        if self.sink is not None and self.world.is_main:
            self.sink.log(self.step_index, metrics)
        self.step_index += 1
        return metrics


def clip_gradients(
    student: Iterable[torch.nn.Parameter],
    encoder_lora: Iterable[torch.nn.Parameter],
    qformer: Iterable[torch.nn.Parameter],
    cfg: LOPDConfig,
) -> dict[str, float]:
    """Clip the student's gradient norm, then the composer's: jointly (`composer_clip: joint`, the reference
    code's training) or the encoder LoRA and the QFormer each on its own (`per_group`). Returns the norms
    before clipping, as `grad_norm_<group>`."""
    if cfg.composer_clip == "joint":
        groups = {"student": (student, cfg.grad_clip_student),
                  "composer": ([*encoder_lora, *qformer], cfg.grad_clip_composer)}  # fmt: skip
    else:
        groups = {"student": (student, cfg.grad_clip_student), "encoder_lora": (encoder_lora, cfg.grad_clip_lora),
                  "qformer": (qformer, cfg.grad_clip_qformer)}  # fmt: skip
    out = {}
    for name, (params, limit) in groups.items():
        with_grad = [p for p in params if p.grad is not None]
        if with_grad:
            out[f"grad_norm_{name}"] = scalar(torch.nn.utils.clip_grad_norm_(with_grad, limit))
    return out


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
