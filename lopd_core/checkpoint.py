"""Checkpoints that resume exactly: weights, both optimizer groups, beta, RNG states, data order, caches.

A checkpoint is a directory:

    weights.safetensors     every LoRA factor of the backbone (student, encoder, anchor, EMA teacher), the
                            QFormer and its frozen cold-start copy; full fine-tuning adds the student's weights
    optimizer.pt            AdamW state (both parameter groups)
    latent_cache.safetensors  the cold-start latents c_phi0 seen so far
    state.json              step, objective state (beta), the data sampler's state, counters, config
    rng.pt                  torch, numpy and Python RNG states
    rng_ranks.pt            data-parallel runs: every rank's RNG states (restored when resumed at that world size)

`save_checkpoint` writes into a temporary directory and renames it, so a crash never leaves a partial one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from lopd_core.distributed import World
from lopd_core.models import LOPDModels

FORMAT_VERSION = 1


def model_tensors(models: LOPDModels) -> dict[str, torch.Tensor]:
    """Everything trainable or adapter-held that is not the frozen base weights."""
    out = {f"backbone.{n}": p.detach() for n, p in models.backbone.named_parameters() if "lora_" in n}
    out.update({f"qformer.{n}": t.detach() for n, t in models.composer.qformer.state_dict().items()})
    out.update({f"anchor_qformer.{n}": t.detach() for n, t in models.composer.anchor_qformer.state_dict().items()})
    if models.student is not models.backbone:
        out.update({f"student.{n}": t.detach() for n, t in _untied(models.student.state_dict()).items()})
    return {k: v.contiguous().cpu() for k, v in out.items()}


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the second name of a tied tensor (lm_head.weight = embed_tokens.weight): safetensors
    refuses shared storage, and loading the first name restores both."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def load_model_tensors(models: LOPDModels, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(models.backbone.named_parameters())
    missing = [n for n in params if "lora_" in n and f"backbone.{n}" not in tensors]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} adapter tensors, e.g. {missing[:3]} (other method?)")
    with torch.no_grad():
        for key, value in tensors.items():
            if key.startswith("backbone."):
                name = key.removeprefix("backbone.")
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} has no place in this model")
                params[name].copy_(value)
    for prefix, module in (("qformer.", models.composer.qformer), ("anchor_qformer.", models.composer.anchor_qformer)):
        module.load_state_dict({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})
    if models.student is not models.backbone:
        student = {k.removeprefix("student."): v for k, v in tensors.items() if k.startswith("student.")}
        current = models.student.state_dict()
        tied = set(current) - set(_untied(current))
        missing, unexpected = models.student.load_state_dict(student, strict=False)
        if unexpected or set(missing) - tied:
            raise ValueError(f"student weights do not fit: missing {sorted(set(missing) - tied)[:3]}, "
                             f"unexpected {unexpected[:3]}")  # fmt: skip


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(
    path: str | Path,
    models: LOPDModels,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    ranks_rng: list[dict[str, Any]] | None = None,
) -> Path:
    """Write a checkpoint directory at `path` (replacing an older one atomically). `state` must be JSON-able.
    `ranks_rng`: every rank's RNG states (data-parallel; `gather_rng_states`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        save_file(model_tensors(models), str(tmp / "weights.safetensors"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        models.composer.anchor_cache.save(tmp / "latent_cache.safetensors")
        torch.save(rng_state(), tmp / "rng.pt")
        if ranks_rng is not None:
            torch.save(ranks_rng, tmp / "rng_ranks.pt")
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT_VERSION, **state}, indent=2, sort_keys=True))
        old = path.with_name(f".{path.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def gather_rng_states(world: World) -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (a collective: every rank calls it)."""
    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, rng_state())
    return out


def load_checkpoint(
    path: str | Path,
    models: LOPDModels,
    optimizer: torch.optim.Optimizer | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """Restore weights (and the optimizer, RNG states when given) from `path`; returns the saved state dict.

    RNG states: rank `rank`'s own when the checkpoint was written at `world_size` ranks, else rank 0's."""
    path = Path(path)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no state.json)")
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} != {FORMAT_VERSION}")
    load_model_tensors(models, load_file(str(path / "weights.safetensors")))
    models.composer.anchor_cache.clear()
    models.composer.anchor_cache.load(path / "latent_cache.safetensors")
    if optimizer is not None:
        if not (path / "optimizer.pt").exists():
            raise ValueError(f"{path} holds weights only (a cold-start checkpoint?): it cannot resume training")
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        if world_size > 1 and (path / "rng_ranks.pt").exists():
            ranks = torch.load(path / "rng_ranks.pt", weights_only=False)
            if len(ranks) == world_size:
                set_rng_state(ranks[rank])
    return state


def load_student(path: str | Path, backbone: str | None = None) -> LOPDModels:
    """Rebuild a run's models from its checkpoint directory (config and backbone name from state.json).

    Use `with models.acting_student() as student:` to evaluate or sample from the trained student.
    """
    from lopd_core.adapters import add_lora
    from lopd_core.backbone import load_backbone
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models

    path = Path(path)
    if not (path / "state.json").exists():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no state.json)")
    state = json.loads((path / "state.json").read_text())
    name = backbone or state.get("backbone")
    if not name:
        raise ValueError(f"{path}: the checkpoint does not name its backbone; pass backbone=...")
    cfg = LOPDConfig.model_validate(state["config"])
    model, tok = load_backbone(name)
    models = build_models(model, tok, cfg)
    tensors = load_file(str(path / "weights.safetensors"))
    if any(".teacher." in k for k in tensors):  # an EMA-teacher baseline
        add_lora(models.backbone, "teacher", cfg.student_lora)
        models.switch.refresh()
    load_model_tensors(models, tensors)
    models.eval()
    return models
