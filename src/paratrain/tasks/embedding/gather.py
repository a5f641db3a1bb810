"""Embeddings gathered from every rank with their gradients: the in-batch negatives of the
ranking loss and the pairs of CoSENT span the global batch whatever the world size."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sums every rank's gradient of the gathered tensor and hands
    each rank the rows it contributed (all_reduce: any backend, gloo included)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # (B, H) -> (W B, H)
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(every rank's rows of x, in rank order, with gradients; this rank's first row there).
    Every rank must hold as many rows (a global batch split evenly)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    return _GatherWithGrad.apply(x), dist.get_rank() * x.shape[0]
