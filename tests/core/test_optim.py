"""AdamW takes the fused kernel where it exists, and the update is the loop's."""

from __future__ import annotations

import torch

from lopd_core.optim import adamw, fused_supported


def _train(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40, 30, dtype=dtype)) for _ in range(3)]
    groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    opt = adamw(groups, weight_decay=0.01) if fused else torch.optim.AdamW(groups, weight_decay=0.01, foreach=False)
    assert opt.defaults["fused"] is (True if fused else None)
    g = torch.Generator().manual_seed(1)
    for _ in range(25):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g, dtype=dtype)
        opt.step()
    return [p.detach() for p in params]


def test_fused_adamw_is_the_loop_update():
    for dtype, tol in ((torch.float64, 1e-13), (torch.float32, 1e-6)):
        fused, loop = _train(dtype, True), _train(dtype, False)
        for a, b in zip(fused, loop, strict=True):
            assert (a - b).abs().max() <= tol
        torch.manual_seed(0)
        start = [torch.randn(40, 30, dtype=dtype) for _ in range(3)]  # what _train starts from
        assert all((a - s).abs().max() > 1e-3 for a, s in zip(fused, start, strict=True))  # both moved, together


def test_fused_only_where_a_kernel_exists():
    assert fused_supported([torch.zeros(2)])
    assert not fused_supported([torch.zeros(2, dtype=torch.int64)])
    assert not fused_supported([])
    opt = adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1)
    assert opt.defaults["fused"] is True
