"""What `paratrain plan`'s simulation (parallel/simulate.py) does about attention: the fused
kernel on the meta device, and context parallelism's rows (the layouts it proposes, the bytes
its gathers send, the line that proposes it when a sequence fits no other layout)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..formatting import human_bytes
from .memory_estimate import Choice, layout_keys
from .strategies import Parallelism, resolve_parallelism
from .traffic import gathered_element_bytes

META = torch.device("meta")


def context_traffic(args: Any, micro_batch: int, seq_length: int, dims: Any, gathers: int,
                    scatters: int, element_bytes: int) -> dict:
    """Bytes a CP rank sends per step: its K/V chunk to the C-1 others at each of `gathers`
    layer forwards (again when checkpointed blocks recompute) and their gradients back at each
    of `scatters` layer backwards (`element_bytes`: per element, times the micro-steps)."""
    chunk = 2 * micro_batch * (seq_length // dims.cp) * args.num_kv_heads // dims.tp \
        * args.head_dim * element_bytes  # (2, B, KV, T/C, D)
    per_layer = (dims.cp - 1) * chunk
    return {"all-gather": per_layer * gathers, "reduce-scatter": per_layer * scatters}


def context_costs(args: Any, work: Any, dims: Any, layers: int, checkpointing: bool,
                  micro_steps: int) -> tuple[dict, int]:
    """What context parallelism adds to a row of `layers` blocks of `work` (simulate.Workload):
    ({"cp": the bytes its gathers send per step, `context_traffic`}, the bytes of its causal
    mask when the blocks are recomputed, which outlives them: context.py keeps one per shard).
    ({}, 0) without it."""
    if dims.cp == 1:
        return {}, 0
    element = gathered_element_bytes(work.precision)
    sent = context_traffic(args, work.micro_batch, work.seq_length, dims,
                           layers * (2 if checkpointing else 1), layers, element * micro_steps)
    return {"cp": sent}, (work.seq_length ** 2 // dims.cp * element if checkpointing else 0)


def context_layouts(world: int, devices_per_node: int, seq_length: int,
                    reshard_after_forward: bool) -> list[tuple[Parallelism, bool, bool, int]]:
    """The context-parallel layouts `plan` proposes when a sequence fits no other: fsdp over
    every device, blocks recomputed, each sequence split over 2, 4, 8... of them (degrees that
    divide the world and cut the sequence into equal head-tail chunks)."""
    fsdp = resolve_parallelism("fsdp", world_size=world, device=META,
                               local_world_size=devices_per_node,
                               reshard_after_forward=reshard_after_forward)[0]
    degrees = [2 ** k for k in range(1, 7) if 2 ** k <= world
               and world % 2 ** k == 0 and seq_length % 2 ** (k + 1) == 0]
    return [(fsdp, True, False, cp) for cp in degrees]


def context_line(rows: Sequence[Any], budget: float, seq_length: int) -> str:
    """When no layout without context parallelism fits in `budget` on the device but one with
    it does: the first that fits, and the keys that train it."""
    on_device = [r for r in rows if not r.parallelism.offloads_to_host]
    if any(r.device_bytes <= budget for r in on_device if r.cp == 1):
        return ""
    fits = [r for r in on_device if r.cp > 1 and r.device_bytes <= budget]
    if not fits:
        return ""
    r = fits[0]
    keys = layout_keys(Choice(r.parallelism, r.activation_checkpointing, ""))
    return (f"a sequence of {seq_length} tokens fits no layout without context parallelism; "
            f"{r.label} fits ({human_bytes(r.device_bytes)} per device): {keys} "
            f"trainer.context_parallel={r.cp}")


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """On the meta device torch computes attention unfused, saving the (T, T) scores for
    backward; a GPU's flash attention (and the CPU's) keeps only the output and one number per
    row. For the duration, attention on meta tensors goes to the fused kernel, which the meta
    device can run. (Swapped module-wide, not by a dispatch mode: checkpointed blocks recompute
    their forward in autograd's own thread.)"""
    plain = nn.functional.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False):
        if query.device.type != "meta" or hasattr(query, "to_local"):
            return plain(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.size(-3) != query.size(-3):  # (B, KV, T, D) -> (B, H, T, D)
            rep = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(rep, dim=-3), value.repeat_interleave(rep, dim=-3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    nn.functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        nn.functional.scaled_dot_product_attention = plain
