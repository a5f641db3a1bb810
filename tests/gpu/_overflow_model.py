"""A user model whose fp16 gradients overflow under torch's initial grad scale (2**16): its loss
is 1e4 x the sum of a Linear's outputs, so d(loss)/d(output) x scale is far past fp16's 65504
until the scaler has halved the scale enough times. Importable by name (Trainer pickles the
factory), deterministic (its own seed), and fed the same sample every step, so a skipped step
leaves the logged loss exactly as it was."""

from __future__ import annotations

import torch
from torch import nn

FEATURES = 16


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, FEATURES)


def same_sample_dataset(n: int = 64) -> list[torch.Tensor]:
    x = torch.full((FEATURES,), 0.01)  # small inputs: the weight gradients stay finite sooner
    return [x.clone() for _ in range(n)]


def huge_loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return 1e4 * out.float().sum(dim=-1).mean()
