"""`trainer.precision`: which dtype the matmuls run in. How a parallelism applies it (autocast, or
FSDP's own mixed-precision policy) and which gradient scaler it needs live in parallel.py."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError

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


def mixed_dtype(precision: str) -> Optional[torch.dtype]:
    """The half-precision dtype of the mixed precisions (autocast's, or FSDP's parameter dtype);
    None for fp32 and bf16-true."""
    return _DTYPES[precision] if precision in ("bf16-mixed", "fp16-mixed") else None
