"""LoRA adapters on one shared backbone, switched so that activation checkpointing replays the right one.

In the default LoRA setup a single backbone carries every adapter: "student" (the policy), "encoder" (the
composer's encoder) and "anchor" (a frozen copy of the cold-start encoder for c_phi0). The teacher is the
same backbone with every adapter disabled. Which adapter is live is module state, and activation
checkpointing re-runs a layer's forward at backward time: if the live adapter changed in between, the
replayed activations would be wrong. `AdapterSwitch` therefore records the adapter state when a layer runs
forward and re-establishes exactly that state when the layer is recomputed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from lopd_core.config import LoraSpec


def add_lora(model: nn.Module, name: str, spec: LoraSpec) -> nn.Module:
    """Inject a LoRA adapter called `name` into `model` in place; base weights stay as they are."""
    config = LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=list(spec.target_modules)
    )
    with warnings.catch_warnings():  # peft warns that several adapters share the model: that is the design
        warnings.filterwarnings("ignore", message=".*multiple adapters.*")
        inject_adapter_in_model(config, model, adapter_name=name)
    return model


def adapter_parameters(model: nn.Module, name: str) -> list[nn.Parameter]:
    """The LoRA parameters of adapter `name` (every lora_A/lora_B/... weight registered under that name)."""
    params = [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]
    if not params:
        raise KeyError(f"no LoRA adapter named {name!r} in the model")
    return params


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n}


def copy_adapter(model: nn.Module, source: str, target: str) -> None:
    """Copy adapter `source`'s weights into adapter `target` (same LoRA shapes)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            if f".{source}." in n and "lora_" in n:
                params[n.replace(f".{source}.", f".{target}.")].copy_(p)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM: what checkpointing recomputes and FSDP shards, one unit each."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class AdapterSwitch:
    """Selects the live LoRA adapter of a backbone (`None` = the plain backbone, every adapter disabled)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.state: str | None = None
        self.refresh()

    def refresh(self) -> None:
        """Re-collect the LoRA layers (after adapters were added) and re-apply the current state."""
        self.layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._apply(self.state)

    def _apply(self, name: str | None) -> None:
        # Set the layers' fields directly: peft's set_adapter would also flip requires_grad on the others.
        for layer in self.layers:
            layer._disable_adapters = name is None
            if name is not None:
                layer._active_adapter = [name]
        self.state = name

    @contextlib.contextmanager
    def use(self, name: str | None) -> Iterator[None]:
        previous = self.state
        self._apply(name)
        try:
            yield
        finally:
            self._apply(previous)

    def enable_checkpointing(self) -> None:
        """Checkpoint every decoder layer, replaying the adapter state it ran forward with."""
        layers = decoder_layers(self.model)
        if not layers:
            raise ValueError("the model has no checkpointable decoder layers")
        for module in layers:
            module.gradient_checkpointing = True
            module._gradient_checkpointing_func = self._checkpoint

    def disable_checkpointing(self) -> None:
        for module in decoder_layers(self.model):
            module.gradient_checkpointing = False

    def _checkpoint(self, forward: Callable[..., Any], *args: Any) -> Any:
        captured = self.state

        def replay(*inputs: Any) -> Any:
            with self.use(captured):
                return forward(*inputs)

        return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False)
