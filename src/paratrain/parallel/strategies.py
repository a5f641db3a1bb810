"""How a model is spread over devices: one object per way, chosen once (`resolve_parallelism`) and
then asked, never compared as a string again.

A parallelism knows how to wrap a model, how to skip gradient sync on the accumulation micro-steps
before the last one (Fabric's per-strategy backward-sync control), which autocast and gradient
scaler it needs, and what share of the parameters, gradients and optimizer state one rank holds
(the memory plan and `bench` count with it). Which one wraps a run is read from its
data-parallel sizes (`data_wrapper`: dp_shard > 1 FSDP, HSDP with dp_replicate > 1 too, DDP for
replicas alone), which a strategy name presets (`preset_sizes`); each takes its dimensions of
the run's one mesh (`data_mesh`: HSDP a 2-D slice; tensor parallelism, parallel/tensor.py, FSDP2
beside TP's). The dimensions that split the model (TP, CP), activation checkpointing and compile
are applied before the wrapper, in that order, by parallel/parallelize.py.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

from ..dist import DistEnv
from ..errors import ConfigError
from .dims import ParallelDims
from .precision import mixed_dtype


@dataclass(frozen=True)
class Parallelism:
    """One process holds the whole model and computes on one device: `single`."""
    name: ClassVar[str] = "single"
    sharded: ClassVar[bool] = False  # parameters, gradients and optimizer state split by rank

    def device_mesh(self, env: DistEnv) -> Any:
        """This parallelism's own preset's mesh, for a caller without a run's sizes (None: it
        needs none); `parallelize` builds the run's from its sizes. Collective."""
        return None

    def wrap(self, model: nn.Module, env: DistEnv, *, precision: str,
             units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        """The model, wrapped for this parallelism (`units`: the blocks a sharding wraps; `mesh`:
        what `data_mesh` took of the run's mesh)."""
        return model

    def data_mesh(self, mesh: Any, dims: ParallelDims) -> Any:
        """What the wrapper spans of the run's one mesh (`mesh`, built from `dims`; None:
        nothing, as DDP all-reduces over the default group). Slicing only: no collective."""
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the wrapper."""
        return model

    def wrap_frozen(self, model: nn.Module, env: DistEnv, *, precision: str,
                    units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        """A model run but never trained (a reference, a teacher): it has no gradients to sync,
        so replicating strategies keep a plain copy per rank; sharding ones shard it too."""
        return model

    def full_state_dict(self, model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
        """Full, unsharded CPU tensors on global rank 0 (an empty dict on the other ranks):
        what the final model/ and the best-so-far copy are written from. Collective: every rank
        must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        if not env.distributed:
            return {k: v.detach().cpu() for k, v in self.unwrap(model).state_dict().items()}
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
        return sd if env.is_master else {}

    def no_sync(self, model: nn.Module) -> ContextManager:
        """Accumulate gradients locally (no all-reduce / reduce-scatter) in this context."""
        return contextlib.nullcontext()

    def autocast(self, precision: str, device: torch.device) -> ContextManager:
        dtype = mixed_dtype(precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def grad_scaler(self, precision: str, device: torch.device) -> Optional[Any]:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
        return torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None

    @property
    def offloads_to_host(self) -> bool:
        """Whether the state lives in host RAM (the model is then not moved to the device)."""
        return False

    def replicas_per_process(self, devices: int) -> int:
        """Devices one process computes on (nn.DataParallel splits its batch over all)."""
        return 1

    def state_numel(self, shape: torch.Size, world: int, rank: int = 0) -> int:
        """Elements of a parameter of this shape that `rank` holds (and grads, optimizer)."""
        return math.prod(shape)

    def layout(self, world: int) -> ParallelDims:
        """How `world` processes are factored under this parallelism (parallel/dims.py)."""
        return ParallelDims()

    def roles(self, world: int) -> dict[int, str]:
        """What the stalled-rank watchdog says beside a rank's number (none: every rank runs
        the same model)."""
        return {}

    @property
    def label(self) -> str:
        return self.name

    @property
    def data_name(self) -> str:
        """The data-parallel wrapper's name, which a layout's name starts with
        (dims.`layout_name`): this one's own here; what wraps the data-parallel ranks under
        tensor or pipeline parallelism."""
        return self.name

    @property
    def data_label(self) -> str:
        """As `data_name`, in the plan's rows (fsdp+offload)."""
        return self.label


@dataclass(frozen=True)
class DataParallel(Parallelism):
    """nn.DataParallel over every visible GPU from one process, master copy on the first: kept to
    reproduce the classic DataParallel-vs-DDP comparison, not for real use."""
    name: ClassVar[str] = "dp"

    def wrap(self, model: nn.Module, env: DistEnv, *, precision: str,
             units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        return nn.DataParallel(model, device_ids=list(range(torch.cuda.device_count())),
                               output_device=env.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model

    def wrap_frozen(self, model: nn.Module, env: DistEnv, *, precision: str,
                    units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        return self.wrap(model, env, precision=precision, units=units)  # its batch is split too

    def replicas_per_process(self, devices: int) -> int:
        return devices


@dataclass(frozen=True)
class DDP(Parallelism):
    """A full replica per rank; gradients all-reduced in buckets during backward."""
    name: ClassVar[str] = "ddp"

    def wrap(self, model: nn.Module, env: DistEnv, *, precision: str,
             units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel
        # Our only buffers are constants (RoPE tables): broadcasting them every step is pure
        # cost, and a broadcast inside forward would deadlock evaluation on uneven shards.
        params = inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                          else {"broadcast_buffers": False})  # torch < 2.12
        return DistributedDataParallel(
            model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
            gradient_as_bucket_view=True, **no_buffer_sync)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()  # type: ignore[operator]

    def layout(self, world: int) -> ParallelDims:
        return ParallelDims(dp_replicate=world)


@dataclass(frozen=True)
class FSDP(Parallelism):
    """FSDP2: each block (or each `units` module), then the root, sharded over all ranks.

    Sharding per block is what bounds memory: only one block's full parameters exist at a time in
    forward and backward. Mixed precision is FSDP's own policy (parameters all-gathered in half
    precision, gradients reduced in fp32 so the sum over ranks keeps its precision), not
    autocast."""
    name: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True
    cpu_offload: bool = False  # parameters, gradients and optimizer state live in host RAM
    reshard_after_forward: bool = True  # free full parameters after forward (less memory)

    def data_mesh(self, mesh: Any, dims: ParallelDims) -> Any:
        """The run's mesh's data-parallel dimensions (dims.`data_names`): the shards' (1-D,
        dp_shard, or dp_shard x cp flattened), with the replicas' before it under HSDP (2-D)."""
        return dims.data_mesh(mesh)

    def wrap(self, model: nn.Module, env: DistEnv, *, precision: str,
             units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        kwargs: dict = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        param_dtype = mixed_dtype(precision)
        if param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype,
                                                       reduce_dtype=torch.float32)
        if self.cpu_offload:
            # pinned host memory makes the copies asynchronous; it needs an accelerator
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def wrap_frozen(self, model: nn.Module, env: DistEnv, *, precision: str,
                    units: Sequence[nn.Module], mesh: Any = None) -> nn.Module:
        return self.wrap(model, env, precision=precision, units=units, mesh=mesh)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def autocast(self, precision: str, device: torch.device) -> ContextManager:
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts

    def grad_scaler(self, precision: str, device: torch.device) -> Optional[Any]:
        """Each rank holds a shard of the gradients: the inf/nan check must be agreed across
        ranks, which the sharded scaler does."""
        if precision != "fp16-mixed":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device.type)

    def state_numel(self, shape: torch.Size, world: int, rank: int = 0) -> int:
        """FSDP2 splits dim 0 evenly, the first ranks taking the remainder."""
        if not shape:
            return 1 if rank == 0 else 0
        rows = shape[0]
        per = math.ceil(rows / world)
        return max(0, min(per, rows - rank * per)) * math.prod(shape[1:])

    @property
    def offloads_to_host(self) -> bool:
        return self.cpu_offload

    def layout(self, world: int) -> ParallelDims:
        return ParallelDims(dp_shard=world)

    @property
    def label(self) -> str:
        return f"{self.name}+offload" if self.cpu_offload else self.name


@dataclass(frozen=True)
class HSDP(FSDP):
    """Hybrid sharding (FSDP2 on a 2-D mesh): shard within a group of `shard_group_size`
    consecutive ranks (a node by default), replicate across the groups (the nodes).

    Its mesh is the run's (dp_replicate, dp_shard) = (world / group, group), row-major, so a
    shard group is ranks [k*group, (k+1)*group): one node's ranks. Per-layer all-gathers and reduce-scatters
    stay inside a node; only a 1/group slice of the gradients is all-reduced across nodes. A rank
    holds 1/group of the state (FSDP over all ranks: 1/world; DDP: all of it)."""
    name: ClassVar[str] = "hsdp"
    shard_group_size: int = 1

    def state_numel(self, shape: torch.Size, world: int, rank: int = 0) -> int:
        """FSDP's split over the shard group; the replicas hold the same shards."""
        group = self.shard_group_size
        return super().state_numel(shape, group, rank % group)

    def layout(self, world: int) -> ParallelDims:
        return ParallelDims(dp_replicate=world // self.shard_group_size,
                            dp_shard=self.shard_group_size)


def shard_group(world_size: int, local_world_size: int, override: Optional[int]) -> int:
    """HSDP's shard group size: `trainer.shard_group_size`, else the processes of one node; a
    ConfigError when it does not divide the world."""
    group = override if override is not None else local_world_size
    if group < 1 or world_size % group:
        fits = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ConfigError(f"trainer.shard_group_size={group} must divide the world size "
                          f"({world_size} processes): one of {fits}")
    return group


def resolve_parallelism(requested: str, *, world_size: int, local_world_size: int,
                        device: torch.device, cpu_offload: bool = False,
                        reshard_after_forward: bool = True,
                        shard_group_size: Optional[int] = None,
                        planned: Optional[tuple[Parallelism, str]] = None
                        ) -> tuple[Parallelism, str]:
    """(parallelism, why): `trainer.strategy` turned into an object, once (`resolve_data`)."""
    _, parallelism, why = resolve_data(
        requested, world_size=world_size, local_world_size=local_world_size, device=device,
        cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
        shard_group_size=shard_group_size, planned=planned)
    return parallelism, why


def resolve_data(requested: str, *, world_size: int, local_world_size: int,
                 device: torch.device, cpu_offload: bool = False,
                 reshard_after_forward: bool = True, shard_group_size: Optional[int] = None,
                 planned: Optional[tuple[Parallelism, str]] = None
                 ) -> tuple[ParallelDims, Parallelism, str]:
    """(sizes, wrapper, why) of `world_size` data-parallel processes: `trainer.strategy`'s
    sizes (`preset_sizes`), then the wrapper those call for (`data_wrapper`). One process means
    `single` whatever was asked for several; `auto` takes the memory plan's pick when there is
    one (plan.py), else ddp. `hsdp` whose one shard group would span every process (one node,
    no `shard_group_size`) is fsdp, and whose groups are one process each is ddp: each resolves
    to what its sizes are, saying so."""
    if requested == "dp":
        if device.type != "cuda":
            raise ConfigError("trainer.strategy=dp (nn.DataParallel) needs CUDA GPUs; on CPU use "
                              "trainer.strategy=ddp")
        if world_size > 1 and local_world_size > 1:
            raise ConfigError("trainer.strategy=dp drives every GPU from one process; do not "
                              "start one process per GPU (no torchrun, one node)")
        return ParallelDims(), DataParallel(), "asked for"  # one process drives every GPU
    if cpu_offload and requested not in ("fsdp", "auto"):
        raise ConfigError(f"trainer.cpu_offload=true needs trainer.strategy=fsdp (parameters are "
                          f"offloaded shard by shard), not {requested}")
    sizes, why = preset_sizes(requested, world_size=world_size, cpu_offload=cpu_offload,
                              local_world_size=local_world_size,
                              shard_group_size=shard_group_size, planned=planned)
    offload = cpu_offload or (requested == "auto" and planned is not None
                              and planned[0].offloads_to_host)
    return sizes, data_wrapper(sizes, cpu_offload=offload,
                               reshard_after_forward=reshard_after_forward), why


def preset_sizes(requested: str, *, world_size: int, local_world_size: int,
                 cpu_offload: bool = False, shard_group_size: Optional[int] = None,
                 planned: Optional[tuple[Parallelism, str]] = None) -> tuple[ParallelDims, str]:
    """(sizes, why): the data-parallel sizes of `world_size` processes that `trainer.strategy`
    names (parallel/layout.py's table): ddp all replicas, fsdp all shards, hsdp replicas of
    shard groups of `shard_group_size` (a node's processes by default), auto the memory plan's
    pick (`planned`) or ddp; one process, none."""
    if world_size == 1:
        why = "one process" if requested in ("auto", "single") else \
            f"{requested} asked for, but there is only one process"
        return ParallelDims(), why
    if requested == "single":
        raise ConfigError(f"trainer.strategy=single runs one process, but {world_size} were "
                          "started; use trainer.strategy=ddp or one device")
    # a bad trainer.shard_group_size is an error under auto too (its plan may pick hsdp)
    group = shard_group(world_size, local_world_size, shard_group_size) \
        if requested in ("hsdp", "auto") else world_size
    shards = ParallelDims(dp_shard=world_size)
    if requested == "hsdp":
        if group == world_size:
            return shards, (f"hsdp asked for, but its one shard group spans all {world_size} "
                            "processes (one node without trainer.shard_group_size): that is fsdp")
        if group == 1:  # shards of one process shard nothing
            return ParallelDims(dp_replicate=world_size), (
                "hsdp asked for, but its shard groups are one process each (one per node "
                "without trainer.shard_group_size): that is ddp")
        return (ParallelDims(world_size // group, group),
                f"asked for: {world_size // group} replicas x shard groups of {group}")
    if requested == "auto":
        if cpu_offload:
            return shards, "auto: trainer.cpu_offload=true needs fsdp"
        if planned is not None:
            return planned[0].layout(world_size), planned[1]
        return ParallelDims(dp_replicate=world_size), "auto: several devices"
    return (shards if requested == "fsdp" else ParallelDims(dp_replicate=world_size)), "asked for"


def data_wrapper(sizes: ParallelDims, *, cpu_offload: bool = False,
                 reshard_after_forward: bool = True) -> Parallelism:
    """The data-parallel wrapper that the sizes call for, read from them alone (torchtitan's
    rule): state sharded (dp_shard > 1) is FSDP2, HSDP when its shard groups are replicated
    too (dp_replicate > 1); replicas only are DDP; one rank, none. `cpu_offload` and
    `reshard_after_forward` are FSDP's options, not sizes."""
    if sizes.dp_shard > 1 and sizes.dp_replicate > 1:
        return HSDP(reshard_after_forward=reshard_after_forward,
                    shard_group_size=sizes.dp_shard)
    if sizes.dp_shard > 1:
        return FSDP(cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward)
    return DDP() if sizes.dp_replicate > 1 else Parallelism()


def processes_per_node(requested: str, devices: int) -> int:
    """nn.DataParallel drives all of a node's GPUs from one process; the others take one each."""
    return 1 if requested == "dp" else devices
