"""One joint training step (Algorithm 1, steps 2-8) on a batch of the student's own trajectories.

A method is a teacher-context strategy plus an objective; LOPD is `LatentContext` + `LOPDObjective`:

    step = TrainStep(models, serializer, LatentContext(models.composer, retrieve, cfg), LOPDObjective(cfg), cfg)
    metrics = step(trajectories)     # one optimizer update over (theta, phi), then the dual step on beta

Inside: student forward (student adapter) -> compose latents from the top-J retrieved experiences (encoder
adapter + QFormer) -> teacher forward ONCE with gradient (adapters off, latents spliced into the placeholder
span) -> fused loss head over the aligned action tokens (top-M support from the teacher's detached logits)
-> objective -> one AdamW step over two parameter groups (student lr, composer lr) -> beta update.
Failed rollouts and over-length sequences are left out of the loss and counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lopd_core.composer import Composer
from lopd_core.config import LOPDConfig
from lopd_core.conversation import Trajectory
from lopd_core.loss_head import HeadOutputs, distill_head
from lopd_core.losses import advantages_from_rewards, anchor_penalty, dual_step, lagrangian
from lopd_core.models import LOPDModels
from lopd_core.serialization import ChatSerializer, TeacherContext, aligned_action_positions

Retriever = Callable[[str, str], list[str]]  # (task text, task id) -> up to J experience texts, never the task's own


class MetricsSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...


@dataclass
class TeacherInputs:
    latents: torch.Tensor | None = None  # [B, J*K, d] with gradient to the composer
    cold_start_latents: torch.Tensor | None = None  # [B, J*K, d] anchor targets c_phi0


class ContextStrategy(Protocol):
    """What the teacher reads on top of the student's conversation."""

    teacher_requires_grad: bool  # False when no trainable parameter sits on the teacher's side

    def context(self, trajectory: Trajectory) -> TeacherContext | None: ...

    def inputs(self, trajectories: Sequence[Trajectory]) -> TeacherInputs: ...


class Objective(Protocol):
    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]: ...

    def after_step(self, stats: Mapping[str, float]) -> None: ...


@dataclass
class DistillBatch:
    rows: torch.Tensor  # [N] record index of each supervised token
    n_records: int
    advantages: torch.Tensor  # [B] A = 2r - 1
    teacher: TeacherInputs

    def reduce(self, values: torch.Tensor, normalization: str) -> torch.Tensor:
        """Token-weighted mean over the batch (eq. 10, 12), or the mean over records of per-record means."""
        if normalization == "token":
            return values.sum() / max(values.numel(), 1)
        per_record = torch.zeros(self.n_records, dtype=values.dtype, device=values.device)
        counts = torch.zeros_like(per_record)
        per_record.index_add_(0, self.rows, values)
        counts.index_add_(0, self.rows, torch.ones_like(values))
        has = counts > 0
        return (per_record[has] / counts[has]).mean()


class LatentContext:
    """LOPD: the teacher reads J*K latents composed from the top-J retrieved successes (§3.2)."""

    teacher_requires_grad = True

    def __init__(self, composer: Composer, retrieve: Retriever, cfg: LOPDConfig) -> None:
        self.composer = composer
        self.retrieve = retrieve
        self.cfg = cfg

    def context(self, trajectory: Trajectory) -> TeacherContext:
        return TeacherContext.latent(self.cfg.n_latents)

    def inputs(self, trajectories: Sequence[Trajectory]) -> TeacherInputs:
        tasks = [t.task for t in trajectories]
        retrieved = [self.retrieve(t.task, t.task_id)[: self.cfg.n_retrieved] for t in trajectories]
        latents = self.composer(tasks, retrieved)
        return TeacherInputs(latents, self.composer.anchor_latents(tasks, retrieved))


class LOPDObjective:
    """L = distill + beta (m - Delta) + lambda anchor (eq. 13), then beta <- max(0, beta + eta (m - Delta))."""

    def __init__(self, cfg: LOPDConfig) -> None:
        self.cfg = cfg
        self.beta = cfg.beta_init

    def loss(self, head: HeadOutputs, batch: DistillBatch) -> tuple[torch.Tensor, dict[str, float]]:
        norm = self.cfg.loss_normalization
        distill = batch.reduce(head.kl, norm)
        margin = batch.reduce(batch.advantages[batch.rows] * head.privilege, norm)
        t = batch.teacher
        if t.latents is None or t.cold_start_latents is None:
            raise ValueError("LOPDObjective needs latents and cold-start latents from the context strategy")
        anchor = anchor_penalty(t.latents, t.cold_start_latents, self.cfg.anchor_reduction)
        loss = lagrangian(distill, margin, anchor, self.beta, self.cfg.margin_target, self.cfg.anchor_weight)
        stats = {"distill_kl": distill.item(), "margin": margin.item(), "anchor": anchor.item(), "beta": self.beta}
        return loss, stats

    def after_step(self, stats: Mapping[str, float]) -> None:
        self.beta = dual_step(self.beta, stats["margin"], self.cfg.margin_target, self.cfg.dual_lr)

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.beta = float(state["beta"])


class TrainStep:
    def __init__(
        self,
        models: LOPDModels,
        serializer: ChatSerializer,
        strategy: ContextStrategy,
        objective: Objective,
        cfg: LOPDConfig,
        sink: MetricsSink | None = None,
    ) -> None:
        self.models = models
        self.serializer = serializer
        self.strategy = strategy
        self.objective = objective
        self.cfg = cfg
        self.sink = sink
        self.step_index = 0
        self.optimizer = torch.optim.AdamW(
            [
                {"params": models.student_parameters(), "lr": cfg.student_lr, "name": "student"},
                {"params": models.composer_parameters(), "lr": cfg.composer_lr, "name": "composer"},
            ],
            weight_decay=cfg.weight_decay,
        )

    def __call__(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        usable = [t for t in trajectories if not t.failed]
        metrics: dict[str, float] = {
            "failed_rollouts": float(len(trajectories) - len(usable)),
            "reward_mean": _mean([t.reward for t in usable]),
            "success_rate": _mean([float(t.reward >= 1.0) for t in usable]),
            "generations": float(sum(t.metadata.get("generations", 1) for t in trajectories)),
        }
        views = []
        for traj in usable:
            student = self.serializer.student_view(traj)
            teacher = self.serializer.view(traj.messages, self.strategy.context(traj))
            views.append((traj, student, teacher))
        is_over = [self.serializer.is_overlength(s) or self.serializer.is_overlength(t) for _, s, t in views]
        over = [v[0].task_id for v, flag in zip(views, is_over, strict=True) if flag]
        if over and self.cfg.fail_on_overlength:
            raise ValueError(f"{len(over)} sequences exceed max_seq_len={self.cfg.max_seq_len}: {over}")
        kept = [v for v, flag in zip(views, is_over, strict=True) if not flag and v[1].n_action_tokens > 0]
        metrics["n_overlength"] = float(len(over))
        metrics["n_records"] = float(len(kept))
        if not kept:
            return self._finish(metrics, t0, updated=False)

        trajs = [v[0] for v in kept]
        s_batch = self.serializer.collate([v[1] for v in kept])
        t_batch = self.serializer.collate([v[2] for v in kept])
        rows, s_pos, t_pos, targets = aligned_action_positions(s_batch, t_batch)
        device = self.models.backbone.device
        rows, s_pos, t_pos, targets = rows.to(device), s_pos.to(device), t_pos.to(device), targets.to(device)

        self.models.train()
        h_student = self.models.student_hidden(s_batch)[rows, s_pos]
        with torch.set_grad_enabled(self.strategy.teacher_requires_grad):
            teacher_inputs = self.strategy.inputs(trajs)
            h_teacher = self.models.teacher_hidden(t_batch, teacher_inputs.latents)[rows, t_pos]
        w_student, w_teacher = self.models.head_weights()
        head = distill_head(
            h_student, h_teacher, targets, w_student, w_teacher, self.cfg.top_m, self.cfg.kl_support,
            self.cfg.head_chunk_size,
        )  # fmt: skip
        batch = DistillBatch(
            rows, len(kept), advantages_from_rewards([t.reward for t in trajs]).to(device), teacher_inputs
        )
        loss, stats = self.objective.loss(head, batch)

        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        metrics.update(self._clip())
        self.optimizer.step()
        self.objective.after_step(stats)

        metrics.update(stats)
        metrics["beta_loss"] = stats.get("beta", 0.0)  # the beta this step's loss used
        metrics.update(
            loss=loss.item(),
            privilege_mean=head.privilege.mean().item(),
            teacher_topm_mass=head.teacher_topm_mass.mean().item(),
            tail_mass=(1.0 - head.teacher_topm_mass).mean().item(),
            n_action_tokens=float(targets.numel()),
        )
        if hasattr(self.objective, "beta"):
            metrics["beta"] = float(self.objective.beta)  # after the dual step
        return self._finish(metrics, t0, updated=True)

    def _clip(self) -> dict[str, float]:
        composer = self.models.composer
        groups = {
            "student": (self.models.student_parameters(), self.cfg.grad_clip_student),
            "encoder_lora": (composer.encoder_parameters(), self.cfg.grad_clip_lora),
            "qformer": (list(composer.qformer.parameters()), self.cfg.grad_clip_qformer),
        }
        return {
            f"grad_norm_{name}": torch.nn.utils.clip_grad_norm_(params, limit).item()
            for name, (params, limit) in groups.items()
        }

    def _finish(self, metrics: dict[str, float], t0: float, updated: bool) -> dict[str, float]:
        metrics["updated"] = float(updated)
        metrics["step_seconds"] = time.perf_counter() - t0
        if self.sink is not None:
            self.sink.log(self.step_index, metrics)
        self.step_index += 1
        return metrics


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0
