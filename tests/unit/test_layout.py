"""The run's layout from its keys (parallel/layout.py), without processes: each trainer.strategy
is a preset of the data-parallel sizes, and the tensor, pipeline and context keys set theirs,
for every spelling the keys accept today."""

from __future__ import annotations

import pytest
import torch

from paratrain import TrainConfig
from paratrain.parallel.dims import ParallelDims
from paratrain.parallel.layout import resolve_layout


def _layout(world: int, local: int, *overrides: str):
    tr = TrainConfig.from_yaml(None, ["model.preset=tiny", *overrides]).trainer
    return resolve_layout(tr, world_size=world, local_world_size=local,
                          device=torch.device("cpu"), num_layers=4)


@pytest.mark.parametrize("world,local,overrides,dims,name", [
    (1, 1, ["trainer.strategy=auto"], ParallelDims(), "single"),
    (4, 4, ["trainer.strategy=ddp"], ParallelDims(dp_replicate=4), "ddp"),
    (4, 4, ["trainer.strategy=auto"], ParallelDims(dp_replicate=4), "ddp"),
    (4, 4, ["trainer.strategy=fsdp"], ParallelDims(dp_shard=4), "fsdp"),
    (8, 4, ["trainer.strategy=hsdp"], ParallelDims(2, 4), "hsdp"),
    (4, 4, ["trainer.strategy=hsdp", "trainer.shard_group_size=2"], ParallelDims(2, 2), "hsdp"),
    (4, 4, ["trainer.strategy=hsdp"], ParallelDims(dp_shard=4), "fsdp"),  # one group: fsdp
    (4, 4, ["trainer.tensor_parallel=2"], ParallelDims(1, 2, 2), "fsdp+tp"),  # auto: fsdp
    (4, 4, ["trainer.strategy=ddp", "trainer.tensor_parallel=2"], ParallelDims(2, 1, 2),
     "ddp+tp"),
    (2, 2, ["trainer.tensor_parallel=2"], ParallelDims(tp=2), "tp"),
    (4, 4, ["trainer.pipeline_parallel=2"], ParallelDims(dp_replicate=2, pp=2), "ddp+pp"),
    (8, 8, ["trainer.strategy=fsdp", "trainer.pipeline_parallel=2", "trainer.tensor_parallel=2"],
     ParallelDims(dp_shard=2, tp=2, pp=2), "fsdp+tp+pp"),
    (2, 2, ["trainer.context_parallel=2"], ParallelDims(cp=2), "ddp"),
    (4, 4, ["trainer.strategy=fsdp", "trainer.context_parallel=2"], ParallelDims(1, 2, cp=2),
     "fsdp"),
    (4, 4, ["trainer.tensor_parallel=2", "trainer.context_parallel=2"],
     ParallelDims(1, 1, 2, cp=2), "tp+cp"),
])
def test_each_strategy_is_a_preset_of_the_sizes(world, local, overrides, dims, name):
    layout = _layout(world, local, *overrides)
    assert layout.dims == dims and layout.dims.world == world
    assert layout.parallelism.name == name
    assert layout.why  # every layout says why it is this one
