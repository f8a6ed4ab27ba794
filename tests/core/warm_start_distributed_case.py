"""The warm start (sft) and the composer's cold start on the tiny backbone, the same code for one process and for
every rank under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.core.warm_start_distributed_case OUT

writes `OUT/sft-rank<r>.pt` (FSDP2), `OUT/sft-ddp-rank<r>.pt` and `OUT/cold-rank<r>.pt` (losses and trained weights
after 3 steps); without torchrun, `run_sft_case()` / `run_cold_start_case()` are the one-rank references. sft: six
demonstrations in batches of 4 give a batch of 2 as well, and the copy loss is on, so the uneven split and the term
every rank computes alike are covered. Cold start: 4 of 5 successes per step, 2 per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lopd_core.backbone import load_backbone
from lopd_core.cold_start import cold_start
from lopd_core.config import ColdStartConfig, LOPDConfig, SFTConfig
from lopd_core.distributed import full_tensor, init_distributed, shutdown_distributed
from lopd_core.envs.toolworld import load_toolworld
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer
from lopd_core.sft import demonstrations, sft
from tests.core.test_step import make_batch, retrieve

SFT = SFTConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, copy_batch_size=2, copy_span=4)
COMPOSER = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64)
COLD = ColdStartConfig(steps=3, batch_size=4, lr=1e-3)


def run_sft_case(data_parallel: str = "auto") -> dict[str, Any]:
    """sft on one rank, or data-parallel: FSDP2 (auto) or DDP."""
    world = init_distributed()
    torch.manual_seed(0)
    model, tok = load_backbone("tiny")
    suite = load_toolworld(prompt="compact")
    try:
        demos, _ = demonstrations(suite, [t for t in suite.tasks("train") if t.difficulty == 1][:6])
    finally:
        suite.close()
    losses = sft(model, tok, demos, SFT.model_copy(update={"data_parallel": data_parallel}), progress=False,
                 world=world)  # fmt: skip
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    weights = {name: full_tensor(p).detach().clone() for name, p in model.named_parameters()}  # FSDP: gathered
    return {"losses": losses, "weights": weights, "world_size": world.world_size, "rank": world.rank,
            "share": held / sum(p.numel() for p in model.parameters())}  # fmt: skip


def run_cold_start_case() -> dict[str, Any]:
    world = init_distributed()
    torch.manual_seed(0)
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, COMPOSER)
    losses = cold_start(models, ChatSerializer(tok), make_batch((1.0,) * 5), retrieve, COMPOSER, COLD, world=world)
    trained = [*models.composer.encoder_parameters(), *models.composer.qformer.parameters()]
    weights = {f"composer.{i}": p.detach().clone() for i, p in enumerate(trained)}
    anchor = {k: v.clone() for k, v in models.composer.anchor_cache._data.items()}  # c_phi0 by content digest
    return {"losses": losses, "weights": weights, "anchor": anchor, "world_size": world.world_size, "rank": world.rank}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    cases = {"sft": run_sft_case, "sft-ddp": lambda: run_sft_case("ddp"), "cold": run_cold_start_case}
    for name, case in cases.items():
        result = case()
        torch.save(result, out / f"{name}-rank{result['rank']}.pt")
    shutdown_distributed()
