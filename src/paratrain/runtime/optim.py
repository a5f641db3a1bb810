"""The optimizer (AdamW by default, with decay on matrices only) and the learning-rate schedule:
a linear warmup, then cosine, linear, constant or warmup-stable-decay down to a floor.

The schedule is one function of the step, `lr_at`, that a LambdaLR follows (a Stateful object a
snapshot saves); each shape is written the way Hugging Face's `get_*_schedule_with_warmup` and
torch's `LinearLR` write it, so a port of a script using them can match its curve exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config.sections import OptimConfig
from ..errors import ConfigError


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Weight decay shrinks matrices (embeddings, projections); decaying gains and biases only
    fights the normalisation layers, so 1-d parameters get none, unless
    `optim.decay_norms_and_biases` (what `AdamW(model.parameters(), weight_decay=...)` does)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_norms_and_biases:
        return [{"params": params, "weight_decay": cfg.weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    device: torch.device) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer over the trainable parameters. adamw: fused on CUDA (its fast
    path), foreach elsewhere, unless `optim.fused` says; adafactor: torch's (factored second
    moments: a fraction of AdamW's state); adamw-8bit: bitsandbytes' AdamW8bit (uint8 moments
    for tensors of 4096+ values; CUDA or CPU)."""
    groups = param_groups(model, cfg)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        fused = device.type == "cuda" if cfg.fused is None else cfg.fused
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps,
                                 fused=fused or None)
    if cfg.name == "adafactor":
        return torch.optim.Adafactor(groups, lr=cfg.lr, foreach=True)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("optim.name=adamw-8bit needs the bitsandbytes package: pip "
                              "install bitsandbytes") from None
        return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optim.name={cfg.name!r} is not a known optimizer")


def warmup_steps(cfg: OptimConfig, total_steps: int) -> int:
    """W: optim.warmup_ratio of the run's steps (rounded up, as HF does) when set, else
    optim.warmup_steps."""
    if cfg.warmup_ratio is not None:
        return math.ceil(cfg.warmup_ratio * total_steps)
    return cfg.warmup_steps


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps` (T), W warmup steps.

    Warmup (step < W): with `warmup_start_factor` f, lr x (f + (1 - f) x step / W), torch's
    LinearLR (f = 0: HF Trainer's, whose first step has lr 0); unset, lr x (step + 1) / W.
    Then, with p = (step - W) / (T - W) and the floor m = min_lr (lr / 10 when unset):
    cosine m + (lr - m)(1 + cos(pi p)) / 2; linear m + (lr - m)(1 - p); constant lr; wsd lr
    until the last decay_ratio x T steps, then a cosine from lr to m over them (HF's
    warmup_stable_decay with its default cosine decay)."""
    W, lr, floor = warmup_steps(cfg, total_steps), cfg.lr, cfg.floor_lr
    if W and step < W:
        f = cfg.warmup_start_factor
        return lr * (step + 1) / W if f is None else lr * (f + (1.0 - f) * step / W)
    if cfg.schedule == "constant":
        return lr
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_ratio * total_steps))
        start = max(W, total_steps - decay)
        if step < start:
            return lr
        progress = min(1.0, (step - start) / max(1, total_steps - start))
        return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))
    progress = min(1.0, (step - W) / max(1, total_steps - W))
    if cfg.schedule == "linear":
        return floor + (lr - floor) * (1.0 - progress)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    # LambdaLR multiplies the base lr; it is a Stateful object a snapshot can save.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg, total_steps) / cfg.lr)


def schedule_warnings(cfg: OptimConfig, total_steps: int) -> list[str]:
    """Lines worth a warning before the first step: a warmup that never ends."""
    W = warmup_steps(cfg, total_steps)
    if W >= total_steps > 0:
        return [f"warning: the warmup ({W} steps) is as long as the run ({total_steps} steps): "
                "the learning rate never reaches optim.lr; lower optim.warmup_steps (or set "
                "optim.warmup_ratio, e.g. 0.05)"]
    return []
