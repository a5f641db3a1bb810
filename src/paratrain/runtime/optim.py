"""AdamW with decay on matrices only, and linear warmup then cosine decay to a floor."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay shrinks matrices (embeddings, projections); decaying gains and biases only
    fights the normalisation layers, so 1-d parameters get none."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    # fused AdamW is the fast path on CUDA; foreach (the default elsewhere) on CPU.
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                             fused=fused or None)


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup from lr/warmup to lr, then a
    half cosine from lr down to min_lr at the last step."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR multiplies the base lr; it is a Stateful object a snapshot can save.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)
