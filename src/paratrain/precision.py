"""`trainer.precision`: which dtype the matmuls run in, and the gradient scaler fp16 needs."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from .errors import ConfigError

_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
           "bf16-true": torch.bfloat16}


def check_precision(precision: str, device: torch.device) -> None:
    if precision.startswith("bf16") and device.type == "cuda" \
            and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"trainer.precision={precision}: {torch.cuda.get_device_name(device)} "
                          "has no bfloat16; use fp16-mixed or fp32")


def prepare_model(model: nn.Module, precision: str) -> nn.Module:
    """bf16-true keeps the weights themselves in bfloat16 (half the memory, no fp32 master)."""
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    return model


def fsdp_param_dtype(precision: str) -> Optional[torch.dtype]:
    """Under FSDP, mixed precision is FSDP's own policy (parameters all-gathered in half
    precision), not autocast."""
    return _DTYPES[precision] if precision in ("bf16-mixed", "fp16-mixed") else None


def autocast(precision: str, device: torch.device, fsdp: bool = False) -> ContextManager:
    if precision in ("bf16-mixed", "fp16-mixed") and not fsdp:
        return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])
    return contextlib.nullcontext()


def grad_scaler(precision: str, device: torch.device, fsdp: bool = False) -> Optional[Any]:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none.
    Under FSDP each rank holds a shard of the gradients, so the inf/nan check must be agreed
    across ranks: the sharded scaler does that."""
    if precision != "fp16-mixed":
        return None
    if fsdp:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)
