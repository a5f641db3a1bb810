"""Memory per device before anything runs: what each strategy would hold, and what `auto` picks.

State (parameters, gradients, AdamW moments) is counted exactly from the parameter shapes of the
model built on the meta device, sharded the way FSDP2 shards (dim 0, split evenly, the first ranks
taking the remainder). Activations are measured, not guessed (activations.py): one forward of a
single sample on the CPU counts the bytes autograd saves for backward (the same meter the training
loop uses), times the micro-batch, with autocast's weight copies once. That keeps the estimate
right for any architecture, ours or a user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional

import torch
from torch import nn

from ..formatting import human_bytes
from .activations import SavedBytes, cpu_model, saved_bytes, activation_bytes_per_sample
from .strategies import DDP, FSDP, HSDP, Parallelism

PARAM_BYTES = {"fp32": 4, "bf16-mixed": 4, "fp16-mixed": 4, "bf16-true": 2}
MARGIN = 0.8  # count on at most this fraction of a device
# On a GPU a step also holds what no tensor count sees: cuBLAS's workspaces (allocated through
# torch's caching allocator, one per handle and stream) and backward's short-lived buffers. A
# 280M Llama's measured peak on an H100 was 102 MiB over its counted tensors.
CUDA_WORKSPACE_BYTES = 96 * 2**20


@dataclass(frozen=True)
class Estimate:
    """One row of the estimate: a parallelism (and whether blocks are recomputed) and its bytes on
    rank 0, the fullest."""
    parallelism: Parallelism
    activation_checkpointing: bool
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    device_bytes: int  # what must fit on the device at the peak of a step
    frozen_bytes: int = 0  # models a task runs but does not train (parameters only)
    cache_bytes: int = 0  # online RL's generation KV cache, freed before the activations
    cache_note: str = ""  # how cache_bytes is counted

    @property
    def label(self) -> str:
        return candidate_label(self.parallelism, self.activation_checkpointing)

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    def to_dict(self) -> dict:
        return {"strategy": self.label, "params_bytes": self.params_bytes,
                "grads_bytes": self.grads_bytes, "optimizer_bytes": self.optimizer_bytes,
                "activation_bytes": self.activation_bytes, "device_bytes": self.device_bytes,
                "state_bytes": self.state_bytes, "frozen_bytes": self.frozen_bytes,
                "cache_bytes": self.cache_bytes}


@dataclass(frozen=True)
class Choice:
    """What `auto` picked from the estimate, and why (logged and in summary.json)."""
    parallelism: Parallelism
    activation_checkpointing: bool
    why: str

    @property
    def label(self) -> str:
        return candidate_label(self.parallelism, self.activation_checkpointing)


def candidate_label(parallelism: Parallelism, activation_checkpointing: bool) -> str:
    """ddp, fsdp, fsdp+ac, fsdp+offload (offloading implies recomputing)."""
    recompute = activation_checkpointing and not parallelism.offloads_to_host
    return parallelism.label + ("+ac" if recompute else "")


def state_bytes(params: List[torch.Size], parallelism: Parallelism, world: int,
                precision: str, trainable: Optional[List[torch.Size]] = None
                ) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes on rank 0. AdamW keeps two moments per element in the
    parameter's dtype plus a 4-byte step counter per tensor; only `trainable` parameters (all,
    when not given; LoRA's adapters) have gradients and optimizer state."""
    width = PARAM_BYTES[precision]
    trainable = params if trainable is None else trainable
    numel = sum(parallelism.state_numel(s, world) for s in params)
    tuned = sum(parallelism.state_numel(s, world) for s in trainable)
    return numel * width, tuned * width, 2 * tuned * width + 4 * len(trainable)


def estimate(factory: Callable[[], nn.Module], *, world: int, precision: str, micro_batch: int,
             seq_length: int, vocab_size: int, reshard_after_forward: bool = True,
             shard_group_size: Optional[int] = None,
             frozen_factory: Optional[Callable[[], dict[str, nn.Module]]] = None,
             cache: Any = None, accumulation: int = 1, workspace: int = 0,
             shallow: Optional[tuple[Callable[[int], nn.Module], int]] = None
             ) -> List[Estimate]:
    """Every candidate's bytes per device at this world size (rank 0, the fullest), in order of
    speed: replicate, shard within a node and replicate across nodes (hsdp, when
    `shard_group_size`, the processes of one node or the override, is more than one and less
    than the world), shard over all, shard and recompute, shard and offload. `frozen_factory`:
    the models a task runs without training them, held (and sharded) like the trained one's
    parameters, with no gradients or optimizer state. `cache`: online RL's generation cache
    (tasks/rl/memory.GenerationCache) for `micro_batch` prompts, on every device whatever the
    layout; it is freed before the training forward, so the peak holds the larger of it and the
    activations. `accumulation`: micro-batches per optimizer step (gradients outlive a forward
    when more than one). `workspace`: the device's own working bytes (`device_workspace`).
    `shallow`: activations from the model cut to 1 and 2 blocks (MemoryProbe.shallow)."""
    with torch.device("meta"):
        meta = factory()
        frozen = [p.shape for m in (frozen_factory() if frozen_factory else {}).values()
                  for p in m.parameters()]
    shapes = [p.shape for p in meta.parameters()]
    trainable = [p.shape for p in meta.parameters() if p.requires_grad]
    blocks = getattr(meta, "layers", None)
    biggest_block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0) \
        if isinstance(blocks, nn.ModuleList) else 0
    saved = activation_bytes_per_sample(factory, seq_length, vocab_size, precision,
                                        checkpointing=False, shallow=shallow)
    saved_ac = activation_bytes_per_sample(factory, seq_length, vocab_size, precision,
                                           checkpointing=True, shallow=shallow)
    gathered = 2 * biggest_block * PARAM_BYTES[precision]  # FSDP: this block's and the next's
    cached = cache.bytes(micro_batch) if cache is not None else 0
    note = cache.describe(micro_batch) if cache is not None else ""

    def row(parallelism: Parallelism, checkpointing: bool, saved: SavedBytes,
            on_device: bool = True) -> Estimate:
        activations = saved.of_batch(micro_batch, parallelism.sharded)
        parts = state_bytes(shapes, parallelism, world, precision, trainable)
        held = sum(parallelism.state_numel(s, world) for s in frozen) * PARAM_BYTES[precision]
        working = max(activations, cached) + (gathered if parallelism.sharded else 0)
        if world == 1 and accumulation == 1:
            # one process stepping after each micro-batch sets its gradients to None before the
            # next forward, and backward frees activations as the gradients grow: the peak holds
            # the larger. DDP's gradients live on in its buckets, and accumulation keeps them
            # over the next forward: there both add up.
            working = max(working, parts[1]) - parts[1]
        peak = workspace + working + (sum(parts) + held if on_device else 0)
        return Estimate(parallelism, checkpointing, *parts, activations, peak, held, cached,
                        note)

    rows = [row(Parallelism() if world == 1 else DDP(), False, saved)]
    group = shard_group_size or world
    if 1 < group < world and world % group == 0:
        rows.append(row(HSDP(reshard_after_forward=reshard_after_forward,
                             shard_group_size=group), False, saved))
    if world > 1:
        fsdp = FSDP(reshard_after_forward=reshard_after_forward)
        rows.append(row(fsdp, False, saved))
        rows.append(row(fsdp, True, saved_ac))
        rows.append(row(FSDP(cpu_offload=True, reshard_after_forward=reshard_after_forward),
                        True, saved_ac, on_device=False))
    return rows


def choose(rows: List[Estimate], capacity: int,
           pipelines: Optional[Callable[[], Iterable[Estimate]]] = None) -> Choice:
    """The first candidate, in order of speed, whose peak fits in MARGIN of the device.
    `pipelines`: auto's pipelines, smallest first (measured only when asked for): tried when no
    layout that keeps its state on the device fits, before offloading it to the host, so auto
    picks one only when it is the only layout on the device that fits."""
    budget = int(capacity * MARGIN)
    on_device = [r for r in rows if not r.parallelism.offloads_to_host]
    offloaded = [r for r in rows if r.parallelism.offloads_to_host]
    for r in on_device:
        if r.device_bytes <= budget:
            return _picked(r, capacity)
    smallest = min(on_device, key=lambda r: r.device_bytes)
    for r in pipelines() if pipelines is not None else ():
        if r.device_bytes <= budget:
            p = r.parallelism
            return _picked(r, capacity, f", the only layout on the device that fits "
                                        f"({smallest.label}, the smallest without a pipeline, "
                                        f"needs {human_bytes(smallest.device_bytes)}; "
                                        f"{p.schedule}, blocks per stage {list(p.split)})")
    for r in offloaded:
        if r.device_bytes <= budget:
            return _picked(r, capacity)
    last = rows[-1]
    return Choice(last.parallelism, last.activation_checkpointing,
                  f"auto: nothing fits in {human_bytes(capacity)} per device (smallest: "
                  f"{last.label} at {human_bytes(last.device_bytes)}); trying {last.label}")


def _picked(row: Estimate, capacity: int, more: str = "") -> Choice:
    return Choice(row.parallelism, row.activation_checkpointing,
                  f"auto: {row.label} needs {human_bytes(row.device_bytes)} of "
                  f"{human_bytes(capacity)} per device{more}")


def pipeline_estimate(factory: Callable[[], nn.Module], pipeline: Any, *, precision: str,
                      micro_batch: int, micro_batches: int, seq_length: int,
                      vocab_size: int) -> Estimate:
    """A pipeline's row (parallel/pipeline.py's PipelineParallel) for its fullest process over
    the pipeline's ranks: the state of the part of the model it holds (the embedding with the
    first stage, the head with the last), and that part's activations for one sample, measured
    on the CPU, times the samples its schedule keeps in flight there
    (pipeline_schedules.in_flight)."""
    from .pipeline import ModelPart
    from .pipeline_schedules import in_flight
    dims, last = pipeline.dims, len(pipeline.split) - 1
    model = cpu_model(factory, precision)
    idx = torch.randint(0, vocab_size, (1, seq_length))  # (1, T)
    rows = []
    for r in range(dims.pp):
        stages = pipeline.stages_of(r * dims.stage_world)
        part = ModelPart(model, [b for s in stages for b in pipeline.blocks_of(s)],
                         first=0 in stages, last=last in stages)
        x = idx if part.first else torch.randn(  # (1, T, C), received from the stage before
            1, seq_length, model.args.hidden_size, dtype=next(model.parameters()).dtype,
            requires_grad=True)
        held = state_bytes([p.shape for p in part.parameters()], Parallelism(), 1, precision)
        act = in_flight(pipeline.schedule, dims.pp, micro_batches, r) * \
            saved_bytes(part, x, idx if part.last else None, precision).of_batch(micro_batch)
        rows.append(Estimate(pipeline, False, *held, act, act + sum(held)))
    return max(rows, key=lambda e: e.device_bytes)


def device_workspace(device: torch.device) -> int:
    """What a step holds on this device beside its tensors (CUDA_WORKSPACE_BYTES on a GPU)."""
    return CUDA_WORKSPACE_BYTES if device.type == "cuda" else 0


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


def layout_keys(pick: Choice) -> str:
    """The overrides that train a picked layout without `auto`."""
    from .pipeline import PipelineParallel
    from .tensor import TensorParallel
    p = pick.parallelism
    if isinstance(p, PipelineParallel):
        keys = [f"trainer.pipeline_parallel={p.dims.pp}"]
    elif isinstance(p, TensorParallel):
        keys = [f"trainer.strategy={p.data.name if p.dims.dp > 1 else 'auto'}",
                f"trainer.tensor_parallel={p.dims.tp}"]
    else:
        keys = [f"trainer.strategy={p.name}"]
    if p.offloads_to_host:
        keys.append("trainer.cpu_offload=true")
    elif pick.activation_checkpointing:
        keys.append("trainer.activation_checkpointing=true")
    return " ".join(keys)


def format_estimates(rows: List[Estimate], capacity: int, pick: Choice) -> str:
    frozen = any(r.frozen_bytes for r in rows)  # a task's untrained models (DPO's reference)
    head = (f"{'strategy':<14}{'params':>10}{'grads':>10}{'optimizer':>11}{'activations':>13}"
            + (f"{'frozen':>10}" if frozen else "") + f"{'per device':>12}  fits")
    lines = [head]
    for r in rows:
        fits = "yes" if r.device_bytes <= capacity * MARGIN else "no"
        lines.append(f"{r.label:<14}{human_bytes(r.params_bytes):>10}"
                     f"{human_bytes(r.grads_bytes):>10}{human_bytes(r.optimizer_bytes):>11}"
                     f"{human_bytes(r.activation_bytes):>13}"
                     + (f"{human_bytes(r.frozen_bytes):>10}" if frozen else "")
                     + f"{human_bytes(r.device_bytes):>12}  {fits}")
    if rows[0].cache_bytes:
        lines.append(f"generation KV cache {human_bytes(rows[0].cache_bytes)} per device "
                     f"({rows[0].cache_note}); freed before learning: per device counts the "
                     "larger of it and the activations")
    lines.append(f"device capacity {human_bytes(capacity)} (planning to {int(MARGIN * 100)}%); "
                 f"trainer.strategy=auto picks {pick.label} ({pick.why}); to fix it: "
                 f"{layout_keys(pick)}")
    return "\n".join(lines)


def estimates_for_config(cfg, world: Optional[int] = None,
                         device: Optional[torch.device] = None,
                         local_workers: Optional[int] = None, probe: Any = None
                         ) -> tuple[List[Estimate], int, Choice]:
    """(rows, capacity, pick) for a TrainConfig's own model, or for the model a task describes
    (`probe`: its tasks.base.MemoryProbe, frozen models included): what `paratrain plan`
    prints."""
    from ..launch.environment import parse_devices
    from ..models import build_model, resolve_model_config
    from .strategies import shard_group
    devices = parse_devices(cfg.trainer.devices)
    world = world or len(devices) * cfg.distributed.max_nodes
    if probe is None:
        vocab = cfg.model.vocab_size or cfg.data.vocab_size
        args = resolve_model_config(cfg.model, vocab_size=vocab, seq_length=cfg.data.seq_length)
        factory, seq_length = (lambda: build_model(args)), cfg.data.seq_length
        frozen = cache = shallow = None
    else:
        factory, seq_length, vocab = probe.build_model, probe.seq_length, probe.vocab_size
        frozen, cache, shallow = probe.build_frozen, probe.cache, probe.shallow
    local = local_workers or len(devices)
    override = cfg.trainer.shard_group_size  # a bad one is the error `train` would give
    group = shard_group(world, local, override) if override is not None else local
    rows = estimate(factory, world=world, precision=cfg.trainer.precision,
                    micro_batch=cfg.trainer.batch_size, seq_length=seq_length,
                    vocab_size=vocab, reshard_after_forward=cfg.trainer.reshard_after_forward,
                    shard_group_size=group, frozen_factory=frozen, cache=cache,
                    accumulation=_accumulation(cfg.trainer, world),
                    workspace=device_workspace(device or devices[0]), shallow=shallow)
    capacity = device_capacity(device or devices[0], local)
    return rows, capacity, choose(rows, capacity)


def _accumulation(trainer: Any, world: int) -> int:
    """Micro-batches per optimizer step (runplan.batch_plan checks the sizes when a run starts)."""
    wanted = trainer.global_batch_size
    return 1 if wanted is None else max(1, wanted // (trainer.batch_size * world))
