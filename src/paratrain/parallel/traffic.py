"""Bytes each device sends per optimizer step, per collective and mesh dimension, for `paratrain
plan`'s simulation (simulate.py). The tensor-parallel collectives are counted as the meta forward
and backward dispatch them (`sent_bytes` per call); FSDP's all-gathers and reduce-scatters and the
replicas' all-reduces follow from rank 0's shard sizes (`data_parallel_traffic`). Ring algorithms:
an all-gather or reduce-scatter sends (n-1)/n of the full tensor, an all-reduce twice that."""

from __future__ import annotations

import torch

from .precision import mixed_dtype
from .strategies import Parallelism

# the functional collectives DTensor dispatches, by the name a plan's table gives them
COLLECTIVES = {"all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
               "all_reduce": "all-reduce"}


def sent_bytes(name: str, tensor: torch.Tensor, n: int) -> int:
    """Bytes one rank sends in a ring collective over n ranks, given the tensor it passes in."""
    size = tensor.numel() * tensor.element_size()
    if name == "all-gather":  # its own shard to each of the others
        return (n - 1) * size
    if name == "reduce-scatter":  # (n - 1) / n of the full input
        return (n - 1) * size // n
    return 2 * (n - 1) * size // n  # all-reduce: a reduce-scatter, then an all-gather


def gathered_element_bytes(precision: str) -> int:
    """Bytes of one element as FSDP gathers it (the compute dtype)."""
    dtype = mixed_dtype(precision) or (torch.bfloat16 if precision == "bf16-true"
                                       else torch.float32)
    return torch.empty((), dtype=dtype).element_size()


def data_parallel_traffic(parallelism: Parallelism, state: dict, world: int, accum: int,
                          precision: str, reshard_after_forward: bool) -> dict:
    """{mesh dimension: {collective: bytes}} per optimizer step of the data-parallel part, from
    rank 0's shard sizes: FSDP gathers every unit in each micro-step's forward, and the blocks
    again in backward when it frees them after forward (the root it keeps); gradients are
    reduce-scattered once per step (accumulation skips the sync), in fp32 under mixed
    precision, then all-reduced across replicas (HSDP's, or DDP's whole gradients)."""
    dims = parallelism.layout(world)
    # a CP group's ranks sum their gradients as data-parallel ones do (a pipeline's sizes hold
    # its stages' CP groups): with the shards (dp_shard x cp) when its stages shard, else with
    # the replicas; the other layouts' rows give their presets' sizes, cp inside them
    sharded = getattr(parallelism, "stage_parallelism", parallelism).sharded
    shards = dims.dp_shard * (dims.cp if sharded else 1)
    replicas = dims.dp_replicate * (1 if sharded else dims.cp)
    numel, root = int(state["numel"]), int(state["root_numel"])
    gather, grad = gathered_element_bytes(precision), 2 if precision == "bf16-true" else 4
    out: dict = {}
    if shards > 1:
        n = shards
        regathered = numel - root if reshard_after_forward else 0
        out["dp_shard"] = {"all-gather": (n - 1) * (numel + regathered) * gather * accum,
                           "reduce-scatter": (n - 1) * numel * grad}
    if replicas > 1:
        n = replicas
        out["dp_replicate"] = {"all-reduce": 2 * (n - 1) * numel * grad // n}
    return out
