"""A run's layout, decided once from its sizes: the one place the parallel keys meet.

The layout is the set of sizes of parallel/dims.py, pp x dp_replicate x dp_shard x cp x tp; the
keys name them directly (`trainer.pipeline_parallel`, `trainer.tensor_parallel`,
`trainer.context_parallel`), and `trainer.strategy` is a preset for the data-parallel processes
left over (world / (pp x tp)):

    ddp     every one a replica                dp_replicate = rest
    fsdp    every one a shard                  dp_shard = rest
    hsdp    replicas of shard groups           dp_replicate x dp_shard = rest / group x group
    dp      one process drives every GPU       (nn.DataParallel; no mesh)
    auto    ddp, or the memory plan's pick; fsdp under tensor parallelism

Context parallelism then takes its groups out of the data-parallel processes (`with_context`:
a CP=2 run of 2 processes under ddp is dp_replicate 1 x cp 2). `resolve_layout` returns the
sizes with the wrapper that applies them, read from the sizes (strategies.`data_wrapper`;
tensor.py's and pipeline.py's around it, which `parallelize` runs in its fixed order on one mesh
built from the sizes) and the reason, for the frozen run plan (runplan.py) to carry; nothing
downstream decides a layout again. The layout's name is read from the sizes too
(dims.`layout_name`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from .dims import ParallelDims
from .pipeline import PipelineParallel, resolve_pipeline_parallel
from .strategies import Parallelism, resolve_data
from .tensor import resolve_tensor_parallel


@dataclass(frozen=True)
class Layout:
    """The sizes, the wrapper that applies them and why this one (logged, and summary.json's
    `strategy_reason`)."""
    dims: ParallelDims
    parallelism: Parallelism
    why: str

    @property
    def name(self) -> str:
        """The layout's name from its sizes (dims.`layout_name`): ddp, fsdp+cp, fsdp+tp+cp..."""
        return self.dims.layout_name(self.parallelism.data_name)


def resolve_layout(tr: Any, *, world_size: int, local_world_size: int, device: torch.device,
                   num_layers: Optional[int] = None, planned: Any = None) -> Layout:
    """The layout of `world_size` processes under the trainer section `tr`'s keys. Each size
    is resolved from the outermost: a pipeline resolves what runs each of its stages (TP, then
    the strategy's preset) for the world of one stage; tensor parallelism the strategy's preset
    for the world / tp data-parallel processes; the preset alone the rest. `num_layers`: the
    blocks a pipeline splits (runplan.pipeline_blocks); `planned`: `auto`'s memory-plan pick
    (a memory_estimate.Choice), a pipeline when no other layout fits."""
    kw: dict = dict(world_size=world_size, local_world_size=local_world_size, device=device,
                    reshard_after_forward=tr.reshard_after_forward,
                    shard_group_size=tr.shard_group_size)
    if planned is not None and isinstance(planned.parallelism, PipelineParallel):
        parallelism, why = planned.parallelism.with_context(tr.context_parallel), planned.why
        # (auto's last resort, with trainer.context_parallel's CP groups in each stage)
    elif tr.pipeline_parallel > 1:
        parallelism, why = resolve_pipeline_parallel(
            tr.strategy, tr.pipeline_parallel, schedule=tr.pipeline_schedule,
            split=tr.pipeline_split, num_layers=num_layers, tp=tr.tensor_parallel,
            cp=tr.context_parallel, **kw)
    elif tr.tensor_parallel > 1:
        parallelism, why = resolve_tensor_parallel(tr.strategy, tr.tensor_parallel,
                                                   cp=tr.context_parallel, **kw)
    else:  # the preset's sizes, and the wrapper they call for
        sizes, parallelism, why = resolve_data(
            tr.strategy, cpu_offload=tr.cpu_offload,
            planned=(planned.parallelism, planned.why) if planned is not None else None, **kw)
        return Layout(dims=sizes.with_context(tr.context_parallel), parallelism=parallelism,
                      why=why)
    # trainer.context_parallel of the data-parallel ranks as CP groups (resolved within TP's)
    dims = parallelism.layout(world_size).with_context(tr.context_parallel)
    return Layout(dims=dims, parallelism=parallelism, why=why)
