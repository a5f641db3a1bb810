"""The run plan: everything a run derives from its config, its devices and its data, resolved and
checked once, into one frozen object the workers receive and read.

World and node layout, batch plan (micro-batch, accumulation, global batch), steps per epoch and
in total, the parallelism (from the memory plan when `auto`), precision, threads per rank. It is
built in the calling process before any worker starts; under torchrun / Slurm, where there is no
calling process, each rank builds it the same way (the memory plan's pick comes from rank 0).
Workers derive nothing again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from .config.tree import TrainConfig
from .errors import ConfigError, DataError
from .parallel.dims import ParallelDims
from .parallel.memory_estimate import Choice, Estimate, choose, device_capacity, \
    device_workspace, estimate, pipeline_estimate
from .parallel.layout import resolve_layout
from .parallel.pipeline import check_schedule, resolve_pipeline_parallel
from .parallel.strategies import Parallelism
from .parallel.tensor import check_tp_plan
from .tasks.base import Task


@dataclass(frozen=True)
class RunPlan:
    cfg: TrainConfig
    devices: tuple[str, ...]  # this node's devices; local rank i computes on devices[i]
    nnodes: int
    world_size: int  # processes in the job
    local_world_size: int  # processes on this node
    parallelism: Parallelism
    parallelism_reason: str  # why this one: logged, and `strategy_reason` in summary.json
    dims: ParallelDims  # how the world is factored (pipeline x data-replicate x data-shard x
    # context x tensor)
    activation_checkpointing: bool
    precision: str
    micro_batch: int  # samples per process per micro-step (x GPUs under nn.DataParallel)
    accum: int  # micro-steps per optimizer step
    global_batch: int  # samples per optimizer step, whatever the world size
    steps_per_epoch: int
    total_steps: int
    cpu_threads: int  # torch threads per rank: the cores shared by the ranks on this host
    threads_from: str = "cores"  # what decided cpu_threads: "cores" or "OMP_NUM_THREADS"
    steps_per_batch: int = 1  # optimizer steps per batch of data (rl.num_iterations)

    @property
    def strategy(self) -> str:
        """The layout's name, from its sizes (dims.`layout_name`: ddp, fsdp+cp, fsdp+tp+cp):
        summary.json's `strategy`, the start line, what a snapshot records."""
        return self.dims.layout_name(self.parallelism.data_name)

    @property
    def device_list(self) -> list[torch.device]:
        return [torch.device(d) for d in self.devices]


def make_plan(cfg: TrainConfig, task: Task, *, devices: Sequence[torch.device],
              world_size: int, local_world_size: int, choice: Optional[Choice] = None,
              ranks_on_host: Optional[int] = None) -> RunPlan:
    """The plan of a run of `world_size` processes, `local_world_size` of them on this node.
    `choice`: the memory plan's pick for `auto` (see `auto_choice`); `ranks_on_host`: processes
    of this job that share this machine's cores (several "nodes" on one host), default local."""
    from .launch.environment import cpu_count
    from .parallel.precision import check_precision
    from .records import loggers
    tr = cfg.trainer
    devices = list(devices)
    layout = resolve_layout(tr, world_size=world_size, local_world_size=local_world_size,
                            device=devices[0], planned=choice, num_layers=pipeline_blocks(
                                task, tr.pipeline_parallel) if tr.pipeline_parallel > 1 else None)
    parallelism, why, dims = layout.parallelism, layout.why, layout.dims
    if tr.tensor_parallel > 1 and dims.pp == 1:
        check_tp_plan(task, tr.tensor_parallel)
    check_context_task(task, tr.context_parallel)
    check_precision(tr.precision, devices[0])
    loggers.check_log_config(cfg.log)  # log.wandb=true without wandb: say so now
    replicas = parallelism.replicas_per_process(len(devices))
    # the ranks of a tensor-parallel group read the same samples: the batch is split dp ways
    accum, global_batch = batch_plan(tr.batch_size, dims.dp * replicas, tr.global_batch_size)
    if dims.pp > 1:  # the accumulation micro-batches are the pipeline's
        check_schedule(parallelism, accum, tr.batch_size * dims.dp * replicas)
    repeat = int(task.steps_per_batch)  # each batch trained on this many steps
    per_epoch = steps_per_epoch(len(task.train_ds), global_batch, task,
                                cfg.data.drop_last) * repeat
    ranks_here = ranks_on_host or local_world_size
    return RunPlan(
        cfg=cfg, devices=tuple(str(d) for d in devices),
        nnodes=max(1, world_size // local_world_size),
        world_size=world_size, local_world_size=local_world_size, parallelism=parallelism,
        parallelism_reason=why, dims=dims,
        activation_checkpointing=tr.activation_checkpointing or bool(
            choice is not None and choice.activation_checkpointing),
        precision=tr.precision, micro_batch=tr.batch_size * replicas, accum=accum,
        global_batch=global_batch, steps_per_epoch=per_epoch, steps_per_batch=repeat,
        total_steps=tr.max_steps or tr.epochs * per_epoch,
        **thread_share(cpu_count(), ranks_here, os.environ.get("OMP_NUM_THREADS")))


def thread_share(cores: int, ranks_here: int, omp_num_threads: Optional[str]) -> dict:
    """Torch threads per rank: OMP_NUM_THREADS when set to a positive number (the user's, or
    torchrun's, choice: on a shared machine fewer threads than cores run far faster), else the
    cores this process may use shared by the ranks on this host."""
    if omp_num_threads and omp_num_threads.strip().isdigit() and int(omp_num_threads) > 0:
        return {"cpu_threads": int(omp_num_threads), "threads_from": "OMP_NUM_THREADS"}
    return {"cpu_threads": max(1, cores // max(1, ranks_here)), "threads_from": "cores"}


def auto_choice(cfg: TrainConfig, task: Task, *, world_size: int, device: torch.device,
                local_world_size: int, capacity: Optional[int] = None) -> Optional[Choice]:
    """For `trainer.strategy=auto` on several processes: the memory plan's pick for this device
    (None when auto needs no plan, or the task's model cannot be probed: auto is then ddp); a
    pipeline only when no other layout fits on the device (`auto_pipelines`). `capacity`: the
    device's bytes (default: what it has). One process decides and the others follow: device
    capacities differ a little between ranks."""
    tr = cfg.trainer
    probe = task.memory_probe()
    if tr.strategy != "auto" or world_size == 1 or tr.cpu_offload or probe is None \
            or tr.tensor_parallel > 1 or tr.pipeline_parallel > 1 or tr.context_parallel > 1:
        return None  # auto with tensor parallelism is fsdp (tensor.py), with a pipeline ddp
        # (fsdp with both)
    rows = estimate(probe.build_model, world=world_size, precision=tr.precision,
                    micro_batch=tr.batch_size, seq_length=probe.seq_length,
                    vocab_size=probe.vocab_size, reshard_after_forward=tr.reshard_after_forward,
                    shard_group_size=tr.shard_group_size or local_world_size,
                    frozen_factory=probe.build_frozen, cache=probe.cache,
                    workspace=device_workspace(device),
                    shallow=probe.shallow)
    capacity = device_capacity(device, local_world_size) if capacity is None else capacity
    return choose(rows, capacity, lambda: auto_pipelines(
        cfg, task, world_size=world_size, local_world_size=local_world_size, device=device))


def auto_pipelines(cfg: TrainConfig, task: Task, *, world_size: int, local_world_size: int,
                   device: torch.device) -> Iterator[Estimate]:
    """The pipelines `auto` may fall back on, P = 2 first, then the other divisors of the world
    (ddp over the rest, the config's schedule): each that this config and task can run, as the
    memory plan's row; none for a model that cannot be split (any but the built-in ones)."""
    tr, probe = cfg.trainer, task.memory_probe()
    for pp in range(2, world_size + 1) if probe is not None else ():
        if world_size % pp:
            continue
        try:  # what `trainer.pipeline_parallel=pp` would be refused for, in the same words
            cfg.with_overrides([f"trainer.pipeline_parallel={pp}"])
            pipeline, _ = resolve_pipeline_parallel(
                "auto", pp, schedule=tr.pipeline_schedule, split=None,
                num_layers=pipeline_blocks(task, pp), world_size=world_size,
                local_world_size=local_world_size, device=device)
            accum, _ = batch_plan(tr.batch_size, world_size // pp, tr.global_batch_size)
            check_schedule(pipeline, accum, tr.batch_size * (world_size // pp))
        except ConfigError:
            continue
        yield pipeline_estimate(probe.build_model, pipeline, precision=tr.precision,
                                micro_batch=tr.batch_size, micro_batches=accum,
                                seq_length=probe.seq_length, vocab_size=probe.vocab_size)


def pipeline_blocks(task: Task, pp: int) -> int:
    """The blocks a pipeline splits: the task's own `pipeline_blocks` (the built-in Llama / GPT
    of a task whose spec pipelines); any other model (Hugging Face, a user's module) is refused
    in one line that names it as the user knows it."""
    blocks = task.pipeline_blocks
    if blocks is None:
        from .tasks.user import UserTask
        model = ("your own nn.Module (Trainer(model=...))" if isinstance(task, UserTask) else
                 "a Hugging Face model (model.arch=hf)")
        raise ConfigError(f"trainer.pipeline_parallel={pp} splits the built-in llama / gpt "
                          f"models only; {model} cannot be cut into stages: use "
                          "trainer.pipeline_parallel=1")
    return blocks


def check_context_task(task: Task, cp: int) -> None:
    """Context parallelism cuts the built-in llama / gpt's packed windows (every token a loss
    unit, parallel/context.py); any other task is refused in one line before any worker."""
    from .tasks.pretraining import LMTask
    if cp > 1 and not (isinstance(task, LMTask) and not task.is_hf and task.cfg.task_spec.packed):
        raise ConfigError(f"trainer.context_parallel={cp} splits the packed windows of the "
                          f"built-in llama / gpt only, not {type(task).__name__}'s model; use "
                          "trainer.context_parallel=1")


def steps_per_epoch(n_samples: int, global_batch: int, task: Any = None,
                    drop_last: bool = True) -> int:
    """Optimizer steps in one pass over the training set (`drop_last` False: the short last
    global batch is one more), or a DataError (the task's own words) when the data cannot fill
    one global batch."""
    steps = n_samples // global_batch if drop_last or n_samples < global_batch else \
        -(-n_samples // global_batch)
    if steps < 1:
        raise DataError(task.shortage_message(global_batch) if task is not None else
                        f"{n_samples} samples are fewer than one global batch of {global_batch}")
    return steps


def batch_plan(batch_size: int, world_size: int, global_batch_size: Optional[int]
               ) -> tuple[int, int]:
    """(accumulation micro-steps, global batch). With a global batch the run is the same
    whatever the world size; without one, the global batch grows with the workers."""
    per_step = batch_size * world_size
    if global_batch_size is None:
        return 1, per_step
    if global_batch_size % per_step:
        raise ConfigError(f"trainer.global_batch_size={global_batch_size} is not divisible by "
                          f"trainer.batch_size x workers = {batch_size} x {world_size} = "
                          f"{per_step}; pick a multiple of {per_step}")
    return global_batch_size // per_step, global_batch_size


def check_elastic_batch(batch_size: int, global_batch: int, nproc: int, min_nodes: int,
                        max_nodes: int) -> None:
    """An elastic job keeps its global batch whatever the node count (accumulation makes up the
    rest): refuse, before anything starts, one that some node count in the range cannot split."""
    import math
    worlds = [n * nproc for n in range(min_nodes, max_nodes + 1)]
    bad = [w for w in worlds if global_batch % (batch_size * w)]
    if bad:
        fits = math.lcm(*(batch_size * w for w in worlds))
        raise ConfigError(
            f"trainer.global_batch_size={global_batch} cannot be split evenly over "
            f"{', '.join(map(str, bad))} worker(s) (trainer.batch_size={batch_size} each), world "
            f"sizes that distributed.nnodes={min_nodes}:{max_nodes} allows; use a multiple of "
            f"{fits}")


def check_elastic_layout(pp: int, tp: int, nproc: int, min_nodes: int, max_nodes: int,
                         cp: int = 1) -> None:
    """An elastic job re-plans its layout for each round's world: refuse, before anything
    starts, a pipeline (x tensor x context parallelism) that some node count in the range cannot
    split into equal stages or groups, naming those counts and what would fit."""
    import math
    group = pp * tp * cp  # processes one data-parallel replica spans: its stages, each split
    if group == 1:
        return
    if pp == 1:  # no stages to re-cut: the CP x TP group must divide every world
        counts = range(min_nodes, max_nodes + 1)
        bad = [n for n in counts if (n * nproc) % group]
        if bad:
            good = ", ".join(str(n) for n in counts if n not in bad) or "none in the range"
            raise ConfigError(
                f"trainer.context_parallel={cp}" + (f" x trainer.tensor_parallel={tp}" if tp > 1
                                                     else "")
                + f" needs a world divisible by {group}, but distributed.nnodes={min_nodes}:"
                f"{max_nodes} allows {', '.join(map(str, bad))} node(s) of {nproc} process(es); "
                f"keep the node counts that fit ({good}) or set trainer.context_parallel=1")
        return
    counts = range(min_nodes, max_nodes + 1)
    bad = [n for n in counts if (n * nproc) % group]
    if not bad:
        return
    key = f"trainer.pipeline_parallel={pp}" + (f" x trainer.tensor_parallel={tp}" if tp > 1
                                               else "") + (
        f" x trainer.context_parallel={cp}" if cp > 1 else "")
    good = [n for n in counts if n not in bad]
    common = math.gcd(*(n * nproc for n in counts)) // (tp * cp)
    fits = [d for d in range(1, common + 1) if common % d == 0]
    raise ConfigError(
        f"{key} needs a world divisible by {group}, but distributed.nnodes={min_nodes}:"
        f"{max_nodes} allows {', '.join(map(str, bad))} node(s) of {nproc} process(es) "
        f"({', '.join(str(n * nproc) for n in bad)} processes); "
        + (f"keep the node counts that fit ({', '.join(map(str, good))}) or " if good else "")
        + f"use trainer.pipeline_parallel in {', '.join(map(str, fits))}")
