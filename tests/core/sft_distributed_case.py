"""The warm start (sft) on the tiny backbone, the same code for one process and for every rank under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.core.sft_distributed_case OUT_DIR

writes `OUT_DIR/sft-rank<r>.pt` (losses and weights after 3 steps); without torchrun, `run_case()` is the one-rank
reference. Six demonstrations in batches of 4 give a batch of 2 as well, and the copy loss is on, so both the
uneven split and the term every rank computes alike are covered.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from lopd_core.backbone import load_backbone
from lopd_core.config import SFTConfig
from lopd_core.distributed import init_distributed, shutdown_distributed
from lopd_core.envs.toolworld import load_toolworld
from lopd_core.sft import demonstrations, sft

CFG = SFTConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=1, copy_batch_size=2, copy_span=4)


def run_case() -> dict[str, Any]:
    world = init_distributed()
    torch.manual_seed(0)
    model, tok = load_backbone("tiny")
    suite = load_toolworld(prompt="compact")
    try:
        demos, _ = demonstrations(suite, [t for t in suite.tasks("train") if t.difficulty == 1][:6])
    finally:
        suite.close()
    losses = sft(model, tok, demos, CFG, progress=False, world=world)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "weights": weights, "world_size": world.world_size, "rank": world.rank}


if __name__ == "__main__":
    result = run_case()
    torch.save(result, Path(sys.argv[1]) / f"sft-rank{result['rank']}.pt")
    shutdown_distributed()
