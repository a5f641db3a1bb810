"""How a model is spread over devices: plain functions that take a model and return the wrapped
one, composed in order (activation checkpointing -> compile -> data parallel wrapper), the way
torchtitan's `parallelize` does. The training loop never asks which strategy it got; where
behaviour differs (skipping gradient sync on accumulation micro-steps) it calls a function here
that looks at the wrapped model.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager, Dict, Iterable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .dist import DistEnv
from .errors import ConfigError


def resolve_strategy(requested: str, env: DistEnv) -> tuple[str, str]:
    """(strategy, why). One process means `single` whatever was asked for several."""
    if requested == "dp":
        if env.device.type != "cuda":
            raise ConfigError("trainer.strategy=dp (nn.DataParallel) needs CUDA GPUs; on CPU use "
                              "trainer.strategy=ddp")
        raise ConfigError("trainer.strategy=dp is not available in this version; use ddp")
    if requested == "fsdp":
        raise ConfigError("trainer.strategy=fsdp is not available in this version; use ddp")
    if env.world_size == 1:
        why = "one process" if requested in ("auto", "single") else \
            f"{requested} asked for, but there is only one process"
        return "single", why
    if requested == "single":
        raise ConfigError(f"trainer.strategy=single runs one process, but {env.world_size} were "
                          "started; use trainer.strategy=ddp or one device")
    return "ddp", ("auto: several devices" if requested == "auto" else "asked for")


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (non-reentrant): activations of one block
    at a time instead of all of them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, checkpoint_wrapper)
    layers = _layers(model)
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: the blocks are identical, so one compiled graph is reused
    and the compile time stays that of one block."""
    layers = _layers(model)
    for i, block in enumerate(layers):
        layers[i] = torch.compile(block)


def apply_single(model: nn.Module, env: DistEnv) -> nn.Module:
    return model


def apply_ddp(model: nn.Module, env: DistEnv) -> nn.Module:
    # Our only buffers are constants (RoPE tables): broadcasting them every step is pure cost,
    # and a broadcast inside forward would deadlock evaluation on uneven shards.
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})  # torch < 2.12
    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
               gradient_as_bucket_view=True, **no_buffer_sync)


STRATEGIES: Dict[str, Callable[[nn.Module, DistEnv], nn.Module]] = {
    "single": apply_single,
    "ddp": apply_ddp,
}


def parallelize(model: nn.Module, strategy: str, env: DistEnv, *,
                activation_checkpointing: bool = False, compile: bool = False) -> nn.Module:
    model.to(env.device)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    return STRATEGIES[strategy](model, env)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside whatever wrapper a strategy put around it."""
    return model.module if isinstance(model, (DDP, nn.DataParallel)) else model


def no_grad_sync(model: nn.Module) -> ContextManager:
    """Accumulate gradients locally (no all-reduce) for the micro-steps before the last."""
    if isinstance(model, DDP):
        return model.no_sync()
    return contextlib.nullcontext()


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__} has no `layers` ModuleList to wrap block by "
                          "block")
    return layers


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for these tensors (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total
