"""`paratrain plan`'s simulation of devices you do not have: `paratrain plan plan.nodes=128
plan.devices_per_node=8 ...` builds the real parallelized model, through the same `parallelize`
that training calls (TP -> AC -> compile -> FSDP), on the meta device (no memory) as rank 0 of a
fake process group of the target's world size (no processes, no communication), and reads what
that rank would hold from its real DTensor shards.

- State: parameters, gradients and AdamW moments per device, from the local shards (rank 0 is
  the fullest: uneven splits give the first ranks the remainder).
- Activations: one micro-batch's forward and loss on the meta device with tensor parallelism
  applied (the data-parallel wrapper changes no activation), the bytes autograd saves for
  backward counted by the same meter the training loop uses.
- Traffic: bytes each device sends per optimizer step, per collective and mesh dimension
  (traffic.py). The tensor-parallel collectives are the ones the meta forward and backward
  actually issue (counted as they are dispatched); FSDP's all-gathers and reduce-scatters and the
  replicas' all-reduces follow from the shard sizes.

Transformer blocks are identical, so every figure is linear in the number of blocks: each layout
is built with one block and with two, and f(L) = f(1) + (L - 1) * (f(2) - f(1)) is exact. That
keeps a 405B-parameter plan over 4096 devices to seconds.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..dist import DistEnv
from ..errors import ConfigError
from ..formatting import human_bytes
from .context import SimulatedShard, set_context
from .fake_world import fake_world
from .memory import SavedTensorMeter, local_bytes
from .memory_estimate import MARGIN, Choice, Estimate, choose, layout_keys
from .parallelize import apply_activation_checkpointing, parallelize
from .precision import mixed_dtype, prepare_model
from .pipeline import ModelPart, PipelineParallel, resolve_pipeline_parallel
from .pipeline_schedules import in_flight
from .simulate_context import META, context_costs, context_layouts, context_line, \
    fused_attention
from .strategies import Parallelism, resolve_parallelism
from .tensor import resolve_tensor_parallel, split_tensor_parallel
from .traffic import COLLECTIVES, data_parallel_traffic, gathered_element_bytes, sent_bytes


@dataclass(frozen=True)
class Target:
    """The devices a simulation is for: nodes x devices per node, and one device's memory."""
    nodes: int
    devices_per_node: int
    capacity: int  # bytes

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def label(self) -> str:
        return (f"{self.world} devices as {self.nodes} node(s) x {self.devices_per_node}, "
                f"{human_bytes(self.capacity)} each")


@dataclass(frozen=True)
class Simulated(Estimate):
    """A row of the simulation, read from the simulated model: Estimate's bytes on rank 0, plus the bytes it
    sends per optimizer step ({mesh dimension: {collective: bytes}})."""
    sent: dict = field(default_factory=dict)
    asked: bool = False  # the layout the config asks for
    dims: str = ""  # the mesh, e.g. dp_shard=128 x tp=8
    cp: int = 1  # context parallelism: ranks that split each sequence
    sizes: Any = None  # the row's ParallelDims, with its CP groups

    @property
    def label(self) -> str:
        """As `candidate_label`, named from the row's sizes (dims.`layout_name`): fsdp+cp4+ac."""
        if self.sizes is None or self.cp == 1:
            return super().label
        ac = self.activation_checkpointing and not self.parallelism.offloads_to_host
        return self.sizes.layout_name(self.parallelism.data_label, degrees=True) + "+ac" * ac

    @property
    def sent_total(self) -> int:
        return sum(b for by_kind in self.sent.values() for b in by_kind.values())

    def to_dict(self) -> dict:
        return {**super().to_dict(), "mesh": self.dims, "asked": self.asked,
                "sent_bytes_per_step": self.sent}


@dataclass(frozen=True)
class Workload:
    """What one step computes: the model (a factory of it with a given number of blocks), its
    blocks, precision, micro-batch and accumulation."""
    build: Callable[[int], nn.Module]  # blocks -> a model with that many blocks
    num_layers: int
    vocab_size: int
    seq_length: int
    micro_batch: int
    global_batch: Optional[int]  # trainer.global_batch_size: accumulation depends on the layout
    precision: str
    reshard_after_forward: bool = True

    def accum(self, dp: int) -> int:
        """Micro-steps per optimizer step with `dp` data-parallel groups (at least one)."""
        return max(1, (self.global_batch or 0) // (self.micro_batch * dp))


def candidates(target: Target, *, heads: int, kv_heads: int, requested: str, tp: int,
               reshard_after_forward: bool = True, pipeline: Optional[PipelineParallel] = None
               ) -> list[tuple[Parallelism, bool, bool]]:
    """(parallelism, activation checkpointing, asked) in `auto`'s order, fastest first: replicate;
    shard within nodes and replicate across; shard over all; shard and split layers (TP inside
    a node, the smallest degree first); the same recomputing blocks; shard and offload. The
    layout the config asks for is always among them (`pipeline`: a pipeline is asked for; it
    is never one of auto's own)."""
    world, local = target.world, target.devices_per_node
    kw = dict(world_size=world, local_world_size=local, device=META,
              reshard_after_forward=reshard_after_forward)

    def data(name: str) -> Parallelism:
        return resolve_parallelism(name, **kw)[0]

    def tensor(name: str, degree: int) -> Parallelism:
        return resolve_tensor_parallel(name, degree, **kw)[0]
    degrees = [d for d in range(2, local + 1)
               if local % d == 0 and heads % d == 0 and kv_heads % d == 0]
    plain = [data("ddp")] + ([data("hsdp")] if 1 < local < world else []) + \
        ([data("fsdp")] if world > 1 else [])
    split = [tensor("fsdp", d) for d in degrees]
    rows = [(p, False) for p in plain + split] + \
        [(p, True) for p in plain[-1:] + split if world > 1]
    if world > 1:
        rows.append((resolve_parallelism("fsdp", cpu_offload=True, **kw)[0], True))
    asked = (pipeline if pipeline is not None else tensor(requested, tp) if tp > 1
             else data(requested), False)
    if asked not in rows:
        rows.insert(0, asked)
    return [(p, ac, (p, ac) == asked) for p, ac in rows]


def simulate(work: Workload, target: Target,
             layouts: list[tuple[Parallelism, bool, bool]],
             context: Sequence[tuple[Parallelism, bool, bool, int]] = ()) -> list[Simulated]:
    """Every layout's row, built and measured as rank 0 of the target's world; `context`: more
    layouts (parallelism, checkpointing, asked, cp) with context parallelism."""
    activations: dict[tuple[int, bool, int], dict] = {}  # by (tp, checkpointing, cp): shared
    rows = []
    for parallelism, ac, asked, cp in [(*layout, 1) for layout in layouts] + list(context):
        if parallelism.layout(target.world).pp > 1:  # (its stages' CP groups: `cp`)
            rows.append(_pipeline_row(work, target, parallelism.with_context(cp), ac, asked))
        else:
            rows.append(_row(work, target, parallelism, ac, asked, cp, activations))
    return rows


def _row(work: Workload, target: Target, parallelism: Parallelism, ac: bool, asked: bool,
         cp: int, activations: dict) -> Simulated:
    """One layout's row: state, one micro-batch's activations (1/cp of each sequence), traffic."""
    dims = parallelism.layout(target.world).with_context(cp)
    state = _linear(work, lambda blocks: _state(work, blocks, parallelism, target))
    key = (dims.tp, ac, cp)
    if key not in activations:
        activations[key] = _linear(work, lambda blocks: _activations(
            work, blocks, parallelism if dims.tp > 1 else None, target, ac, cp))
    act = activations[key]
    accum = work.accum(dims.dp)
    sent = data_parallel_traffic(parallelism, state, target.world, accum, work.precision,
                                 work.reshard_after_forward)
    for name, count in act["sent"].items():  # tensor parallel: per micro-step
        sent.setdefault("tp", {})[name] = count * accum
    cp_sent, mask = context_costs(_model(work, 1).args, work, dims, work.num_layers, ac, accum)
    sent.update(cp_sent)
    activation_bytes = int(act["saved"]) + mask
    gathered = 2 * int(act["block_numel"]) * gathered_element_bytes(work.precision) \
        if parallelism.sharded else 0  # FSDP: this block's full parameters and the next's
    params, n_tensors = int(state["params"]), int(state["tensors"])
    parts = (params, params, 2 * params + 4 * n_tensors)  # AdamW: 2 moments + a step each
    on_device = not parallelism.offloads_to_host
    peak = activation_bytes + gathered + (sum(parts) if on_device else 0)
    return Simulated(parallelism, ac, *parts, activation_bytes, peak, sent=sent, asked=asked,
                     dims=dims.label, cp=cp, sizes=dims)


def _pipeline_row(work: Workload, target: Target, pipeline: Any, ac: bool,
                  asked: bool) -> Simulated:
    """Rank 0 of a pipeline: its stages' part (the embedding and their blocks) parallelized as
    training does it (`parallelize_part`: FSDP shards, TP splits), one micro-batch's saved
    activations times the micro-batches its schedule keeps in flight
    (pipeline_schedules.in_flight), the activations it sends on, its data parallelism's traffic."""
    dims, stages = pipeline.dims, pipeline.stages_of(0)
    blocks = sum(len(pipeline.blocks_of(s)) for s in stages)
    last = len(pipeline.split) - 1 in stages
    idx = torch.zeros(work.micro_batch, work.seq_length // dims.cp, dtype=torch.long, device=META)
    with fake_world(target.world), fused_attention():
        mesh = dims.build_mesh(META.type)
        run_part = ModelPart(_model(work, blocks), range(blocks), first=True, last=last)
        pipeline.parallelize_part(run_part, _env(target), mesh, precision=work.precision)
        named = dict(run_part.named_parameters())  # as the run holds them
        part = ModelPart(_model(work, blocks, compute=True), range(blocks), first=True, last=last)
        if dims.tp > 1:  # tensor parallelism: the stream split by sequence
            split_tensor_parallel(part, mesh["tp"])
        if dims.cp > 1:  # context parallelism: its K/V gathered as copies
            set_context(part, SimulatedShard(dims.cp))
        if ac:
            apply_activation_checkpointing(part)
        with SavedTensorMeter(part) as meter:
            out = part(idx)  # (B, T, C), or (B, T, V) when this rank holds the last stage too
            if last:
                nn.functional.cross_entropy(out.float().flatten(0, 1), idx.flatten())
    state = {"numel": sum(_local_numel(p) for p in named.values()), "root_numel": sum(
        _local_numel(p) for n, p in named.items() if not n.startswith("layers."))}
    micro = work.accum(dims.dp)
    held = in_flight(pipeline.schedule, dims.pp, micro)
    sends = len(stages) - int(last)  # every stage but the last sends its output (its TP slice)
    sent = data_parallel_traffic(pipeline, state, target.world, micro, work.precision,
                                 work.reshard_after_forward)
    sent["pp"] = {"send": sends * micro * work.micro_batch * idx.size(1) *  # (T/cp under CP)
                  part.args.hidden_size * gathered_element_bytes(work.precision) // dims.tp}
    cp_sent, mask = context_costs(part.args, work, dims, blocks, ac, micro)
    sent.update(cp_sent)
    params = local_bytes(named.values())
    parts = (params, params, 2 * params + 4 * len(named))
    activation_bytes = meter.bytes * held + mask
    return Simulated(pipeline, ac, *parts, activation_bytes, activation_bytes + sum(parts),
                     sent=sent, asked=asked, dims=dims.label, cp=dims.cp, sizes=dims)


def _linear(work: Workload, measure: Callable[[int], dict]) -> dict:
    """f(L) from f(1) and f(2): every figure is linear in the number of identical blocks."""
    one, two = measure(1), measure(2)
    out: dict = {}
    for key in one:
        if isinstance(one[key], dict):
            names = set(one[key]) | set(two[key])
            out[key] = {n: one[key].get(n, 0) + (work.num_layers - 1) *
                        (two[key].get(n, 0) - one[key].get(n, 0)) for n in names}
        else:
            out[key] = one[key] + (work.num_layers - 1) * (two[key] - one[key])
    return out


def _env(target: Target) -> DistEnv:
    return DistEnv(world_size=target.world, local_world_size=target.devices_per_node,
                   nnodes=target.nodes, device=META)


def _state(work: Workload, blocks: int, parallelism: Parallelism, target: Target) -> dict:
    """Rank 0's parameters under `parallelism`, the model wrapped exactly as training wraps it:
    bytes, tensors, elements, and the elements outside the blocks (FSDP's root unit)."""
    dims = parallelism.layout(target.world)
    with fake_world(target.world):
        model = _model(work, blocks)
        # a replica (single, DDP) holds the module as it is, and DDP's start-up checks read
        # real data: only what splits the parameters is applied
        if dims.dp_shard > 1 or dims.tp > 1:
            model = parallelize(model, parallelism, _env(target), precision=work.precision)
        named = dict(model.named_parameters())
    return {"params": local_bytes(named.values()), "tensors": len(named),
            "numel": sum(_local_numel(p) for p in named.values()),
            "root_numel": sum(_local_numel(p) for n, p in named.items()
                              if not n.startswith("layers."))}


def _local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def _model(work: Workload, blocks: int, compute: bool = False) -> nn.Module:
    """The model on the meta device; `compute`: in the compute dtype (autocast has no meta
    device: the half dtype, as FSDP's mixed-precision policy computes; the norms upcast inside)."""
    with torch.device(META):
        model = prepare_model(work.build(blocks), work.precision)
    dtype = mixed_dtype(work.precision) if compute else None
    return model if dtype is None else model.to(dtype)


def _activations(work: Workload, blocks: int, tensor: Optional[Parallelism], target: Target,
                 checkpointing: bool, cp: int = 1) -> dict:
    """Bytes saved for backward by one micro-batch's forward and loss, and the tensor-parallel
    collectives of its forward and backward, on the meta device (`cp`: rank 0's 1/cp of each
    sequence, attending to the keys and values of the whole, as context parallelism runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    sent: Counter = Counter()

    class Collectives(TorchDispatchMode):
        """Counts the bytes each collective sends from this rank as DTensor issues them."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = COLLECTIVES.get(func.__name__.split(".")[0])
            if name is not None:
                sent[name] += sent_bytes(name, args[0], group_size)
            return func(*args, **(kwargs or {}))

    with fake_world(target.world), fused_attention():
        model = _model(work, blocks, compute=True)
        group_size = 1
        if tensor is not None:
            mesh = tensor.device_mesh(_env(target))
            split_tensor_parallel(model, mesh["tp"])
            group_size = mesh["tp"].size()
        if cp > 1:
            set_context(model, SimulatedShard(cp))
        if checkpointing:
            apply_activation_checkpointing(model)
        idx = torch.zeros(work.micro_batch, work.seq_length // cp, dtype=torch.long, device=META)
        with Collectives(), SavedTensorMeter(model) as meter:
            logits = model(idx)  # (B, T, V)
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), idx.flatten())
        with Collectives():
            loss.backward()
    # one block's parameters as TP leaves them: what FSDP gathers for it
    block = sum(_local_numel(p) for p in model.layers[0].parameters())
    return {"saved": meter.bytes, "sent": dict(sent), "block_numel": block}


# ---- from a config, and the table ---------------------------------------------------------------
def target_of(cfg: Any) -> Target:
    """plan.nodes / plan.devices_per_node / plan.device_memory_gb, each defaulting to this
    machine's (distributed.nnodes, trainer.devices, the device's memory)."""
    from ..launch.environment import parse_devices
    from .memory_estimate import device_capacity
    devices = parse_devices(cfg.trainer.devices)
    per_node = cfg.plan.devices_per_node or len(devices)
    capacity = int(cfg.plan.device_memory_gb * 1e9) if cfg.plan.device_memory_gb \
        else device_capacity(devices[0], per_node)
    return Target(cfg.plan.nodes or cfg.distributed.max_nodes, per_node, capacity)


def simulate_at_scale(cfg: Any) -> tuple[list[Simulated], Target, Choice, Workload]:
    """(rows, target, auto's pick, workload) for a TrainConfig with one of our models."""
    from ..models import build_model, resolve_model_config
    if cfg.model.arch not in ("llama", "gpt"):
        raise ConfigError(f"paratrain plan simulates our llama and gpt models (a preset, or "
                          f"model.* sizes), not model.arch={cfg.model.arch} yet; drop the plan.* "
                          "keys and trainer.tensor_parallel to plan this machine")
    target = target_of(cfg)
    tr = cfg.trainer
    args = resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size or cfg.data.vocab_size,
                                seq_length=cfg.data.seq_length)
    work = Workload(lambda blocks: build_model(dataclasses.replace(args, num_layers=blocks)),
                    args.num_layers, args.vocab_size, cfg.data.seq_length, tr.batch_size,
                    tr.global_batch_size, tr.precision, tr.reshard_after_forward)
    requested = tr.strategy if tr.strategy != "single" else "ddp"
    pipeline = resolve_pipeline_parallel(
        requested, tr.pipeline_parallel, schedule=tr.pipeline_schedule, split=tr.pipeline_split,
        num_layers=args.num_layers, world_size=target.world, tp=tr.tensor_parallel,
        local_world_size=target.devices_per_node, device=META, shard_group_size=tr.shard_group_size,
        reshard_after_forward=tr.reshard_after_forward)[0] if tr.pipeline_parallel > 1 else None
    layouts = candidates(target, heads=args.num_heads, kv_heads=args.num_kv_heads,
                         requested=requested, tp=tr.tensor_parallel,
                         reshard_after_forward=tr.reshard_after_forward, pipeline=pipeline)
    cp = tr.context_parallel
    rows = simulate(work, target, [(p, ac, asked and cp == 1) for p, ac, asked in layouts])
    budget = target.capacity * MARGIN
    if cp > 1 or not any(r.device_bytes <= budget for r in rows
                         if not r.parallelism.offloads_to_host):  # a sequence too long: CP
        asked = [(p, tr.activation_checkpointing, True, cp) for p, _, a in layouts if a]
        rows += simulate(work, target, [], (asked if cp > 1 else []) + context_layouts(
            target.world, target.devices_per_node, cfg.data.seq_length, tr.reshard_after_forward))
    return rows, target, choose(auto_rows(rows, target) or rows, target.capacity), work


def auto_rows(rows: list[Simulated], target: Target) -> list[Simulated]:
    """The rows `train`'s auto chooses among (runplan.auto_choice): no tensor parallelism, no
    pipeline and no context parallelism, which it picks only when asked for (or a pipeline, when
    nothing else fits)."""
    return [r for r in rows if r.parallelism.layout(target.world).tp == 1
            and r.parallelism.layout(target.world).pp == 1 and r.cp == 1]


def format_simulation(rows: list[Simulated], target: Target, pick: Choice, work: Workload,
                      title: str) -> str:
    head = (f"{'layout':<16}{'mesh':<30}{'params':>10}{'grads':>10}{'optimizer':>11}"
            f"{'activations':>13}{'per device':>12}  fits  {'sent per step':>14}")
    batch = f"global batch {work.global_batch}" if work.global_batch else "no accumulation"
    lines = [f"{title}: {target.label}; micro-batch {work.micro_batch} x {work.seq_length} "
             f"tokens ({batch}), {work.precision}", head]
    for r in rows:
        fits = "yes" if r.device_bytes <= target.capacity * MARGIN else "no"
        lines.append(f"{r.label + (' *' if r.asked else ''):<16}{r.dims:<30}"
                     f"{human_bytes(r.params_bytes):>10}{human_bytes(r.grads_bytes):>10}"
                     f"{human_bytes(r.optimizer_bytes):>11}{human_bytes(r.activation_bytes):>13}"
                     f"{human_bytes(r.device_bytes):>12}  {fits:<4}  "
                     f"{human_bytes(r.sent_total):>14}")
    lines.append("* the layout the config asks for; sent: bytes each device sends per optimizer "
                 "step (--json: by mesh dimension and collective)")
    lines.append(f"planning to {int(MARGIN * 100)}% of each device; trainer.strategy=auto picks "
                 f"{pick.label} ({pick.why}); to fix it: {layout_keys(pick)}")
    line = context_line(rows, target.capacity * MARGIN, work.seq_length)
    if line:
        lines.append(line)
    best = choose([r for r in rows if r.cp == 1], target.capacity)
    if best.label != pick.label:  # tensor parallelism fits earlier: auto takes it only if asked
        lines.append(f"{best.label} fits too and comes first in auto's order, but auto uses "
                     f"tensor parallelism only when asked: {layout_keys(best)}")
    return "\n".join(lines)
