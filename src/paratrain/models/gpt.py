"""A GPT-2 style decoder, in the spirit of karpathy/minGPT: learned positions, LayerNorm with
biases, GELU MLP, head tied to the token embedding.

Same interface as Llama: blocks in `self.layers`, each with `forward(x, mask)`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..config.presets import ModelArgs
from .attention import WHOLE
from .llama import check_input, gpt2_init


class CausalSelfAttention(nn.Module):
    """Multi-head attention; q, k and v come out of one fused projection. The keys it sees are
    its `context`'s (models/attention.py)."""
    context = WHOLE

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.c_attn = nn.Linear(args.hidden_size, 3 * args.hidden_size)
        self.c_proj = nn.Linear(args.hidden_size, args.hidden_size)
        self.dropout = args.dropout

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        B, T = x.shape[:2]  # (B, T, C)
        # chunk, and heads counted from the output: under tensor parallelism a rank holds its
        # heads' rows of each of q, k and v (parallel/tensor.py shards c_attn in three strides)
        q, k, v = self.c_attn(x).chunk(3, dim=2)  # 3 x (B, T, H*D)
        D = self.head_dim
        q = q.view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        p = self.dropout if self.training else 0.0
        y = self.context.attend(q, k, v, mask, p)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.hidden_size, args.intermediate_size)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.attn = CausalSelfAttention(args)
        self.ln_2 = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.mlp = MLP(args)
        self.resid_dropout = nn.Dropout(args.dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # x: (B, T, C); mask: None (plain causal) or bool (B, 1, T, T), True = may attend
        x = x + self.resid_dropout(self.attn(self.ln_1(x), mask))
        x = x + self.resid_dropout(self.mlp(self.ln_2(x)))
        return x


class GPT(nn.Module):
    block_class = Block
    # what a pipeline's first stage holds besides blocks, and its last (parallel/pipeline.py)
    pipeline_input = ("wte", "wpe", "dropout")
    pipeline_output = ("ln_f", "lm_head")
    context = WHOLE  # which positions the tokens hold (models/attention.py)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.hidden_size)
        self.wpe = nn.Embedding(args.max_seq_length, args.hidden_size)
        self.dropout = nn.Dropout(args.dropout)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.ln_f = nn.LayerNorm(args.hidden_size, eps=args.norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), zero biases, unit LayerNorm gains; the residual projections
        (c_proj) get 1/sqrt(2 * num_layers) of the std so depth does not inflate the stream."""
        gpt2_init(self, self.args.num_layers, residual=("c_proj.weight",))

    def forward(self, idx: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As Llama's: position_ids (B, T) restart per packed example, attention stays inside."""
        mask = check_input(idx, attention_mask, self.args.max_seq_length, position_ids,
                           sparse=self.args.dropout == 0.0)
        x = self.embed(idx, position_ids)  # (B, T, C)
        for block in self.layers:
            x = block(x, mask)  # (B, T, C)
        return self.head(x)  # (B, T, V)

    def embed(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
        pos = self.context.positions(idx.shape[1], idx.device) if position_ids is None \
            else position_ids  # (T,), (B, T) or None: 0..T-1
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        return self.dropout(self.wte(idx) + self.wpe(pos))  # (B, T) -> (B, T, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, C) -> (B, T, V)
