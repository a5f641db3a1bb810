"""Decoder-only language models: Llama and GPT, built from a ModelArgs.

Both take `idx` (B, T) and an optional `attention_mask` (B, T) and return logits (B, T, V);
both keep their transformer blocks in `model.layers` and name the block type in
`model.block_class`, which is what FSDP wrapping and activation checkpointing need.

torch is imported lazily: the sizes (config/presets.py, re-exported here) and `flops_per_token`
are read by code that should not pay the second it takes to import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config.presets import PRESETS, ModelArgs, resolve_model_config
from .generate import generate

if TYPE_CHECKING:
    import torch.nn as nn

    from .gpt import GPT
    from .llama import Llama

__all__ = ["ModelArgs", "PRESETS", "resolve_model_config", "build_model", "generate",
           "torch_default_init", "count_params", "flops_per_token", "Llama", "GPT"]


def __getattr__(name: str) -> Any:
    """`models.Llama` and `models.GPT` import torch on first use."""
    if name in ("Llama", "GPT"):
        from . import gpt, llama
        return {"Llama": llama.Llama, "GPT": gpt.GPT}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(args: ModelArgs) -> "nn.Module":
    """A freshly initialized model on the current default device, in fp32."""
    from .gpt import GPT
    from .llama import Llama

    if args.arch == "llama":
        return Llama(args)
    if args.arch == "gpt":
        return GPT(args)
    raise ValueError(f"unknown arch {args.arch!r}")


def torch_default_init(model: "nn.Module") -> "nn.Module":
    """`model.init=torch`: each layer starts as torch builds it (nn.Linear's Kaiming-uniform,
    nn.Embedding's N(0, 1), norm gains 1), as in a script that writes the model with plain torch
    layers, instead of our GPT-2 init. Later modules first, so that a head tied to the embedding
    keeps the embedding's init, as a script that ties them after building both does."""
    for module in reversed(list(model.modules())):
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def count_params(model: "nn.Module") -> int:
    """Parameters counted once each: a tied head shares the embedding and is not counted twice.
    (On an FSDP-sharded model this counts the local shard; count before wrapping.)"""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / nanoGPT estimate:

        6 * N  +  12 * L * H * Q * T

    N: the parameters that take part in a matmul per token, i.e. the attention and MLP weights
    of every block plus the lm head (V * C). The token (and position) embedding lookups are
    free and norms and biases are negligible, so they are left out. The 6 is 2 FLOPs per
    multiply-add times 3 (forward, and twice that for the backward).
    12 * L * H * Q * T: the attention scores q·k and the weighted sum of v, which have no
    parameters: 2 matmuls * 2 FLOPs * 3 (fwd + bwd) * L layers * H heads * Q head_dim * T
    context. Causal masking is not discounted (as in PaLM), so MFU is comparable across
    implementations. GQA shares k/v heads but not the score matmuls, so H is num_heads.
    Divide by (step time * peak FLOP/s) per token processed to get MFU.
    """
    C, L, I, V = args.hidden_size, args.num_layers, args.intermediate_size, args.vocab_size
    kv = args.num_kv_heads * args.head_dim
    attn = C * C + 2 * C * kv + C * C  # wq, wk, wv, wo (gpt: c_attn + c_proj, same count)
    mlp = (3 if args.arch == "llama" else 2) * C * I  # SwiGLU has three matrices, GELU two
    n_matmul = L * (attn + mlp) + V * C
    return 6.0 * n_matmul + 12.0 * L * args.num_heads * args.head_dim * seq_len
