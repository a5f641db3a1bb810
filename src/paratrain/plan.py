"""Memory per device before anything runs: what each strategy would hold, and what `auto` picks.

State (parameters, gradients, AdamW moments) is counted exactly from the parameter shapes of the
model built on the meta device, sharded the way FSDP2 shards (dim 0, split evenly, the first ranks
taking the remainder). Activations are measured, not guessed: one forward of a single sample on the
CPU counts the bytes autograd saves for backward (the same meter the training loop uses), times
the micro-batch. That keeps the plan right for any architecture, ours or a user's.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch
from torch import nn

from .metrics import SavedTensorMeter

PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16-true": 2}
AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.bfloat16, "bf16-true": None}
MARGIN = 0.8  # plan to use at most this fraction of a device


@dataclass(frozen=True)
class Estimate:
    strategy: str  # single | ddp | fsdp | fsdp+ac | fsdp+offload
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    device_bytes: int  # what must fit on the device at the peak of a step

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {**asdict(self), "state_bytes": self.state_bytes}


def shard_numel(shape: torch.Size, world: int, rank: int = 0) -> int:
    """Elements FSDP2 gives `rank` of a parameter of this shape (rank 0 holds the most)."""
    if not shape:
        return 1 if rank == 0 else 0
    rows = shape[0]
    per = math.ceil(rows / world)
    mine = max(0, min(per, rows - rank * per))
    return mine * math.prod(shape[1:])


def state_bytes(params: List[torch.Size], world: int, precision: str,
                sharded: bool) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on rank 0. AdamW keeps two moments per element in the
    parameter's dtype plus a 4-byte step counter per tensor."""
    width = PARAM_BYTES[precision]
    numel = sum(shard_numel(s, world) if sharded else math.prod(s) for s in params)
    return numel * width, numel * width, 2 * numel * width + 4 * len(params)


def activation_bytes_per_sample(factory: Callable[[], nn.Module], seq_length: int,
                                vocab_size: int, precision: str, checkpointing: bool) -> int:
    """Bytes saved for backward by one sample's forward (and loss), measured on the CPU."""
    from .strategies import apply_activation_checkpointing
    torch.manual_seed(0)
    model = factory()
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    if checkpointing:
        apply_activation_checkpointing(model)
    idx = torch.randint(0, vocab_size, (1, seq_length))  # (1, T)
    dtype = AUTOCAST.get(precision)
    amp = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with SavedTensorMeter(model) as meter, amp:
        logits = model(idx)  # (1, T, V)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
    return meter.bytes


def estimate(factory: Callable[[], nn.Module], *, world: int, precision: str, micro_batch: int,
             seq_length: int, vocab_size: int) -> List[Estimate]:
    """Every strategy's bytes per device at this world size (rank 0, the fullest)."""
    with torch.device("meta"):
        meta = factory()
    shapes = [p.shape for p in meta.parameters()]
    blocks = getattr(meta, "layers", None)
    biggest_block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0) \
        if isinstance(blocks, nn.ModuleList) else 0
    act = micro_batch * activation_bytes_per_sample(factory, seq_length, vocab_size, precision,
                                                    checkpointing=False)
    act_ac = micro_batch * activation_bytes_per_sample(factory, seq_length, vocab_size,
                                                       precision, checkpointing=True)
    width = PARAM_BYTES[precision]
    gathered = 2 * biggest_block * width  # FSDP: this block's and the prefetched one's full params
    rows = []
    full = state_bytes(shapes, world, precision, sharded=False)
    shard = state_bytes(shapes, world, precision, sharded=True)
    rows.append(Estimate("single" if world == 1 else "ddp", *full, act, sum(full) + act))
    if world > 1:
        rows.append(Estimate("fsdp", *shard, act, sum(shard) + act + gathered))
        rows.append(Estimate("fsdp+ac", *shard, act_ac, sum(shard) + act_ac + gathered))
        rows.append(Estimate("fsdp+offload", *shard, act_ac, act_ac + gathered))
    return rows


def choose(rows: List[Estimate], capacity: int) -> tuple[str, str]:
    """The first strategy, in order of speed, whose peak fits in MARGIN of the device."""
    budget = int(capacity * MARGIN)
    for r in rows:
        if r.device_bytes <= budget:
            return r.strategy, (f"auto: {r.strategy} needs {_gb(r.device_bytes)} of "
                                f"{_gb(capacity)} per device")
    last = rows[-1]
    return last.strategy, (f"auto: nothing fits in {_gb(capacity)} per device (smallest: "
                           f"{last.strategy} at {_gb(last.device_bytes)}); trying {last.strategy}")


def device_capacity(device: torch.device, local_workers: int) -> int:
    """GPU memory of the device; on CPU, the available RAM shared by this node's workers."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].strip().split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        avail = 8 * 2**30
    return avail // max(1, local_workers)


def format_plan(rows: List[Estimate], capacity: int, pick: tuple[str, str]) -> str:
    head = (f"{'strategy':<14}{'params':>10}{'grads':>10}{'optimizer':>11}{'activations':>13}"
            f"{'per device':>12}  fits")
    lines = [head]
    for r in rows:
        fits = "yes" if r.device_bytes <= capacity * MARGIN else "no"
        lines.append(f"{r.strategy:<14}{_gb(r.params_bytes):>10}{_gb(r.grads_bytes):>10}"
                     f"{_gb(r.optimizer_bytes):>11}{_gb(r.activation_bytes):>13}"
                     f"{_gb(r.device_bytes):>12}  {fits}")
    lines.append(f"device capacity {_gb(capacity)} (planning to {int(MARGIN * 100)}%); "
                 f"auto picks {pick[0]} ({pick[1]})")
    return "\n".join(lines)


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.1f}M"


def plan_for_config(cfg, world: Optional[int] = None, device: Optional[torch.device] = None,
                    local_workers: Optional[int] = None):
    """(rows, capacity, pick) for a TrainConfig: what `paratrain plan` prints."""
    from .launch import parse_devices
    from .models import build_model, resolve_model_config
    devices = parse_devices(cfg.trainer.devices)
    world = world or len(devices) * cfg.distributed.nnodes
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    args = resolve_model_config(cfg.model, vocab_size=vocab, seq_length=cfg.data.seq_length)
    rows = estimate(lambda: build_model(args), world=world, precision=cfg.trainer.precision,
                    micro_batch=cfg.trainer.batch_size, seq_length=cfg.data.seq_length,
                    vocab_size=vocab)
    capacity = device_capacity(device or devices[0], local_workers or len(devices))
    return rows, capacity, choose(rows, capacity)
