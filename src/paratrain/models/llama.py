"""A Llama decoder, written to be read: RMSNorm, rotary embeddings, grouped-query attention and
a SwiGLU MLP, as in Meta's reference implementation.

Each TransformerBlock is self-contained (it owns its rotary tables) and its forward takes only
`(x, mask)`, so activation checkpointing and FSDP can wrap blocks one by one.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config.presets import ModelArgs
from .attention import WHOLE, flex_attention


class RMSNorm(nn.Module):
    """LayerNorm without the mean and the bias: cheaper, and as good for pre-norm transformers."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in fp32: under bf16 the mean of squares loses too many bits
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Rotary(nn.Module):
    """Rotary position embeddings (RoPE): rotate each (even, odd) pair of channels of q and k by
    an angle proportional to the position, so q·k depends only on the distance between tokens.

    The cos/sin tables are non-persistent buffers (not in checkpoints: they are a function of
    the config). `_apply` rebuilds them in fp32 after every `.to()`, `.half()` or `to_empty()`:
    a bf16 table would be off by a whole radian at position 256, and a meta-device model
    materialized with `to_empty()` would otherwise hold garbage.
    """

    def __init__(self, head_dim: int, max_seq_length: int, theta: float):
        super().__init__()
        self.head_dim, self.max_seq_length, self.theta = head_dim, max_seq_length, theta
        cos, sin = self._tables(None)  # None: the default device
        self.register_buffer("cos", cos, persistent=False)  # (T_max, D/2)
        self.register_buffer("sin", sin, persistent=False)  # (T_max, D/2)

    def _tables(self, device: Optional[torch.device]) -> tuple[torch.Tensor, torch.Tensor]:
        half = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (half / self.head_dim))  # (D/2,)
        pos = torch.arange(self.max_seq_length, device=device, dtype=torch.float32)
        angles = torch.outer(pos, inv_freq)  # (T_max, D/2)
        return angles.cos(), angles.sin()

    def _apply(self, fn, *args, **kwargs):
        super()._apply(fn, *args, **kwargs)
        self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: (B, H, T, D); positions: None (0..T-1), (T,) the tokens' global positions (context
        # parallelism) or (B, T), restarting per packed example
        T = x.size(-2)
        if positions is None:
            cos = self.cos[:T].float()  # (T, D/2), broadcasts over B and H
            sin = self.sin[:T].float()
        else:
            cos = self.cos[positions].float()  # (T, D/2) or (B, T, D/2)
            sin = self.sin[positions].float()
            if positions.dim() == 2:  # (B, 1, T, D/2): broadcasts over H
                cos, sin = cos[:, None], sin[:, None]
        xf = x.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]  # (B, H, T, D/2) each
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, H, T, D/2, 2)
        return out.flatten(-2).type_as(x)  # (B, H, T, D)


class Attention(nn.Module):
    """Causal self-attention with grouped-query attention: num_kv_heads key/value heads are
    shared by groups of query heads, which shrinks k/v projections (and a KV cache). Which
    positions its tokens hold and which keys they see is its `context`'s (models/attention.py;
    context parallelism sets another)."""
    context = WHOLE

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
        self.rotary = Rotary(args.head_dim, args.max_seq_length, args.rope_theta)
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor],
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T = x.shape[:2]  # (B, T, C)
        # Heads are counted from the projections' output, not the config: under tensor
        # parallelism a rank holds H/tp query and KV/tp key/value heads (its slice of wq, wk, wv).
        D = self.head_dim
        q = self.wq(x).view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, -1, D).transpose(1, 2)  # (B, KV, T, D)
        v = self.wv(x).view(B, T, -1, D).transpose(1, 2)  # (B, KV, T, D)
        pos = self.context.positions(T, x.device) if positions is None else positions
        q, k = self.rotary(q, pos), self.rotary(k, pos)  # pos: None (0..T-1), (T,) or (B, T)
        p = self.dropout if self.training else 0.0
        y = self.context.attend(q, k, v, mask, p)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: a gated MLP, silu(x W1) * (x W3), projected back by W2."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w3 = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.w2 = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, I) -> (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.feed_forward = FeedForward(args)
        self.resid_dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: (B, T, C); mask: None (plain causal), bool (B, 1, T, T) (True = may attend) or a
        # flex-attention BlockMask; positions: None or (B, T), restarting per packed example
        # positions by keyword: tensor parallelism's input plan lays out (x, mask) alone
        h = self.attention(self.attention_norm(x), mask, positions=positions)
        x = x + self.resid_dropout(h)
        x = x + self.resid_dropout(self.feed_forward(self.ffn_norm(x)))
        return x


def padding_to_attn_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 1 = token / 0 = pad  ->  bool (B, 1, T, T): causal AND key is real.

    Every query may also attend to itself, so the row of a pad query (all keys before it are
    pads under left padding) is never empty: an empty row makes softmax return NaN, and NaN
    in a pad position still poisons gradients through the sum in the loss.
    """
    B, T = attention_mask.shape
    real = attention_mask.to(torch.bool)  # (B, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()  # (T, T)
    eye = torch.eye(T, dtype=torch.bool, device=real.device)  # (T, T)
    return (causal & real[:, None, None, :]) | eye  # (B, 1, T, T)


class Llama(nn.Module):
    block_class = TransformerBlock
    # what a pipeline's first stage holds besides blocks, and its last (parallel/pipeline.py):
    # the modules `embed` and `head` read
    pipeline_input = ("tok_embeddings", "dropout")
    pipeline_output = ("norm", "lm_head")

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.dropout = nn.Dropout(args.dropout)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02); the projections that write into the residual stream get
        1/sqrt(2 * num_layers) of that, so the stream's variance does not grow with depth."""
        gpt2_init(self, self.args.num_layers, residual=("wo.weight", "w2.weight"))

    def forward(self, idx: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """idx (B, T); attention_mask (B, T) 1 = token, 0 = pad; position_ids (B, T) restarting
        at 0 where a packed example (or document) starts: attention stays inside each."""
        mask = check_input(idx, attention_mask, self.args.max_seq_length, position_ids,
                           sparse=self.args.dropout == 0.0)
        x = self.embed(idx)  # (B, T, C)
        for block in self.layers:
            x = block(x, mask) if position_ids is None else block(x, mask, position_ids)
        return self.head(x)  # (B, T, V)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.tok_embeddings(idx))  # (B, T) -> (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))  # (B, T, C) -> (B, T, V)


def gpt2_init(model: nn.Module, num_layers: int, residual: tuple[str, ...]) -> None:
    """GPT-2 init shared by our models: biases 0, norm gains 1, matrices N(0, 0.02), and the
    projections named in `residual` (they write into the residual stream) 1/sqrt(2 * layers)
    of that."""
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() < 2:
            nn.init.ones_(p)
        elif name.endswith(residual):
            nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * num_layers))
        else:
            nn.init.normal_(p, 0.0, 0.02)


def check_input(idx: torch.Tensor, attention_mask: Optional[torch.Tensor],
                max_seq_length: int, position_ids: Optional[torch.Tensor] = None,
                sparse: bool = True) -> Any:
    """Refuse sequences longer than the model was built for; the attention mask: None for the
    causal fast path, (B, 1, T, T) for padded rows, block-diagonal for packed ones."""
    T = idx.shape[1]
    if T > max_seq_length:
        raise ValueError(f"sequence of length {T} exceeds model.max_seq_length={max_seq_length}")
    if position_ids is not None:
        return document_mask(position_ids, attention_mask, sparse)
    return None if attention_mask is None else padding_to_attn_mask(attention_mask)


def segments_of(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions -> (B, T) segment ids: a new segment wherever the position does not
    follow the previous one by 1 (transformers' rule for packed rows:
    masking_utils.find_packed_sequence_indices)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)  # (B, T)
    return (step != 1).cumsum(-1)  # (B, T)


def document_mask(position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  sparse: bool = True) -> Any:
    """Block-diagonal causal attention for packed rows: a query sees the keys before it in its
    own segment (example, document) only. On CUDA with flex-attention and `sparse` (a model
    without attention dropout), a BlockMask: blocks across segments are skipped; else a bool
    (B, 1, T, T) for SDPA. A pad (attention_mask 0) is a segment of its own: it sees itself."""
    seg = segments_of(position_ids)  # (B, T)
    if attention_mask is not None:
        alone = -1 - torch.arange(seg.shape[1], device=seg.device).expand_as(seg)  # (B, T)
        seg = torch.where(attention_mask.bool(), seg, alone)  # (B, T)
    if sparse and seg.is_cuda and flex_attention() is not None:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_segment(b, h, q, k):
            return (seg[b, q] == seg[b, k]) & (k <= q)
        B, T = seg.shape
        return create_block_mask(same_segment, B, None, T, T, device=seg.device)
    T = seg.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=seg.device).tril()  # (T, T)
    return (seg[:, None, :, None] == seg[:, None, None, :]) & causal  # (B, 1, T, T)
