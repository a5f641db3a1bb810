"""Where a model's attention reads its keys from, and which positions its tokens hold: a seam.

Our models call `context.positions` (the global positions of the tokens this process holds) and
`context.attend` (causal attention of its queries over the whole sequence) instead of building
them in line. The default, `WHOLE`, is the plain case: the process holds the whole sequence. Context
parallelism (parallel/context.py) sets another object on the modules, whose tokens are chunks of a
longer sequence and whose attention gathers the keys and values of the other chunks. Kept apart
from the projections so that masks for packed documents and sequence sharding change one place.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


class WholeSequence:
    """This process holds every token of its sequences, at positions 0..T-1."""

    def positions(self, T: int, device: torch.device) -> Optional[torch.Tensor]:
        """The (T,) global positions of the local tokens; None: 0..T-1 (the fast path)."""
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor], dropout: float) -> torch.Tensor:
        """q (B, H, T, D), k and v (B, KV, T, D) with KV dividing H (grouped-query attention);
        mask None (causal) or bool (B, 1, T, T), True = may attend. Returns (B, H, T, D)."""
        k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              is_causal=mask is None)  # (B, H, T, D)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, KV, T, D) -> (B, H, T, D): every query head of a group reads the same k/v head."""
    rep = heads // x.size(1)
    return x.repeat_interleave(rep, dim=1) if rep > 1 else x


WHOLE = WholeSequence()
