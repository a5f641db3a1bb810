"""How a model is spread over devices: plain functions that take a model and return the wrapped
one, composed in order (activation checkpointing -> compile -> data parallel wrapper), the way
torchtitan's `parallelize` does. The training loop never asks which strategy it got; where
behaviour differs (skipping gradient sync on accumulation micro-steps) it calls a function here
that looks at the wrapped model.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from .dist import DistEnv
from .errors import ConfigError


def resolve_strategy(requested: str, env: DistEnv, *, cpu_offload: bool = False,
                     planned: Optional[tuple[str, str]] = None) -> tuple[str, str]:
    """(strategy, why). One process means `single` whatever was asked for several; `auto` takes
    the memory plan's pick when there is one (plan.py), else ddp."""
    if requested == "dp":
        if env.device.type != "cuda":
            raise ConfigError("trainer.strategy=dp (nn.DataParallel) needs CUDA GPUs; on CPU use "
                              "trainer.strategy=ddp")
        if env.world_size > 1 and env.local_world_size > 1:
            raise ConfigError("trainer.strategy=dp drives every GPU from one process; do not "
                              "start one process per GPU (no torchrun, one node)")
        return "dp", "asked for"
    if cpu_offload and requested not in ("fsdp", "auto"):
        raise ConfigError(f"trainer.cpu_offload=true needs trainer.strategy=fsdp (parameters are "
                          f"offloaded shard by shard), not {requested}")
    if env.world_size == 1:
        why = "one process" if requested in ("auto", "single") else \
            f"{requested} asked for, but there is only one process"
        return "single", why
    if requested == "single":
        raise ConfigError(f"trainer.strategy=single runs one process, but {env.world_size} were "
                          "started; use trainer.strategy=ddp or one device")
    if requested == "auto":
        if cpu_offload:
            return "fsdp", "auto: trainer.cpu_offload=true needs fsdp"
        return planned or ("ddp", "auto: several devices")
    return requested, "asked for"


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


def apply_ddp(model: nn.Module, env: DistEnv) -> nn.Module:
    # Our only buffers are constants (RoPE tables): broadcasting them every step is pure cost,
    # and a broadcast inside forward would deadlock evaluation on uneven shards.
    no_buffer_sync = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})  # torch < 2.12
    return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
               gradient_as_bucket_view=True, **no_buffer_sync)


def apply_fsdp(model: nn.Module, env: DistEnv, *, param_dtype: Optional[torch.dtype] = None,
               cpu_offload: bool = False, reshard_after_forward: bool = True,
               wrap: Sequence[type] = ()) -> nn.Module:
    """FSDP2: shard each transformer block (or each module of a `wrap` class), then the root.

    Sharding per block is what bounds memory: only one block's full parameters exist at a time
    in forward and backward. Gradients are reduced in fp32 even when compute runs in bf16/fp16,
    so the sum over ranks does not lose precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                   reduce_dtype=torch.float32)
    if cpu_offload:
        # pinned host memory makes the copies asynchronous; it needs an accelerator to exist
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    for module in _wrap_units(model, wrap):
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_dp(model: nn.Module, env: DistEnv) -> nn.Module:
    """nn.DataParallel over every visible GPU from one process, master copy on the first: kept
    to reproduce the classic DataParallel-vs-DDP comparison, not for real use."""
    return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())),
                           output_device=env.device)


def parallelize(model: nn.Module, strategy: str, env: DistEnv, *,
                activation_checkpointing: bool = False, compile: bool = False,
                precision: str = "fp32", cpu_offload: bool = False,
                reshard_after_forward: bool = True, wrap: Sequence[type] = ()) -> nn.Module:
    """Activation checkpointing -> compile -> the data-parallel wrapper, in that order (the
    wrapper must see the final modules)."""
    if not cpu_offload:
        model.to(env.device)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    if strategy == "fsdp":
        from .precision import fsdp_param_dtype
        return apply_fsdp(model, env, param_dtype=fsdp_param_dtype(precision),
                          cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
                          wrap=wrap)
    if strategy == "ddp":
        return apply_ddp(model, env)
    if strategy == "dp":
        return apply_dp(model, env)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside whatever wrapper a strategy put around it."""
    return model.module if isinstance(model, (DDP, nn.DataParallel)) else model


def is_fsdp(model: nn.Module) -> bool:
    return hasattr(model, "set_requires_gradient_sync")  # FSDP2 modules carry this method


@contextlib.contextmanager
def no_grad_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no all-reduce / reduce-scatter) for the micro-steps before
    the last one of an optimizer step."""
    if isinstance(model, DDP):
        with model.no_sync():
            yield
    elif is_fsdp(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _wrap_units(model: nn.Module, wrap: Sequence[type]) -> list[nn.Module]:
    """The modules FSDP shards one by one: instances of the `wrap` classes if given, else the
    transformer blocks (ours, or those a Hugging Face model names in `_no_split_modules`)."""
    if wrap:
        return [m for m in model.modules() if isinstance(m, tuple(wrap)) and m is not model]
    layers = _find_layers(model)
    return list(layers) if layers is not None else []


def _find_layers(model: nn.Module) -> Optional[nn.ModuleList]:
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    names = set(getattr(model, "_no_split_modules", None) or ())
    for m in model.modules():  # Hugging Face: model.model.layers, model.transformer.h, ...
        if isinstance(m, nn.ModuleList) and len(m) and \
                all(type(b).__name__ in names for b in m):
            return m
    return None


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = _find_layers(model)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} has no list of blocks (a `layers` ModuleList) "
                          "for activation checkpointing or compile to wrap block by block")
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
