"""Data-parallel training on PyTorch's own runtime: torchrun, DDP, NCCL on GPUs and gloo on CPU.

    world = init_distributed()          # reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK; one process = no-op
    world.shard(task_ids)               # this rank's share of the step's tasks (every rank sees the same list)
    world.sum(x)                        # all-reduce SUM of a tensor or float (identity on one rank)
    forward = world.wrap(loss_module)   # DistributedDataParallel when there are several ranks, else the module
    forward = world.wrap(loss_module, shard_units=layers)   # FSDP2 (fully_shard) instead: full fine-tuning
    world.backward(loss)                # this rank's share of the global loss, scaled for DDP's (FSDP's) average
    with gathered(forward): ...         # FSDP: every weight whole, for rollouts and weight syncs outside the step

What is global and how (the rest of the code calls these helpers; one rank never communicates):

- the step's tasks are one list on every rank (same seeded sampler); rank r rolls out `ids[r::world]`, with
  its own rollout seed, so the union over ranks is the one-rank task set;
- losses are sums over this rank's tokens (records) divided by the *global* count (`DistillBatch`), so the
  global loss is the sum of the ranks' losses; DDP averages gradients over ranks, so each rank back-propagates
  `world * loss` and the reduced gradient is exactly the gradient of the global loss;
- scalars that drive control flow (the margin Delta of the dual step on beta) and every logged statistic are
  all-reduced, so every rank takes the same beta step.

DDP keeps a full replica of every weight, gradient and AdamW state on each rank: right for LoRA students, whose
trainable weights are small. FSDP2 (`fully_shard`) shards them over the ranks: each decoder layer of the trained
model is one unit, gathered for its forward and backward and re-sharded after; everything else under the root
(embeddings, the frozen teacher backbone, the composer) is the root unit, gathered for the step's forward and
backward. Gradients are reduce-scattered (averaged, as DDP's), so `backward` is the same for both. Outside the
step (rollouts, weight syncs) `gathered` makes every weight whole; checkpoints hold full tensors
(`full_tensor` on save, `shard_like` on load), so they resume at any world size with either scheme.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    grouped: bool = False  # a process group is set up, even one of a single rank (bench/step_memory.py --fsdp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """More than one rank, or a process group of one: collectives run (a one-rank group runs the data-parallel
        code, FSDP2 included, on one device, as a check of it)."""
        return self.world_size > 1 or self.grouped

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of `items`: every world_size-th item from position `rank`."""
        return list(items[self.rank :: self.world_size])

    def sum(self, value: torch.Tensor | float) -> torch.Tensor:
        """The sum over ranks (float64 on the CPU for python numbers; a tensor stays on its device)."""
        if isinstance(value, torch.Tensor):
            tensor = value.detach().clone()
        else:
            tensor = torch.tensor(float(value), dtype=torch.float64)
        if self.active:
            moved = tensor.to(self.device) if tensor.device != self.device else tensor
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            tensor = moved.to(tensor.device)
        return tensor

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Every value summed over ranks, in one collective (every rank passes the same keys in the same order)."""
        if not self.active or not values:
            return dict(values)
        keys = list(values)
        total = self.sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
        return {k: float(v) for k, v in zip(keys, total.tolist(), strict=True)}

    def wrap(
        self, module: nn.Module, find_unused_parameters: bool = False, shard_units: Sequence[nn.Module] | None = None
    ) -> nn.Module:
        """`module` (whose forward is a whole step's loss) under DDP when there are several ranks, else itself.

        `shard_units` (e.g. the trained model's decoder layers): FSDP2 instead of DDP. Each unit, then `module`
        (the root: every other parameter under it) is sharded in place over the ranks; the module is returned.
        """
        if not self.active:
            return module
        if shard_units is not None:
            return self._fully_shard(module, shard_units)
        cuda = next(module.parameters()).device.type == "cuda"
        ids = [self.local_rank] if cuda else None
        return DistributedDataParallel(
            module, ids, find_unused_parameters=find_unused_parameters, broadcast_buffers=False
        )

    def _fully_shard(self, module: nn.Module, units: Sequence[nn.Module]) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for unit in units:
            fully_shard(unit, mesh=mesh)
        root = fully_shard(module, mesh=mesh)
        # a parameter that one rank's loss does not reach (its records, a method's unused composer) is reduced as
        # a zero gradient, as DDP's find_unused_parameters does, so that the ranks' reductions stay alike
        root.set_reduce_scatter_unused_params(True)
        # FSDP makes the first module that runs forward its root; rollouts run the units before the root ever
        # does, so the root is initialised now
        root._get_fsdp_state()._lazy_init()
        return root

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate this rank's share of the global loss. DDP (and FSDP) average the ranks' gradients, so the
        share is scaled by the world size: the reduced gradient is exactly the gradient of the global loss."""
        (loss * self.world_size if self.active else loss).backward()

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    @property
    def device(self) -> torch.device:
        """Where collectives run: the local GPU under NCCL, the CPU under gloo."""
        if self.active and dist.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


SINGLE = World()


def is_sharded(module: nn.Module) -> bool:
    """Whether `module` was sharded by `World.wrap(..., shard_units=...)` (FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gathered(root: nn.Module) -> Iterator[None]:
    """Every FSDP unit under `root` whole (not re-sharded after each forward) inside the block: rollouts and weight
    syncs call the model outside the step, each rank a different number of times, so they must not communicate.
    A collective at entry (every rank enters); without FSDP, nothing happens."""
    if not is_sharded(root):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in root.modules() if isinstance(m, FSDPModule)]
    inner = [m for m in units if m is not root]  # the root is not re-sharded after forward anyway
    for unit in units:
        unit.unshard()
    for unit in inner:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in inner:
            unit.set_reshard_after_forward(True, recurse=False)
        for unit in units:
            unit.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (DTensor) made whole on every rank (a collective), any other tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (whole, the same on every rank) laid out as `like`: this rank's shard when `like` is sharded."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with every sharded tensor made whole (a collective on every rank). Tied weights stay
    one tensor under both names."""
    out, seen = {}, {}
    for name, value in module.state_dict().items():
        if id(value) not in seen:
            seen[id(value)] = full_tensor(value).detach()
        out[name] = seen[id(value)]
    return out


def scalar(value: torch.Tensor) -> float:
    """A (possibly sharded-reduced) scalar tensor as a float, e.g. a gradient norm under FSDP."""
    return float(full_tensor(value).item())


def idle_loss(params: Sequence[nn.Parameter], model: nn.Module | None = None) -> torch.Tensor:
    """A zero loss for a rank with nothing to train on this step, so that it still joins the gradient reduction:
    it reaches `params` (DDP) and, given `model` (a causal LM, sharded by FSDP), runs one token through it so that
    the model's per-layer gathers and reductions run on this rank too."""
    zero = sum((p.sum() for p in params if not isinstance(p, DTensor)), torch.zeros(()))
    if model is not None:
        device = next(model.parameters()).device
        zero = zero + model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device)).logits.sum()
    return zero * 0.0


REPLICATED = ("beta", "beta_loss", "updated", "grad_norm_")  # equal on every rank (prefixes): rank 0's value
MAXIMA = ("step_seconds", "kl_token_max")


def merge_metrics(world: World, metrics: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Every rank's metrics combined, on every rank: a key in `weights` is a mean over this rank's `weights[key]`
    items (the global value is the weighted mean), `REPLICATED` keys are taken from the first rank that has
    them, `MAXIMA` the max over ranks, and every other value is a count or a share that is summed. A rank may
    lack keys another has (one with no usable record)."""
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, (dict(metrics), dict(weights)))
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for values, _ in gathered for k in values):
        held = [(values[key], w.get(key)) for values, w in gathered if key in values]
        if key.startswith(REPLICATED):
            out[key] = float(held[0][0])
        elif key in MAXIMA:
            out[key] = float(max(v for v, _ in held))
        elif key in weights or any(w is not None for _, w in held):
            total = sum(float(w or 0.0) for _, w in held)
            out[key] = sum(float(v) * float(w or 0.0) for v, w in held) / total if total else 0.0
        else:
            out[key] = float(sum(float(v) for v, _ in held))
    return out


def current_world() -> World:
    """The world of an initialised process group, or the one-rank world."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())), True)
    return SINGLE


def init_distributed(backend: str | None = None, timeout_s: float = 1800.0) -> World:
    """Join the process group torchrun set up (env:// rendezvous); without WORLD_SIZE > 1 return the one-rank world.

    The backend is NCCL when CUDA is available and gloo otherwise (`backend` overrides). Each rank uses the GPU
    `LOCAL_RANK`."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return SINGLE
    if not dist.is_initialized():
        chosen = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if chosen == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    return current_world()


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
