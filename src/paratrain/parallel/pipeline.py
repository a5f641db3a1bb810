"""Pipeline parallelism: consecutive blocks of the model on different processes, kept busy by a
schedule of micro-batches (torch.distributed.pipelining), with data and tensor parallelism over
the rest.

`trainer.pipeline_parallel=P` cuts a built-in Llama / GPT at block boundaries into stages (the
embedding on the first, the final norm, the output projection and the loss on the last; how many
blocks each: config.checks.pipeline_split). Stage s runs on the ranks of pipeline coordinate
s mod P (interleaved-1f1b gives each process 2 stages, s and s + P); only one activation per
micro-batch crosses between stages, which is why the pipeline dimension is outermost in the mesh
(parallel/dims.py): it may span slow links between nodes.

The global-batch contract holds as in the loop: the schedule's micro-batches are the batch plan's
accumulation micro-batches (the same samples, split the same way), and the last stage's loss
function returns sum(token losses) x dp / (tokens in the global batch), the loop's scale, so the
gradients are those of one process (torch's own 1/M scaling is off). Loss sums live on the last
stage; the loop's all-reduce of (sum, count) brings them to rank 0's log (dims.reports_sums).

Inside a stage, the stage's processes parallelize its part as they would a whole model
(`parallelize`: TP -> activation checkpointing -> compile -> FSDP2), on the stage's slice of the
run's one mesh (pp x dp_replicate x dp_shard x tp), as torchtitan composes PP x FSDP x TP. An
FSDP2 part (fsdp, hsdp, tensor parallelism) is reduced by the schedule itself, once per step
after its last micro-batch's backward (PipelineStage.perform_reduce_grad); tensor parallelism's
sequence-split stream crosses between stages as a DTensor (each TP rank sends its slice).
Context parallelism (`trainer.context_parallel=C`, parallel/context.py) makes each stage's
data-parallel processes CP groups: `parallelize` sets the part's attention on the stage's `cp`
slice of the mesh, `_run` cuts every micro-batch into the rank's head-tail chunks before the
first stage (the targets on the last), and replicas average their gradients over dp x cp.

Each rank keeps its part of the model as a `ModelPart` under the whole model's names
(`layers.5.attention.wq.weight`), so the optimizer, snapshots (DCP) and the final model/ see a
piece of the one model, sharded or split like any other: a snapshot moves between pipeline and
data-parallel layouts as is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..config.checks import PIPELINE_SCHEDULES, pipeline_split
from ..data.dataset import IGNORE_INDEX
from ..dist import DistEnv
from ..errors import ConfigError
from ..models.attention import WHOLE
from .context import context_split
from .dims import ParallelDims, check_pipeline_parallel
from .pipeline_schedules import schedule_class
from .parallelize import parallelize
from .strategies import FSDP, Parallelism, resolve_parallelism
from .tensor import builtin_plan, resolve_tensor_parallel


@dataclass(frozen=True)
class PipelineParallel(Parallelism):
    """`trainer.pipeline_parallel=P`: `split[s]` blocks in stage s, run by `schedule`, and
    `data` over the dims.stage_world processes of each stage: ddp (replicas whose gradients are
    averaged after each step's schedule, `Pipeline._average_gradients`), fsdp / hsdp, tensor
    parallelism (with any of those), or single."""
    dims: ParallelDims = field(default_factory=ParallelDims)
    data: Parallelism = field(default_factory=Parallelism)
    schedule: str = "1f1b"
    split: tuple[int, ...] = ()  # blocks per stage, in stage order

    @property
    def name(self) -> str:  # type: ignore[override]
        """Every dimension above one, read from the sizes (dims.`layout_name`): pp, ddp+pp,
        fsdp+tp+pp."""
        return self.dims.layout_name(self.data.data_name)

    @property
    def label(self) -> str:
        """With the degrees: pp2, ddp+pp2, fsdp+tp2+pp2."""
        return self.dims.layout_name(self.data.data_label, degrees=True)

    @property
    def data_name(self) -> str:
        return self.data.data_name

    @property
    def data_label(self) -> str:
        return self.data.data_label

    def layout(self, world: int) -> ParallelDims:
        return self.dims

    def with_context(self, cp: int) -> "PipelineParallel":
        """This pipeline with `cp` of each stage's data-parallel processes made CP groups."""
        return dataclasses.replace(self, dims=self.dims.with_context(cp))

    @property
    def stage_parallelism(self) -> Parallelism:
        """What parallelizes each stage's part as it would a whole model: fsdp, hsdp and tensor
        parallelism (FSDP2 over TP) make FSDP2 modules, which the schedule reduces. Replicas
        (ddp) stay plain modules: DDP's wrapper cannot run the stand-in forward the stages set
        themselves up with; `Pipeline` averages their gradients itself."""
        return self.data if isinstance(self.data, FSDP) else Parallelism()

    def parallelize_part(self, part: nn.Module, env: DistEnv, mesh: Any, *, precision: str,
                         activation_checkpointing: bool = False, compile: bool = False) -> None:
        """One stage's part parallelized on the run's `mesh` as a whole model would be (TP ->
        activation checkpointing -> compile -> FSDP2), each step slicing its dimensions by name
        from the stage's coordinate of the one mesh: the run's way, and the plan's."""
        parallelize(part, self.stage_parallelism, env, precision=precision, compile=compile,
                    activation_checkpointing=activation_checkpointing, mesh=mesh,
                    dims=self.dims)

    def autocast(self, precision: str, device: torch.device) -> ContextManager:
        return self.data.autocast(precision, device)  # FSDP2's policy casts, not autocast

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` runs: its pipeline coordinate, and P further per virtual stage."""
        first = self.dims.pp_rank(rank)
        return list(range(first, len(self.split), self.dims.pp))

    def roles(self, world: int) -> dict[int, str]:
        return {r: "pipeline stage " + ", ".join(map(str, self.stages_of(r)))
                for r in range(world)}

    def blocks_of(self, stage: int) -> list[int]:
        start = sum(self.split[:stage])
        return list(range(start, start + self.split[stage]))

    def full_state_dict(self, model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
        """Every stage's part, gathered on rank 0 from the first rank of each stage (a sharded or
        split parameter is first gathered whole over its stage's processes): the whole model
        under its own names."""
        import torch.distributed as dist
        with torch.no_grad():  # full_tensor: collective over the stage's processes
            whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                     for k, v in model.state_dict().items()}
        mine = whole if env.rank % self.dims.stage_world == 0 else {}
        parts: Optional[list] = [None] * env.world_size if env.is_master else None
        dist.gather_object(mine, parts, dst=0)  # our own processes' tensors
        return {k: v for part in parts for k, v in part.items()} if parts else {}

    def state_numel(self, shape: torch.Size, world: int, rank: int = 0) -> int:
        raise NotImplementedError("a pipeline stage holds whole layers, not a share of each: "
                                  "count the stage's own parameters")


def resolve_pipeline_parallel(requested: str, pp: int, *, schedule: str,
                              split: Optional[Sequence[int]], num_layers: int, world_size: int,
                              local_world_size: int, device: torch.device, tp: int = 1,
                              reshard_after_forward: bool = True,
                              shard_group_size: Optional[int] = None, cp: int = 1
                              ) -> tuple[PipelineParallel, str]:
    """(parallelism, why) for `trainer.pipeline_parallel=pp`: the stages' blocks, and what
    parallelizes each stage over its world / pp processes, resolved as it would be for a whole
    world of that many (`auto`: ddp; with tensor parallelism, fsdp over the data-parallel rest),
    fixed in one ParallelDims with the pipeline outermost (and `cp` of each stage's
    data-parallel processes made context-parallel groups: parallel/context.py)."""
    check_pipeline_parallel(pp, world=world_size, tp=tp,
                            max_stages=num_layers // PIPELINE_SCHEDULES[schedule])
    stage_world = world_size // pp
    kw: dict = dict(world_size=stage_world, device=device,
                    # a stage's processes on one node: the node's, or its share of the stages
                    local_world_size=math.gcd(local_world_size, stage_world),
                    reshard_after_forward=reshard_after_forward, shard_group_size=shard_group_size)
    data, why = resolve_tensor_parallel(requested, tp, **kw) if tp > 1 else \
        resolve_parallelism("ddp" if requested == "auto" else requested, **kw)
    stage = data.layout(stage_world)
    dims = ParallelDims(stage.dp_replicate, stage.dp_shard, stage.tp, pp=pp).with_context(cp)
    blocks = pipeline_split(num_layers, pp, schedule, split)
    return (PipelineParallel(dims=dims, data=data, schedule=schedule, split=blocks),
            f"{why if stage_world > 1 else 'no data parallelism left'}; a pipeline of {pp} "
            f"stages, {stage_world} process(es) each ({schedule}, blocks per stage "
            f"{list(blocks)})")


def check_schedule(parallelism: PipelineParallel, micro_batches: int,
                   per_step: Optional[int] = None) -> None:
    """The schedule must be able to run `micro_batches` (the accumulation micro-steps): at
    least one per stage (torch's schedules refuse fewer, in a worker), and interleaved-1f1b
    runs them P at a time. `per_step`: sequences of one micro-step over the data-parallel
    processes, to name the global batch that works."""
    pp = parallelism.dims.pp
    if micro_batches < pp:
        fix = (f"set trainer.global_batch_size={pp * per_step} (or a larger multiple of "
               f"{per_step})" if per_step else "raise trainer.global_batch_size")
        raise ConfigError(f"trainer.pipeline_parallel={pp} needs at least {pp} micro-batches per "
                          f"step (one per stage), this run has {micro_batches} (trainer."
                          "global_batch_size / (trainer.batch_size x data-parallel processes)); "
                          + fix)
    rounds = max(1, micro_batches // pp)
    if PIPELINE_SCHEDULES[parallelism.schedule] > 1 and micro_batches % rounds:
        raise ConfigError(f"trainer.pipeline_schedule={parallelism.schedule} runs the "
                          f"{micro_batches} micro-batches of a step in rounds of {pp}: make the "
                          f"accumulation micro-steps (trainer.global_batch_size / "
                          f"(trainer.batch_size x data-parallel processes)) a multiple of {pp}")


class ModelPart(nn.Module):
    """Some blocks of a built-in model, with its embedding when `first` and its head when `last`,
    under the whole model's names. Its forward is that of the model's piece: the model class's
    own `embed` / `head` run on this part (they read only the modules the class names in
    `pipeline_input` / `pipeline_output`, which the part holds under the same names)."""
    context = WHOLE  # the whole sequence on each stage (models/attention.py)

    def __init__(self, model: nn.Module, blocks: Sequence[int], *, first: bool, last: bool,
                 amp: Callable[[], ContextManager] = contextlib.nullcontext):
        super().__init__()
        self.arch, self.args, self.first, self.last, self.amp = \
            type(model), model.args, first, last, amp
        for name in model.pipeline_input if first else ():
            self.add_module(name, getattr(model, name))
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in blocks})
        for name in model.pipeline_output if last else ():
            self.add_module(name, getattr(model, name))

    @property
    def tp_plan(self) -> dict:
        """The model's tensor-parallel plan (parallel/tensor.py), less the entries for modules
        this part does not hold: its modules have the whole model's names."""
        held = dict(self.named_children())
        return {name: style for name, style in (builtin_plan(self.arch) or {}).items()
                if name.split(".")[0] in held}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T) token ids on the first stage, else (B, T, C) activations
        with self.amp():
            if self.first:
                x = self.arch.embed(self, x)  # (B, T, C)
            for block in self.layers.values():
                x = block(x)  # (B, T, C)
            return self.arch.head(self, x) if self.last else x  # (B, T, V) or (B, T, C)


def _replica_group(mesh: Any, dims: ParallelDims) -> Any:
    """The process group over which a replicated stage averages its gradients: its
    data-parallel replicas, with each one's CP group when there is one (whose ranks computed
    different tokens of the same samples)."""
    if dims.cp == 1:
        return mesh["dp_replicate"].get_group()
    return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp").get_group()


class _ScaledLoss:
    """The last stage's loss per micro-batch: `loss_sum(logits, targets, smoothing)` x scale,
    the unscaled sums kept for the log."""

    def __init__(self, loss_sum: Callable[..., torch.Tensor]):
        self.loss_sum = loss_sum
        self.scale, self.smoothing, self.sums = 1.0, 0.0, []

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.loss_sum(logits, targets, self.smoothing)
        self.sums.append(s.detach().double())
        return s * self.scale


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through them.
    `model` holds this rank's part of the model (what the optimizer and snapshots see)."""

    def __init__(self, parallelism: PipelineParallel, model: nn.Module, env: DistEnv, *,
                 micro_batches: int, precision: str, label_smoothing: float,
                 loss_sum: Callable[..., torch.Tensor], activation_checkpointing: bool = False,
                 compile: bool = False):
        from torch.distributed.pipelining import PipelineStage
        dims, self.env = parallelism.dims, env
        mesh = dims.build_mesh(env.device.type)
        self.pp_group = mesh["pp"].get_group()
        ids, n = parallelism.stages_of(env.rank), len(parallelism.split)
        self.has_first, self.has_last = 0 in ids, n - 1 in ids

        def amp() -> ContextManager:
            return parallelism.autocast(precision, env.device)

        # what this rank holds, under the whole model's names (the optimizer, snapshots and
        # model/ read it): the parts' own modules, seen before checkpointing / compile wrap them
        self.model = ModelPart(model, [b for s in ids for b in parallelism.blocks_of(s)],
                               first=self.has_first, last=self.has_last)
        parts = [ModelPart(model, parallelism.blocks_of(s), first=s == 0, last=s == n - 1, amp=amp)
                 for s in ids]
        for part in parts:
            parallelism.parallelize_part(part, env, mesh, precision=precision, compile=compile,
                                         activation_checkpointing=activation_checkpointing)
        # FSDP2 parts are reduced by the schedule (over dp x cp); replicas average their
        # gradients here, over the data-parallel ranks and each one's CP group
        replicas = dims.dp_cp > 1 and not isinstance(parallelism.stage_parallelism, FSDP)
        self.dp_group = _replica_group(mesh, dims) if replicas else None
        self.split = context_split(dims, env.rank)  # a CP rank's chunks of each sequence
        # a DTensor sent between stages (TP's stream) is rebuilt on the receiver's own slice
        stages = [PipelineStage(p, s, n, env.device, group=self.pp_group,
                                get_mesh=lambda names, layout: mesh[names])
                  for p, s in zip(parts, ids)]
        self.loss = _ScaledLoss(loss_sum)
        self.label_smoothing, self.micro_batches = label_smoothing, micro_batches
        kind = schedule_class(parallelism.schedule)
        self.schedule = kind(stages if len(stages) > 1 else stages[0],
                             n_microbatches=micro_batches, loss_fn=self.loss, scale_grads=False)

    def train_step(self, micro: list[dict], scale: float) -> tuple[torch.Tensor, int]:
        """Forward and backward of a step's micro-batches; (sum of token losses, tokens) on the
        last stage, (0, 0) elsewhere."""
        out = self._run(self.schedule.step, micro, scale, self.label_smoothing)
        if self.dp_group is not None:
            self._average_gradients()
        return out

    def _average_gradients(self) -> None:
        """The mean of the stage's gradients over its data-parallel replicas (DDP's), in one
        all-reduce of all of them flattened."""
        import torch.distributed as dist
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.flatten() for g in grads])  # (numel of this rank's part,)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        for g, mean in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(mean.view_as(g))

    @torch.no_grad()
    def evaluate(self, batches: list[Optional[dict]], rows: int, seq_length: int
                 ) -> tuple[float, int]:
        """Forward only, `micro_batches` at a time: this rank's validation batches (None: none
        left), each padded to `rows` rows of ignored targets, so every call has the shapes the
        stages were built with. (sum of token losses, tokens) on the last stage."""
        pad = {"input_ids": torch.zeros(rows, seq_length, dtype=torch.long),
               "targets": torch.full((rows, seq_length), IGNORE_INDEX, dtype=torch.long)}
        full = [pad if mb is None else {k: torch.cat([mb[k], pad[k][len(mb[k]):]])
                                        for k in pad} for mb in batches]
        full += [pad] * (-len(full) % self.micro_batches)
        total, count = 0.0, 0
        for i in range(0, len(full), self.micro_batches):
            s, c = self._run(self.schedule.eval, full[i:i + self.micro_batches], 1.0, 0.0)
            total, count = total + float(s), count + c
        return total, count

    def _run(self, run: Callable, micro: list[dict], scale: float, smoothing: float
             ) -> tuple[torch.Tensor, int]:
        dev = self.env.device
        if self.split is not None:  # this CP rank's chunks of each sequence, before the first
            micro = [self.split.batch(mb) for mb in micro]  # stage (the targets on the last)
        ids = torch.cat([mb["input_ids"] for mb in micro]).to(dev)  # (M*B, T/C): split M ways
        targets = torch.cat([mb["targets"] for mb in micro]).to(dev)  # (M*B, T/C)
        self.loss.scale, self.loss.smoothing, self.loss.sums = scale, smoothing, []
        run(*((ids,) if self.has_first else ()),
            **({"target": targets} if self.has_last else {}), return_outputs=False)
        if not self.has_last:
            return torch.zeros((), dtype=torch.float64), 0
        # the micro-batches' own losses: the first step also calls the loss function once on a
        # stand-in output, while the stages set themselves up (shape inference)
        sums = self.loss.sums[-len(micro):]
        return torch.stack(sums).sum(), int((targets != IGNORE_INDEX).sum())

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: this rank's stages' squared norm,
        summed over the pipeline (a stage's data-parallel replicas hold the same gradients;
        sharded or split ones are DTensors, whose norm is reduced over the stage's processes)."""
        import torch.distributed as dist
        params = [p for p in self.model.parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(local, "full_tensor"):
            local = local.full_tensor()
        squared = local.float().pow(2)
        dist.all_reduce(squared, group=self.pp_group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total
