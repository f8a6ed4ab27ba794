"""AdamW with the fused kernel wherever the parameters' device has one.

PyTorch's default on CPU is the per-parameter loop: 0.57 s a step for SmolLM2-135M on one core, against 0.15 s
fused (`foreach`, the CUDA default, is 0.83 s on CPU). The fused kernel computes the same update in another order
of operations: it agrees with the loop to the last bits of float32 (2e-7 after 20 steps), exactly in float64 to
rounding (tests/core/test_optim.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import _get_fused_kernels_supported_devices


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter lives on a device with a fused AdamW kernel and is floating point."""
    devices = set(_get_fused_kernels_supported_devices())
    params = list(params)
    return bool(params) and all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def adamw(param_groups: Iterable[Any], **kwargs: Any) -> torch.optim.AdamW:
    """`torch.optim.AdamW(param_groups, **kwargs)`, fused when `fused_supported` holds for all parameters."""
    groups = list(param_groups)
    params = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return torch.optim.AdamW(groups, fused=fused_supported(params) or None, **kwargs)
