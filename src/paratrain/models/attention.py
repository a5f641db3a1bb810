"""Where a model's attention reads its keys from, and which positions its tokens hold: a seam.

Our models call `context.positions` (the global positions of the tokens this process holds) and
`context.attend` (causal attention of its queries over the whole sequence) instead of building
them in line. The default, `WHOLE`, is the plain case: the process holds the whole sequence. Context
parallelism (parallel/context.py) sets another object on the modules, whose tokens are chunks of a
longer sequence and whose attention gathers the keys and values of the other chunks. Kept apart
from the projections so that masks for packed documents and sequence sharding change one place.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.nn.functional as F


class WholeSequence:
    """This process holds every token of its sequences, at positions 0..T-1."""

    def positions(self, T: int, device: torch.device) -> Optional[torch.Tensor]:
        """The (T,) global positions of the local tokens; None: 0..T-1 (the fast path)."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               dropout: float) -> torch.Tensor:
        """q (B, H, T, D), k and v (B, KV, T, D) with KV dividing H (grouped-query attention);
        mask None (causal), bool (B, 1, T, T) (True = may attend: padded or packed rows) or a
        flex-attention BlockMask (packed rows on CUDA). Returns (B, H, T, D)."""
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
        return attend(q, k, v, mask, dropout)  # (B, H, T, D)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, KV, T, D) -> (B, H, T, D): every query head of a group reads the same k/v head."""
    rep = heads // x.size(1)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


@functools.lru_cache(maxsize=None)
def flex_attention() -> Any:
    """torch's flex_attention, compiled once per process on first use; None where this torch
    has none."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
           dropout: float) -> torch.Tensor:
    """Causal attention of (B, H, T, D) q, k, v under `mask`: None (plain causal), a bool
    (B, 1, T, T) (SDPA), or a flex-attention BlockMask (packed rows on CUDA, no dropout)."""
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex_attention()(q, k, v, block_mask=mask)  # (B, H, T, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                          is_causal=mask is None)  # (B, H, T, D)


WHOLE = WholeSequence()
