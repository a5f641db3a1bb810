"""One `parallelize` for every layout: the run's dimensions applied to a model in a fixed order
(torchtitan's): tensor parallelism -> context parallelism -> activation checkpointing ->
compile -> the data-parallel wrapper (FSDP / HSDP, or DDP) that the parallelism object names.
Each step sees the modules the one before made, the wrapper the final ones; each dimension runs
on its named slice of the run's one DeviceMesh (parallel/dims.py). A new dimension that splits
the model is one step here (`_split`)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..dist import DistEnv
from .blocks import block_lists, shard_units
from .context import apply_context_parallel
from .dims import ParallelDims
from .strategies import Parallelism
from .tensor import split_tensor_parallel


def parallelize(model: nn.Module, parallelism: Parallelism, env: DistEnv, *, precision: str,
                activation_checkpointing: bool = False, compile: bool = False,
                wrap: Sequence[type] = (), mesh: Any = None,
                dims: Optional[ParallelDims] = None) -> nn.Module:
    """Each dimension of `dims` applied in a fixed order (torchtitan's): tensor parallelism ->
    context parallelism -> activation checkpointing -> compile -> the data-parallel wrapper
    (FSDP / HSDP, or DDP) that `parallelism` names; each step must see the modules the one
    before made, and the wrapper the final ones. Every step takes its dimensions from one mesh,
    built here from `dims` (`run_mesh`) or given (`mesh`: a pipeline's, whose stages slice
    theirs from it by name). `dims`: the run's sizes (default: the parallelism's own preset for
    this world)."""
    dims = parallelism.layout(env.world_size) if dims is None else dims
    if not parallelism.offloads_to_host:
        model.to(env.device)
    mesh = run_mesh(parallelism, dims, env) if mesh is None else mesh
    _split(model, dims, mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model)
    return parallelism.wrap(model, env, precision=precision, units=shard_units(model, wrap),
                            mesh=parallelism.data_mesh(mesh, dims) if mesh is not None else None)


def run_mesh(parallelism: Parallelism, dims: ParallelDims, env: DistEnv) -> Any:
    """The run's one DeviceMesh (dims.`build_mesh`), when a step needs one: the sharding wrappers
    (FSDP / HSDP, FSDP2 under TP) span its data-parallel dimensions, TP and CP their own; None
    for a replica (single, DDP, nn.DataParallel) that splits nothing. Collective."""
    if env.world_size == 1 or not (parallelism.sharded or dims.tp > 1 or dims.cp > 1):
        return None
    return dims.build_mesh(env.device.type)


def _split(model: nn.Module, dims: ParallelDims, mesh: Any) -> None:
    """The dimensions that split the model itself, each on its dimension of the run's one mesh:
    TP, then CP."""
    if dims.tp > 1:
        split_tensor_parallel(model, mesh["tp"])
    if dims.cp > 1:
        apply_context_parallel(model, mesh["cp"])


def parallelize_frozen(model: nn.Module, parallelism: Parallelism, env: DistEnv, *,
                       precision: str, wrap: Sequence[type] = (),
                       dims: Optional[ParallelDims] = None) -> nn.Module:
    """A model the task runs without training it: no gradients, evaluation mode, placed,
    split by tensor parallelism and (for sharding strategies) sharded as the trained model, on
    a mesh of the run's sizes (`dims`, default: the parallelism's preset)."""
    model.requires_grad_(False)
    model.eval()
    if not parallelism.offloads_to_host:
        model.to(env.device)
    dims = parallelism.layout(env.world_size) if dims is None else dims
    mesh = run_mesh(parallelism, dims, env)
    if dims.tp > 1:  # (context parallelism is the loop's: a frozen model runs whole sequences)
        split_tensor_parallel(model, mesh["tp"])
    return parallelism.wrap_frozen(model, env, precision=precision,
                                   units=shard_units(model, wrap),
                                   mesh=parallelism.data_mesh(mesh, dims) if mesh is not None
                                   else None)


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every transformer block in backward (non-reentrant): activations of one block
    at a time instead of all of them."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as ac
    for layers in block_lists(model):  # a list, or a pipeline stage's dict (pipeline.py)
        for i, block in layers.named_children():
            layers.register_module(i, ac.checkpoint_wrapper(
                block, checkpoint_impl=ac.CheckpointImpl.NO_REENTRANT))


def apply_compile(model: nn.Module) -> None:
    """Compile each block separately: the blocks are identical, so one compiled graph is reused
    and the compile time stays that of one block."""
    for layers in block_lists(model):
        for i, block in layers.named_children():
            layers.register_module(i, torch.compile(block))
