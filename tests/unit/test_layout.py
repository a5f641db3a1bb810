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


@pytest.mark.parametrize("world,local,overrides,dims,name,label", [
    (1, 1, ["trainer.strategy=auto"], ParallelDims(), "single", "single"),
    (4, 4, ["trainer.strategy=ddp"], ParallelDims(dp_replicate=4), "ddp", "ddp"),
    (4, 4, ["trainer.strategy=auto"], ParallelDims(dp_replicate=4), "ddp", "ddp"),
    (4, 4, ["trainer.strategy=fsdp"], ParallelDims(dp_shard=4), "fsdp", "fsdp"),
    (4, 4, ["trainer.strategy=fsdp", "trainer.cpu_offload=true"], ParallelDims(dp_shard=4),
     "fsdp", "fsdp+offload"),
    (8, 4, ["trainer.strategy=hsdp"], ParallelDims(2, 4), "hsdp", "hsdp"),
    (4, 4, ["trainer.strategy=hsdp", "trainer.shard_group_size=2"], ParallelDims(2, 2), "hsdp",
     "hsdp"),
    (4, 4, ["trainer.strategy=hsdp"], ParallelDims(dp_shard=4), "fsdp", "fsdp"),  # one group
    (2, 1, ["trainer.strategy=hsdp"], ParallelDims(dp_replicate=2), "ddp", "ddp"),  # groups of 1
    (4, 4, ["trainer.tensor_parallel=2"], ParallelDims(1, 2, 2), "fsdp+tp", "fsdp+tp2"),  # auto
    (4, 4, ["trainer.strategy=ddp", "trainer.tensor_parallel=2"], ParallelDims(2, 1, 2),
     "ddp+tp", "ddp+tp2"),
    (8, 4, ["trainer.strategy=hsdp", "trainer.tensor_parallel=2"], ParallelDims(2, 2, 2),
     "hsdp+tp", "hsdp+tp2"),
    (2, 2, ["trainer.tensor_parallel=2"], ParallelDims(tp=2), "tp", "tp2"),
    (4, 4, ["trainer.pipeline_parallel=2"], ParallelDims(dp_replicate=2, pp=2), "ddp+pp",
     "ddp+pp2"),
    (2, 2, ["trainer.pipeline_parallel=2"], ParallelDims(pp=2), "pp", "pp2"),
    (8, 8, ["trainer.strategy=fsdp", "trainer.pipeline_parallel=2", "trainer.tensor_parallel=2"],
     ParallelDims(dp_shard=2, tp=2, pp=2), "fsdp+tp+pp", "fsdp+tp2+pp2"),
    (4, 4, ["trainer.pipeline_parallel=2", "trainer.tensor_parallel=2"],
     ParallelDims(tp=2, pp=2), "tp+pp", "tp2+pp2"),
    # context parallelism: its ranks sum their gradients through the data-parallel wrapper,
    # which the name therefore states even where no data-parallel group is left (cp2, cp4)
    (2, 2, ["trainer.context_parallel=2"], ParallelDims(cp=2), "ddp+cp", "ddp+cp2"),
    (4, 4, ["trainer.context_parallel=4"], ParallelDims(cp=4), "ddp+cp", "ddp+cp4"),
    (4, 4, ["trainer.strategy=ddp", "trainer.context_parallel=2"], ParallelDims(2, 1, cp=2),
     "ddp+cp", "ddp+cp2"),
    (4, 4, ["trainer.strategy=fsdp", "trainer.context_parallel=2"], ParallelDims(1, 2, cp=2),
     "fsdp+cp", "fsdp+cp2"),
    (2, 2, ["trainer.strategy=fsdp", "trainer.context_parallel=2"], ParallelDims(cp=2),
     "fsdp+cp", "fsdp+cp2"),
    (8, 4, ["trainer.strategy=hsdp", "trainer.context_parallel=2"], ParallelDims(2, 2, cp=2),
     "hsdp+cp", "hsdp+cp2"),
    (4, 4, ["trainer.tensor_parallel=2", "trainer.context_parallel=2"],
     ParallelDims(1, 1, 2, cp=2), "fsdp+tp+cp", "fsdp+tp2+cp2"),  # FSDP2 shards over the cp
    (8, 8, ["trainer.strategy=ddp", "trainer.tensor_parallel=2", "trainer.context_parallel=2"],
     ParallelDims(2, 1, 2, cp=2), "hsdp+tp+cp", "hsdp+tp2+cp2"),  # ... whatever was asked
    # a pipeline's stages: their data-parallel processes CP groups
    (4, 4, ["trainer.pipeline_parallel=2", "trainer.context_parallel=2"],
     ParallelDims(pp=2, cp=2), "ddp+cp+pp", "ddp+cp2+pp2"),
    (8, 8, ["trainer.strategy=fsdp", "trainer.pipeline_parallel=2", "trainer.context_parallel=2"],
     ParallelDims(1, 2, pp=2, cp=2), "fsdp+cp+pp", "fsdp+cp2+pp2"),
    (8, 8, ["trainer.pipeline_parallel=2", "trainer.tensor_parallel=2",
            "trainer.context_parallel=2"],
     ParallelDims(1, 1, 2, pp=2, cp=2), "fsdp+tp+cp+pp", "fsdp+tp2+cp2+pp2"),
])
def test_each_strategy_is_a_preset_of_the_sizes(world, local, overrides, dims, name, label):
    """The sizes, and the layout's name read from them (summary.json's `strategy`, the start
    line) and its label (`paratrain plan`'s rows): the names of the layouts without context
    parallelism are the ones they always had."""
    layout = _layout(world, local, *overrides)
    assert layout.dims == dims and layout.dims.world == world
    assert layout.name == name
    assert layout.dims.layout_name(layout.parallelism.data_label, degrees=True) == label
    if dims.cp == 1 or dims.pp > 1:  # the wrapper's own name and label are the layout's
        assert (layout.parallelism.name, layout.parallelism.label) == (name, label)
    if dims.pp > 1:  # the stages run by the pipeline's own sizes: the layout's, CP included
        assert layout.parallelism.dims == dims
    assert layout.why  # every layout says why it is this one


def test_the_wrapper_is_read_from_the_sizes_alone():
    """strategies.data_wrapper: sharded state is FSDP2 (HSDP when the shard groups are replicated
    too), replicas alone DDP, one rank none; FSDP's options ride along, they are not sizes."""
    from paratrain.parallel.strategies import DDP, FSDP, HSDP, Parallelism, data_wrapper
    assert data_wrapper(ParallelDims()) == Parallelism()
    assert data_wrapper(ParallelDims(dp_replicate=4)) == DDP()
    assert data_wrapper(ParallelDims(dp_shard=4), cpu_offload=True) == FSDP(cpu_offload=True)
    assert data_wrapper(ParallelDims(2, 4), reshard_after_forward=False) == \
        HSDP(reshard_after_forward=False, shard_group_size=4)
    # a CP run's wrapper is its preset's, whose ranks the CP groups are taken from
    layout = _layout(4, 4, "trainer.strategy=fsdp", "trainer.context_parallel=2")
    assert layout.parallelism == FSDP() and layout.dims == ParallelDims(1, 2, cp=2)


@pytest.mark.parametrize("overrides,names,shard", [
    (["trainer.strategy=fsdp"], ("dp_replicate", "dp_shard", "tp"), ("dp_shard",)),
    (["trainer.strategy=hsdp", "trainer.shard_group_size=2"], ("dp_replicate", "dp_shard", "tp"),
     ("dp_replicate", "dp_shard")),
    (["trainer.strategy=fsdp", "trainer.context_parallel=2"],
     ("dp_replicate", "dp_shard", "cp", "tp"), ("dp_shard_cp",)),
])
def test_fsdp_and_hsdp_take_their_mesh_from_the_one_built_from_the_sizes(overrides, names, shard):
    """parallelize builds one mesh from the run's sizes (dims.build_mesh) and the wrapper spans its
    data-parallel dimensions (`data_mesh`), on a fake world of 4 as `paratrain plan` runs it."""
    from torch.distributed.tensor import DTensor
    from paratrain.dist import DistEnv
    from paratrain.models import build_model, resolve_model_config
    from paratrain.parallel.fake_world import fake_world
    from paratrain.parallel.parallelize import parallelize
    cfg = TrainConfig.from_yaml(None, ["model.preset=tiny", *overrides])
    layout = _layout(4, 4, *overrides)
    meta = torch.device("meta")
    with fake_world(4), torch.device(meta):
        model = build_model(resolve_model_config(cfg.model, vocab_size=64, seq_length=32))
        parallelize(model, layout.parallelism, DistEnv(world_size=4, local_world_size=4,
                                                       nnodes=1, device=meta),
                    precision="fp32", dims=layout.dims)
        mesh = next(model.parameters()).device_mesh
        assert isinstance(next(model.parameters()), DTensor)
        assert mesh.mesh_dim_names == shard
        assert mesh._get_root_mesh().mesh_dim_names == names
