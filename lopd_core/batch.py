"""What one training step hands its objective: the teacher's inputs and the batch of supervised tokens.

Its own module so that the strategies and objectives (`lopd_core.methods`) and the step (`lopd_core.step`) both
import it and not each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lopd_core.losses import advantages_from_rewards


class TeacherInputs:
    def __init__(self, latents: torch.Tensor | None = None, cold_start_latents: torch.Tensor | None = None) -> None:
        self.latents = latents  # [B, J*K, d] with gradient to the composer
        self.cold_start_latents = cold_start_latents  # [B, J*K, d] anchor targets c_phi0


@dataclass
class DistillBatch:
    rows: torch.Tensor  # [N] record index of each supervised token
    n_records: int
    rewards: torch.Tensor  # [B] r in [0, 1]
    groups: torch.Tensor  # [B] one id per task (GRPO's groups)
    teacher: TeacherInputs
    old_logp: torch.Tensor | None = None  # [N] log-probs of the sampling policy (GRPO's ratio)
    # data-parallel training (lopd_core.distributed): the step's counts over every rank, and the mean of A over
    # every rank's records; None on one rank, where this batch is the whole step
    n_tokens_global: int | None = None
    n_records_global: int | None = None
    advantage_mean_global: float | None = None
    n_success_global: int | None = None  # records with A > 0 (the balanced margin's counts)
    n_failure_global: int | None = None  # records with A < 0
    world_size: int = 1

    @property
    def advantages(self) -> torch.Tensor:
        """A = 2r - 1 (§3.3)."""
        return advantages_from_rewards(self.rewards).to(self.rewards.device)

    def reduce(self, values: torch.Tensor, normalization: str) -> torch.Tensor:
        """Token-weighted mean over the batch (eq. 10, 12), or the mean over records of per-record means.

        "reference" reduces like "token": its composer side is made per-record by `lopd_core.step.teacher_side`.
        Data-parallel: the denominator is the global count, so the result is this rank's share of the global
        mean (the sum over ranks is the mean over the whole step).
        """
        if normalization in ("token", "reference"):
            n = values.numel() if self.n_tokens_global is None else self.n_tokens_global
            return values.sum() / max(n, 1)
        per_record = torch.zeros(self.n_records, dtype=values.dtype, device=values.device)
        counts = torch.zeros_like(per_record)
        per_record = per_record.index_add(0, self.rows, values)
        counts.index_add_(0, self.rows, torch.ones_like(values))
        has = counts > 0
        if self.n_records_global is None:
            return (per_record[has] / counts[has]).mean()
        return (per_record[has] / counts[has]).sum() / max(self.n_records_global, 1)

    def record_share(self) -> float:
        """This rank's share of the step's records (1.0 on one rank): scales a per-record mean to its share."""
        return 1.0 if self.n_records_global is None else self.n_records / max(self.n_records_global, 1)
