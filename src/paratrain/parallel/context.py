"""Context parallelism (`trainer.context_parallel=C`): each sequence cut into chunks over the C
ranks of a mesh dimension (`cp`, parallel/dims.py), so that a long sequence's activations are
split C ways where FSDP, TP and PP split only the weights.

- Load balance (head-tail): the sequence is cut into 2C equal chunks and rank r holds chunks r
  and 2C-1-r. Under causal attention a late chunk attends to more keys than an early one; each
  rank pairing one of each does the same work (Megatron-LM's and torchtitan's split).
- Positions stay global: the rotary tables (Llama) and learned positions (GPT) are read at the
  chunks' own positions (`ContextShard.positions`).
- Attention over the whole sequence by all-gathered keys and values (as Llama 3 was trained),
  not a ring: one softmax over every key of a row, as on one process, so the result is exact to
  fp32 rounding with no log-sum-exp merge of partial results, one collective per layer that gloo
  runs, and K/V are the small tensors (grouped-query attention gathers only the KV heads). The
  cost is holding the layer's whole K/V (B, KV, T, D) while it runs, and no overlap of the
  gather with compute (a ring's advantage at very long sequences on fast links).
- The loss stays a token-weighted sum: every rank of a CP group computes its tokens' losses and
  all of them count (dims.`counts`); the data-parallel wrapper averages gradients over dp x cp
  ranks (dims.`dp_cp`, the loop's scale), and the gather's backward returns each rank the
  gradients of its keys and values from every other rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..models.attention import WholeSequence, repeat_kv


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of each sequence rank `rank` of a CP group of `size` holds (no process group:
    the loop slices its batches with it)."""
    size: int
    rank: int

    def indices(self, T: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """(T / size,) the global positions of this rank's tokens in a sequence of T: chunks
        `rank` and 2*size-1-rank of 2*size."""
        chunk = T // (2 * self.size)
        first = torch.arange(self.rank * chunk, (self.rank + 1) * chunk, device=device)
        last_start = (2 * self.size - 1 - self.rank) * chunk
        second = torch.arange(last_start, last_start + chunk, device=device)
        return torch.cat([first, second])  # (T / size,)

    def batch(self, batch: Any) -> Any:
        """This rank's part of a micro-batch: every (B, T) tensor of it cut to the rank's tokens
        (input ids and their next-token targets alike, so each token keeps its target)."""
        if not isinstance(batch, dict):
            return batch
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2:  # (B, T, ...)
                value = value.index_select(1, self.indices(value.size(1), value.device))
            out[key] = value
        return out


def context_split(dims: Any, rank: int) -> Optional[SequenceSplit]:
    """The tokens `rank` computes of each sequence under `dims` (parallel/dims.py); None
    without context parallelism (the whole sequence)."""
    return SequenceSplit(dims.cp, dims.cp_rank(rank)) if dims.cp > 1 else None


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of (2, B, KV, T/C, D)) over the CP group; backward
    sums every rank's gradient of the whole and returns each its own slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.local = group, rank, x.size(3)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=3)  # (2, B, KV, T, D), rank order

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        return grad.narrow(3, ctx.rank * ctx.local, ctx.local).contiguous(), None, None, None


class ContextShard(WholeSequence):
    """The attention context of one CP rank (models/attention.py's seam): its tokens are the
    head-tail chunks of `split`, and its queries attend to the keys of the whole sequence,
    gathered from the group."""

    def __init__(self, split: SequenceSplit, group: Any):
        self.split, self.group = split, group
        # by (local length, device, dtype): the gathered keys' order and the causal mask, made
        # once and shared by every layer: attention saves its mask for backward, and a bool
        # mask would be turned into a new float one by every layer (T/C x T x 4 bytes each)
        self._layouts: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def positions(self, T: int, device: torch.device) -> torch.Tensor:
        return self.split.indices(T * self.split.size, device)  # (T,) of the whole T * C

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor], dropout: float) -> torch.Tensor:
        """q (B, H, Tl, D) this rank's queries; k, v (B, KV, Tl, D) its keys and values."""
        if mask is not None:
            raise ValueError("context parallelism takes packed sequences (no attention mask)")
        size, Tl = self.split.size, q.size(2)
        kv = self.gather(torch.stack([k, v]))  # (2, B, KV, T, D), each rank's chunks in order
        order, causal = self._layout(Tl, q.device, q.dtype)
        kv = kv.index_select(3, order)  # (2, B, KV, T, D) in sequence order
        k, v = repeat_kv(kv[0], q.size(1)), repeat_kv(kv[1], q.size(1))  # (B, H, T, D)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal,
                                              dropout_p=dropout)  # (B, H, Tl, D)

    def _layout(self, Tl: int, device: torch.device, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """((T,) the order that puts the gathered chunks back in sequence order, (Tl, T) the
        additive mask: 0 for the keys at or before a local query's global position, -inf for
        the others)."""
        key = (Tl, str(device), dtype)
        if key not in self._layouts:
            size = self.split.size
            T = Tl * size
            held = torch.cat([SequenceSplit(size, r).indices(T, device) for r in range(size)])
            pos_q = self.positions(Tl, device)  # (Tl,)
            later = torch.arange(T, device=device)[None, :] > pos_q[:, None]  # (Tl, T)
            mask = torch.zeros(Tl, T, device=device, dtype=dtype).masked_fill_(later, -math.inf)
            self._layouts[key] = (torch.argsort(held), mask)
        return self._layouts[key]


    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        """(2, B, KV, Tl, D) this rank's keys and values -> (2, B, KV, T, D) the group's."""
        return _GatherSequence.apply(kv, self.group, self.split.rank, self.split.size)


class SimulatedShard(ContextShard):
    """Rank 0's context in the plan's meta-device simulation (parallel/simulate.py): the same
    attention with the gather made of copies (no processes), so what autograd saves is counted
    as a run saves it."""

    def __init__(self, size: int):
        super().__init__(SequenceSplit(size, 0), None)

    def gather(self, kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([kv] * self.split.size, dim=3)


def set_context(model: nn.Module, shard: ContextShard) -> int:
    """Set `shard` on every module of `model` whose class has the attention seam
    (models/attention.py); how many took it."""
    seams = [m for m in model.modules() if isinstance(getattr(type(m), "context", None),
                                                      WholeSequence)]
    for module in seams:
        module.context = shard
    return len(seams)


def apply_context_parallel(model: nn.Module, cp_mesh: Any) -> None:
    """Set every attention module (and a model reading learned positions) of `model` to this
    rank's `ContextShard` over the 1-D `cp_mesh`. A ConfigError when none takes it (a model of
    other code: the config check refuses it first, this is the last guard)."""
    split = SequenceSplit(cp_mesh.size(), cp_mesh.get_local_rank())
    if not set_context(model, ContextShard(split, cp_mesh.get_group())):
        raise ConfigError(f"trainer.context_parallel={split.size}: {type(model).__name__} has "
                          "no attention that can take a chunk of a sequence; use the built-in "
                          "llama / gpt, or trainer.context_parallel=1")
