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
from torch.distributed.tensor import DTensor

from lopd_core.distributed import World, full_tensor, shard_like
from lopd_core.models import LOPDModels

FORMAT_VERSION = 1


def model_tensors(models: LOPDModels) -> dict[str, torch.Tensor]:
    """Everything trainable or adapter-held that is not the frozen base weights, whole: tensors that FSDP shards
    are gathered, a collective, so under FSDP every rank calls this in step."""
    out = {f"backbone.{n}": p.detach() for n, p in models.backbone.named_parameters() if "lora_" in n}
    out.update({f"qformer.{n}": t.detach() for n, t in models.composer.qformer.state_dict().items()})
    out.update({f"anchor_qformer.{n}": t.detach() for n, t in models.composer.anchor_qformer.state_dict().items()})
    if models.student is not models.backbone:
        out.update({f"student.{n}": t.detach() for n, t in _untied(models.student.state_dict()).items()})
    if models.ema_teacher:  # full fine-tuning with an EMA teacher: the backbone's base weights moved
        out.update({f"teacher.{n}": p.detach() for n, p, _ in models.teacher_student_pairs()})
    return {k: full_tensor(v).contiguous().cpu() for k, v in out.items()}


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with whole tensors (FSDP's sharded AdamW moments gathered; every rank calls)."""
    state = optimizer.state_dict()
    per_param = {i: {k: full_tensor(v) for k, v in state["state"][i].items()} for i in sorted(state["state"])}
    return {**state, "state": per_param}


def checkpoint_tensors(
    models: LOPDModels, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """What `save_checkpoint` writes of the weights and the optimizer, whole. Data-parallel, every rank calls this
    (FSDP gathers the shards) and rank 0 writes."""
    return model_tensors(models), optimizer_state(optimizer) if optimizer is not None else None


def _shard_optimizer_state(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A whole optimizer state laid out as `optimizer`'s parameters are: each rank's shard under FSDP."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {}
    for i, values in state["state"].items():
        param = params[int(i)]
        per_param[i] = {k: shard_like(v, param) if torch.is_tensor(v) and v.shape == param.shape else v
                        for k, v in values.items()}  # fmt: skip
    return {**state, "state": per_param}


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the second name of a tied tensor (lm_head.weight = embed_tokens.weight): safetensors
    refuses shared storage, and loading the first name restores both."""
    seen: set[tuple[int, int]] = set()
    out = {}
    for name, tensor in state.items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def load_model_tensors(models: LOPDModels, tensors: dict[str, torch.Tensor], student: bool = True) -> None:
    """Load `model_tensors` output into `models` (each tensor laid out as its parameter is, sharded or not).
    `student=False`: the tensors hold the composer only (a cold start's output), and a fully fine-tuned student
    keeps its own weights."""
    if not student and models.student is not models.backbone:
        tensors = {k: v for k, v in tensors.items() if ".student." not in k and not k.startswith("student.")}
    params = dict(models.backbone.named_parameters())
    missing = [n for n in params if "lora_" in n and f"backbone.{n}" not in tensors]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} adapter tensors, e.g. {missing[:3]} (other method?)")
    ema = {k.removeprefix("teacher."): v for k, v in tensors.items() if k.startswith("teacher.")}
    if student and models.ema_teacher and not ema:
        raise ValueError("checkpoint lacks the EMA teacher's weights (teacher.*) that this run's teacher_sync needs")
    with torch.no_grad():
        for key, value in tensors.items():
            if key.startswith(("backbone.", "teacher.")):
                name = key.split(".", 1)[1]
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name} has no place in this model")
                params[name].copy_(shard_like(value, params[name]))
    if student and ema:  # an EMA teacher of a fully fine-tuned student: it keeps following from here
        models.ema_teacher = True
    for prefix, module in (("qformer.", models.composer.qformer), ("anchor_qformer.", models.composer.anchor_qformer)):
        current = module.state_dict()
        given = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        module.load_state_dict({k: shard_like(v, current[k]) if k in current else v for k, v in given.items()})
    if models.student is not models.backbone and student:
        _load_full_student(
            models, {k.removeprefix("student."): v for k, v in tensors.items() if k.startswith("student.")}
        )


def _load_full_student(models: LOPDModels, given: dict[str, torch.Tensor]) -> None:
    """A fully fine-tuned student's weights (`student.*` without the prefix), each laid out as its parameter is."""
    current = models.student.state_dict()
    tied = set(current) - set(_untied(current))
    missing, unexpected = models.student.load_state_dict(
        {k: shard_like(v, current[k]) if k in current else v for k, v in given.items()}, strict=False
    )
    if unexpected or set(missing) - tied:
        raise ValueError(f"student weights do not fit: missing {sorted(set(missing) - tied)[:3]}, "
                         f"unexpected {unexpected[:3]}")  # fmt: skip


def load_student_weights(models: LOPDModels, tensors: dict[str, torch.Tensor]) -> int:
    """Load only the student of `model_tensors` output (a trained run's checkpoint) into `models`: its LoRA factors
    (student_mode lora) or its weights (full). The composer, the teacher's reader and an EMA teacher stay as they
    are. For a re-train that starts from a trained student (flows/era.py). Returns how many tensors were loaded."""
    adapter = models.student_adapter
    if adapter is not None:  # LoRA: the student adapter's factors on the backbone
        mine = {k: v for k, v in tensors.items() if k.startswith("backbone.") and f".{adapter}." in k}
        params = dict(models.backbone.named_parameters())
        wanted = [n for n in params if "lora_" in n and f".{adapter}." in n]
        given = {k.removeprefix("backbone."): v for k, v in mine.items()}
        if sorted(given) != sorted(wanted):
            raise ValueError(f"the checkpoint's student does not fit this one (student_mode=lora): it has "
                             f"{len(given)} of the {len(wanted)} student LoRA tensors; a fully fine-tuned student "
                             "starts only a student_mode=full run")  # fmt: skip
        with torch.no_grad():
            for name, value in given.items():
                params[name].copy_(shard_like(value, params[name]))
        return len(given)
    given = {k.removeprefix("student."): v for k, v in tensors.items() if k.startswith("student.")}
    if not given:
        raise ValueError("the checkpoint holds no fully fine-tuned student (student.*): a LoRA student starts only a "
                         "student_mode=lora run")  # fmt: skip
    _load_full_student(models, given)
    return len(given)


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
    whole: tuple[dict[str, torch.Tensor], dict[str, Any] | None] | None = None,
) -> Path:
    """Write a checkpoint directory at `path` (replacing an older one atomically). `state` must be JSON-able.
    Data-parallel: `ranks_rng`, every rank's RNG states (`gather_rng_states`); `whole`, the weights and optimizer
    state every rank gathered (`checkpoint_tensors`; needed under FSDP)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors, optim = whole if whole is not None else checkpoint_tensors(models, optimizer)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        save_file(tensors, str(tmp / "weights.safetensors"))
        if optim is not None:
            torch.save(optim, tmp / "optimizer.pt")
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
        whole = torch.load(path / "optimizer.pt", weights_only=False)
        optimizer.load_state_dict(_shard_optimizer_state(whole, optimizer))
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
