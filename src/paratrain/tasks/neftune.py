"""NEFTune (Jain et al. 2023; trainer.neftune_noise_alpha): uniform noise on the input embeddings
while training, in +-alpha / sqrt(L x C) for a sequence of L tokens of C dimensions.

Padded batches: as HF Trainer adds it (transformers' neftune_post_forward_hook), L the padded
length of the batch (`neftune_noise`). Packed rows (data.pack=true) hold several examples, and the
row's length would shrink every example's noise by how many share its row; there each token's
bound uses its own example's length (`PackedNEFTune`), read from the position ids that restart
at 0 for each example: the bound an example padded alone would get.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def neftune_noise(alpha: float, module: nn.Module, inputs: Any, output: Any) -> Any:
    """The embeddings' forward hook: while training, uniform noise in +-alpha / sqrt(T x C) on
    the input embeddings (B, T, C), T the padded length."""
    if not module.training:
        return output
    bound = alpha / math.sqrt(output.size(1) * output.size(2))
    return output + torch.zeros_like(output).uniform_(-bound, bound)  # (B, T, C)


def example_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids restarting at 0 per example -> (B, T) each token's example length
    (the pads at a row's end form a piece of their own)."""
    B, T = position_ids.shape
    piece = (position_ids == 0).long().cumsum(-1)  # (B, T) 1.. per row
    flat = piece + torch.arange(B, device=piece.device)[:, None] * (T + 1)  # (B, T) unique ids
    counts = torch.bincount(flat.flatten(), minlength=B * (T + 1))  # (B*(T+1),)
    return counts[flat]  # (B, T)


class PackedNEFTune:
    """NEFTune on packed rows: `attach` hooks the model's decoder (whose forward receives the
    position ids) to read each token's example length, and the input embeddings to add noise
    bounded by it; a forward without position ids gets the padded bound."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.lengths: Optional[torch.Tensor] = None  # (B, T) of the forward under way

    def attach(self, body: nn.Module, embeddings: nn.Module) -> None:
        body.register_forward_pre_hook(self.read_positions, with_kwargs=True)
        embeddings.register_forward_hook(self.add_noise)

    def read_positions(self, module: nn.Module, args: Any, kwargs: dict) -> None:
        positions = kwargs.get("position_ids")
        self.lengths = example_lengths(positions) if positions is not None else None

    def add_noise(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        lengths = self.lengths
        if lengths is None or lengths.shape != output.shape[:2]:
            return neftune_noise(self.alpha, module, inputs, output)
        if not module.training:
            return output
        bound = self.alpha / (lengths[..., None].to(output.dtype) * output.size(2)).sqrt()
        return output + torch.zeros_like(output).uniform_(-1.0, 1.0) * bound  # (B, T, C)
