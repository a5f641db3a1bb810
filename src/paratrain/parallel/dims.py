"""The parallel dimensions of a run: how its world of processes is factored, decided once.

A run's processes form a grid, outermost dimension first:

    pp x dp_replicate x dp_shard x cp x tp        (world = the product)

- `tp`: tensor parallelism. The ranks of one TP group hold slices of the same matrices and see the
  same batch; it is innermost, so a group is consecutive ranks, one node's processes (its
  collectives run every layer and want the fastest links).
- `cp`: context parallelism (parallel/context.py). The ranks of one CP group read the same
  samples and each computes its chunks of every sequence; attention gathers the group's keys and
  values. Their gradients are summed like data parallelism's: the data-parallel wrapper spans
  dp x cp ranks (`dp_cp`), as torchtitan's `dp_shard_cp`.
- `dp_shard`: data parallelism that shards parameters, gradients and optimizer state (FSDP).
- `dp_replicate`: data parallelism that replicates them (DDP, or HSDP's replicas across nodes).
- `pp`: pipeline parallelism (parallel/pipeline.py), outermost: the ranks of one stage are
  consecutive, and stages span nodes, sending only one activation per micro-batch between them.
  Every stage reads the same samples (the first needs the inputs, the last the targets); only
  the last computes the loss, so only its ranks count sums.

Everything that asks "which data does this rank read, and does its loss count" asks this object:
the samplers read `data_rank`/`dp`, the loss scale divides by `dp_cp`, and only the first rank of
each TP group adds its loss sums (the others computed the same numbers; the ranks of a CP group
computed different tokens, and all count). The DeviceMesh is built from it once per process
(`build_mesh`), with these names (a dimension of size 1 other than the named three left out),
and sliced by name. A strategy (ddp, fsdp, hsdp, tensor parallelism) is a preset of these sizes
(its `layout`); `with_context` takes the CP groups out of its data-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import ConfigError

MESH_NAMES = ("dp_replicate", "dp_shard", "tp")  # the mesh of a stage; `pp` goes before
MESH_NAMES_CP = ("dp_replicate", "dp_shard", "cp", "tp")  # with context parallelism


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1  # pipeline stages (outermost; a keyword: the older positional form stays)
    cp: int = 1  # context parallelism: ranks that split each sequence (between dp_shard and tp)

    def __post_init__(self) -> None:
        if min(self.shape) < 1 or self.pp < 1 or self.cp < 1:
            raise ValueError(f"parallel degrees must be >= 1, got {self}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid of one pipeline stage (the whole world without pipeline parallelism), in
        the order of `mesh_names`."""
        if self.cp > 1:
            return (self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return (self.dp_replicate, self.dp_shard, self.tp)

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return MESH_NAMES_CP if self.cp > 1 else MESH_NAMES

    @property
    def world(self) -> int:
        return self.pp * math.prod(self.shape)

    @property
    def stage_world(self) -> int:
        """Processes of one pipeline stage."""
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches one micro-step computes."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks of a stage whose gradients the data-parallel wrapper averages: the data-parallel
        ones and, inside each, its CP group (whose ranks hold different tokens of one batch)."""
        return self.dp * self.cp

    @property
    def tensor_parallel(self) -> bool:
        return self.tp > 1

    def data_rank(self, rank: int) -> int:
        """Which slice of the global batch `rank` reads: the ranks of a TP group read the same,
        so do those of a CP group (each takes its chunks of the sequences), and the stages of a
        pipeline."""
        return (rank % self.stage_world) // (self.cp * self.tp)

    def cp_rank(self, rank: int) -> int:
        """The rank's place in its CP group: which chunks of each sequence it computes."""
        return (rank // self.tp) % self.cp

    def with_context(self, cp: int) -> "ParallelDims":
        """These sizes with `cp` of their data-parallel ranks turned into a CP group each: from
        dp_shard first (FSDP then shards over dp_shard x cp, as before), then dp_replicate.
        Unchanged when cp is 1 or already set."""
        if cp == 1 or self.cp == cp:
            return self
        shard = math.gcd(self.dp_shard, cp)
        rest = cp // shard
        if self.dp_replicate % rest:
            fits = _text([d for d in range(1, self.dp + 1) if self.dp % d == 0])
            raise ConfigError(f"trainer.context_parallel={cp} does not divide the {self.dp} "
                              f"data-parallel process(es) of this run ({self.label}, "
                              f"{self.world} in all); use one of {fits}, or more processes")
        return ParallelDims(self.dp_replicate // rest, self.dp_shard // shard, self.tp,
                            pp=self.pp, cp=cp)

    def pp_rank(self, rank: int) -> int:
        """Which pipeline stage `rank` runs (the first of them, under an interleaved schedule)."""
        return rank // self.stage_world

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def reports_sums(self, rank: int) -> bool:
        """Whether this rank's loss sums and sample counts are added up: one rank per TP group
        (its peers computed the same numbers from the same batch), on the pipeline's last stage
        (where the loss is)."""
        return self.tp_rank(rank) == 0 and self.pp_rank(rank) == self.pp - 1

    def shard_rank(self, rank: int) -> int:
        """The rank's coordinate on the data-sharding dimension (which FSDP shard it holds)."""
        return (rank // (self.cp * self.tp)) % self.dp_shard

    def build_mesh(self, device_type: str) -> Any:
        """The (dp_replicate, dp_shard[, cp], tp) DeviceMesh of this run. Collective: every rank
        calls it once, and every parallel piece slices this one mesh (FSDP requires the data and
        tensor meshes to share a root)."""
        from torch.distributed.device_mesh import init_device_mesh
        names, shape = self.mesh_names, self.shape
        if self.pp > 1:  # a pipeline's stages slice their dimensions from it by name, as without
            names, shape = ("pp", *names), (self.pp, *shape)
        mesh = init_device_mesh(mesh_device_type(device_type), shape, mesh_dim_names=names)
        if self.cp > 1:  # the data-parallel wrapper shards (or replicates) over dp_shard x cp
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if self.tp > 1:
            # A value partial over both (a gradient norm under FSDP x TP) is then reduced in one
            # all-reduce instead of one per dimension: DTensor uses a flattened mesh it finds.
            inner = ("dp_shard", "cp", "tp") if self.cp > 1 else ("dp_shard", "tp")
            mesh[inner]._flatten("_".join(inner))
        return mesh

    def data_mesh(self, mesh: Any, *, both: bool = False) -> Any:
        """The data-parallel wrapper's dimensions of this run's `mesh` (`data_names`): the
        shards' alone when nothing replicates them (FSDP), else (replicas, shards) (HSDP; `both`:
        always, as FSDP2 beside TP takes them). A flattened dimension (dp_shard_cp) is sliced from
        the root, which torch 2.13 warns it will one day ask callers to keep themselves: quiet
        here, where it is expected, as it is for the run's user."""
        import warnings
        names = self.data_names if both or self.dp_replicate > 1 else self.data_names[1:]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return mesh[names]

    @property
    def data_names(self) -> tuple[str, str]:
        """The mesh dimensions the data-parallel wrapper spans: (replicate, shard)."""
        return ("dp_replicate", "dp_shard_cp" if self.cp > 1 else "dp_shard")

    def layout_name(self, data: str, *, degrees: bool = False) -> str:
        """The layout's name, read from these sizes (summary.json's `strategy`, the start line,
        `paratrain plan`'s rows with `degrees`): the data-parallel wrapper's name (`data`: ddp,
        fsdp, hsdp; fsdp+offload in a label) when it spans more than one rank of a stage (dp x
        cp: the ranks of a CP group sum their gradients through it too), then each other
        dimension above one, tp, cp, pp: fsdp, ddp+cp, fsdp+tp, fsdp+tp+cp, ddp+pp, tp, cp;
        with `degrees` each of those with its size, fsdp+tp2+cp2. One process: `data`
        (single, or dp)."""
        parts = [data] if self.dp_cp > 1 else []
        parts += [f"{n}{getattr(self, n) if degrees else ''}" for n in ("tp", "cp", "pp")
                  if getattr(self, n) > 1]
        return "+".join(parts) or data

    @property
    def label(self) -> str:
        """e.g. `pp=2 x dp_replicate=2`, the dimensions above one."""
        parts = [f"{n}={d}" for n, d in self.to_dict().items() if d > 1]
        return " x ".join(parts) or "one process"

    def to_dict(self) -> dict:
        """Every size, `cp` only when it is set (summary.json's `parallel_dims`)."""
        return {"pp": self.pp, **dict(zip(self.mesh_names, self.shape))}


def mesh_device_type(device_type: str) -> str:
    """The device type a mesh is built for: a model on the meta device (the plan's simulation,
    parallel/simulate.py) meets its collectives on a CPU group (torch's fake one there)."""
    return "cpu" if device_type == "meta" else device_type


def check_tensor_parallel(tp: int, *, world: int, local_world: int,
                          shard_group: Optional[int] = None, heads: Sequence[int] = ()) -> None:
    """One ConfigError line when `trainer.tensor_parallel=tp` cannot split this job's processes:
    it must divide the processes of a node (a TP group never spans nodes), and so the world, and
    an HSDP shard group. (That it divides the attention heads is checked with the model's shape:
    config.checks.check_tp_heads; `heads`, when known here, keeps the values suggested to
    those that pass that check too.)"""
    if tp == 1:
        return
    key = f"trainer.tensor_parallel={tp}"
    fits = _text([d for d in range(1, local_world + 1)
                  if local_world % d == 0 and world % d == 0
                  and (shard_group is None or shard_group % d == 0)
                  and all(h % d == 0 for h in heads)])
    if tp > local_world:
        raise ConfigError(f"{key} is more than the {local_world} process(es) per node: a "
                          f"tensor-parallel group stays inside a node; use one of {fits}")
    if local_world % tp:
        raise ConfigError(f"{key} does not divide the {local_world} processes per node; use "
                          f"one of {fits}")
    if world % tp:  # a node count that does not fit cannot happen once tp | local; kept honest
        raise ConfigError(f"{key} does not divide the world of {world} processes; use one of "
                          f"{fits}")
    if shard_group is not None and shard_group % tp:
        raise ConfigError(f"trainer.shard_group_size={shard_group} is not a multiple of {key}: "
                          "an HSDP shard group holds whole tensor-parallel groups")


def check_pipeline_parallel(pp: int, *, world: int, tp: int = 1,
                            max_stages: Optional[int] = None) -> None:
    """One ConfigError line when `trainer.pipeline_parallel=pp` cannot split this job's
    processes into equal stages. The values suggested pass the other checks of the key too:
    each stage holds whole tensor-parallel groups of `tp`, and at most `max_stages` (the
    model's blocks over the schedule's stages per process) fit."""
    if pp > 1 and world % pp:
        fits = [d for d in range(1, world + 1) if world % d == 0 and (world // d) % tp == 0
                and (max_stages is None or d <= max_stages)]
        raise ConfigError(f"trainer.pipeline_parallel={pp} does not divide the world of {world} "
                          f"processes into equal stages; use one of {_text(fits)}")


def check_context_parallel(cp: int, *, world: int, tp: int = 1, pp: int = 1) -> None:
    """One ConfigError line when `trainer.context_parallel=cp` cannot split this job's
    processes: each CP group of cp x tp processes (a TP group per chunk), in each of the `pp`
    pipeline stages, must divide the world, before anything is prepared (the sequence's side is
    config.checks')."""
    inner = tp * pp  # the processes of a CP rank: its TP group, in every stage
    if cp > 1 and world % (cp * inner):
        fits = _text([d for d in range(1, world // inner + 1) if (world // inner) % d == 0]) \
            if world % inner == 0 else "1"
        group = f"{cp}" + "".join(f" x trainer.{k}={v}" for k, v in
                                  (("tensor_parallel", tp), ("pipeline_parallel", pp)) if v > 1)
        group += f" = {cp * inner}" if inner > 1 else ""
        raise ConfigError(f"trainer.context_parallel={cp} needs a world divisible by {group} "
                          f"processes, but this run has {world}; use trainer.context_parallel "
                          f"in {fits}, or more devices")


def _text(values: Sequence[int]) -> str:
    return ", ".join(map(str, values)) or "1"
