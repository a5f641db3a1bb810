"""Tensor parallelism without real processes: how `trainer.tensor_parallel` resolves into one
ParallelDims, the one-line refusals, and what the plans make of each parameter, read from the
real split model inside torch's fake process group (no communication)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from paratrain import TrainConfig
from paratrain.dist import DistEnv
from paratrain.errors import ConfigError
from paratrain.models import build_model, resolve_model_config
from paratrain.parallel.dims import ParallelDims, check_tensor_parallel
from paratrain.parallel.fake_world import fake_world
from paratrain.parallel.strategies import DDP, FSDP, HSDP, Parallelism
from paratrain.parallel.tensor import TensorParallel, check_tp_plan, resolve_tensor_parallel, \
    split_tensor_parallel
from tests.conftest import cli_error

CPU = torch.device("cpu")


def resolve(requested="fsdp", tp=2, world=4, local=4, group=None):
    return resolve_tensor_parallel(requested, tp, world_size=world, local_world_size=local,
                                   device=CPU, shard_group_size=group)


def test_every_parallelism_states_its_dimensions():
    assert Parallelism().layout(1) == ParallelDims()
    assert DDP().layout(4) == ParallelDims(dp_replicate=4)
    assert FSDP().layout(4) == ParallelDims(dp_shard=4)
    assert HSDP(shard_group_size=2).layout(8) == ParallelDims(dp_replicate=4, dp_shard=2)


@pytest.mark.parametrize("requested, world, local, name, shape", [
    ("fsdp", 4, 4, "fsdp+tp", (1, 2, 2)),
    ("auto", 4, 4, "fsdp+tp", (1, 2, 2)),  # auto with TP shards the data-parallel rest
    ("ddp", 4, 4, "ddp+tp", (2, 1, 2)),
    ("hsdp", 8, 4, "hsdp+tp", (2, 2, 2)),  # 2 nodes of 4: shard within, replicate across
    ("fsdp", 2, 2, "tp", (1, 1, 2)),  # nothing left for data parallelism
])
def test_tensor_parallel_resolves_once_into_dimensions(requested, world, local, name, shape):
    p, why = resolve(requested, world=world, local=local)
    assert isinstance(p, TensorParallel) and p.name == name and p.dims.shape == shape
    assert p.layout(world) is p.dims and "tensor parallel over 2 processes" in why


def test_a_tp_group_reads_one_slice_of_the_batch_and_counts_it_once():
    dims = ParallelDims(dp_shard=2, tp=2)  # ranks (0, 1) and (2, 3) are the TP groups
    assert [dims.data_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.reports_sums(r) for r in range(4)] == [True, False, True, False]
    assert dims.dp == 2 and dims.world == 4 and dims.label == "dp_shard=2 x tp=2"
    plain = DDP().layout(4)
    assert [plain.data_rank(r) for r in range(4)] == [0, 1, 2, 3] and plain.reports_sums(3)


@pytest.mark.parametrize("tp, world, local, group, message", [
    (4, 2, 2, None, r"trainer.tensor_parallel=4 is more than the 2 process\(es\) per node: a "
                    r"tensor-parallel group stays inside a node; use one of 1, 2"),
    (2, 3, 3, None, r"trainer.tensor_parallel=2 does not divide the 3 processes per node; use "
                    r"one of 1, 3"),
    (2, 8, 4, 3, r"trainer.shard_group_size=3 is not a multiple of trainer.tensor_parallel=2"),
])
def test_a_layout_tensor_parallelism_cannot_split_is_one_line(tp, world, local, group,
                                                              message):
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(tp, world=world, local_world=local, shard_group=group)


def test_the_values_suggested_pass_every_check_of_the_key():
    """On 3 processes with 4 heads, 3 divides the processes but not the heads: it is not
    offered; a pipeline is offered only stage counts whose stages hold whole TP groups and that
    the model's blocks can fill."""
    from paratrain.parallel.dims import check_pipeline_parallel
    with pytest.raises(ConfigError, match=r"does not divide the 3 processes per node; use one "
                                          r"of 1$"):
        check_tensor_parallel(2, world=3, local_world=3, heads=(4, 4))
    with pytest.raises(ConfigError, match=r"does not divide the 6 processes per node; use one "
                                          r"of 1, 2$"):  # 3 and 6 divide 6, not the 4 heads
        check_tensor_parallel(4, world=6, local_world=6, heads=(4, 4))
    with pytest.raises(ConfigError, match=r"into equal stages; use one of 1, 2, 3$"):
        check_pipeline_parallel(5, world=12, tp=2, max_stages=3)
    with pytest.raises(ConfigError, match=r"does not divide model.num_heads=4 \(each rank computes "
                                          r"whole heads\); use one of 1$"):  # 2 fails on 3
        TrainConfig.from_yaml(None, ["model.preset=tiny", "trainer.tensor_parallel=3",
                                     "trainer.devices=cpu:3"])  # not 4: 3 a stage


@pytest.mark.parametrize("overrides, message", [
    (["model.preset=tiny", "trainer.tensor_parallel=3"],
     r"trainer.tensor_parallel=3 does not divide model.num_heads=4 \(each rank computes whole "
     r"heads\); use one of 1, 2"),
    (["model.preset=tiny", "trainer.tensor_parallel=4"],  # 4 heads, but 2 key/value heads
     r"trainer.tensor_parallel=4 does not divide model.num_kv_heads=2"),
    (["trainer.tensor_parallel=2", "trainer.strategy=dp"],
     r"trainer.strategy=dp \(nn.DataParallel, one process\) cannot be combined with "
     r"trainer.tensor_parallel=2"),
    (["trainer.tensor_parallel=0"], r"trainer.tensor_parallel=0 must be >= 1"),
])
def test_bad_tensor_parallel_config_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_yaml(None, overrides)


@dataclass
class _Task:
    """What check_tp_plan asks of a task: its model factory."""
    factory: object

    def build_model(self) -> nn.Module:
        return self.factory()


class _Planned(nn.Module):
    """A user's module that says how to split itself."""

    def __init__(self):
        super().__init__()
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.tp_plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def test_a_model_without_a_plan_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"trainer.tensor_parallel needs a plan that says how "
                                          r"to split Sequential's layers, and it has none"):
        check_tp_plan(_Task(lambda: nn.Sequential(nn.Linear(4, 4))), 2)
    check_tp_plan(_Task(_Planned), 2)  # a plan of its own: accepted


def _tiny(arch: str) -> nn.Module:
    cfg = TrainConfig.from_yaml(None, [f"model.arch={arch}", "model.preset=tiny"])
    return build_model(resolve_model_config(cfg.model, vocab_size=96, seq_length=16))


def _split(model: nn.Module, world: int = 2) -> tuple[nn.Module, dict]:
    """The model as rank 0 of a fake world of `world` processes, all of them one TP group."""
    from torch.distributed.tensor import DTensor
    tp = TensorParallel(dims=ParallelDims(tp=world))
    env = DistEnv(world_size=world, local_world_size=world)
    mesh = tp.device_mesh(env)
    split_tensor_parallel(model, mesh["tp"])
    params = dict(model.named_parameters())
    assert all(isinstance(p.data, DTensor) and p.device_mesh == mesh["tp"]
               for p in params.values()), "a parameter is not on the TP mesh"
    return model, {n: p.placements[0] for n, p in params.items()}


def test_llama_plan_splits_matrices_and_replicates_norms():
    from torch.distributed.tensor import Replicate, Shard
    with fake_world(2):
        model, placement = _split(_tiny("llama"))
        for name in ("wq", "wk", "wv"):
            assert placement[f"layers.0.attention.{name}.weight"] == Shard(0)  # by columns
        assert placement["layers.1.attention.wo.weight"] == Shard(1)  # by rows
        assert placement["layers.0.feed_forward.w2.weight"] == Shard(1)
        assert placement["tok_embeddings.weight"] == Shard(0)  # by vocabulary
        assert placement["lm_head.weight"] == Shard(0)
        assert placement["norm.weight"] == Replicate()
        assert placement["layers.0.ffn_norm.weight"] == Replicate()
        # a rank's slices: 2 of the 4 query heads, 1 of the 2 key/value heads
        assert model.layers[0].attention.wq.weight.to_local().shape == (32, 64)
        assert model.layers[0].attention.wk.weight.to_local().shape == (16, 64)


def test_gpt_plan_strides_the_fused_projection_and_keeps_the_head_tied():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.placement_types import _StridedShard
    with fake_world(2):
        model, placement = _split(_tiny("gpt"))
        assert isinstance(placement["layers.0.attn.c_attn.weight"], _StridedShard)
        assert placement["wpe.weight"] == Replicate()
        assert model.lm_head.weight is model.wte.weight  # tied, as before splitting


def test_hf_llama_is_split_by_its_own_plan():
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor import Replicate, Shard
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    with fake_world(2):
        _, placement = _split(transformers.AutoModelForCausalLM.from_config(config))
        assert placement["model.layers.0.self_attn.q_proj.weight"] == Shard(0)
        assert placement["model.layers.0.self_attn.o_proj.weight"] == Shard(1)
        assert placement["model.layers.1.input_layernorm.weight"] == Replicate()  # not planned


def test_lora_on_a_tensor_parallel_base_is_refused_in_one_line():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from paratrain.config import LoraConfig
    from paratrain.tasks.lora import apply_lora
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2)

    def factory():
        return apply_lora(transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=4))
    with pytest.raises(ConfigError, match=r"trainer.tensor_parallel=2 with LoRA adapters is "
                                          r"refused"):
        check_tp_plan(_Task(factory), 2)


def test_the_cli_refuses_a_tp_group_larger_than_a_node_in_one_line(tmp_path, monkeypatch,
                                                                    capsys):
    """The layout check runs before the data is prepared: exit code 2, one line and nothing
    else, nothing written (in this process, through cli.main; test_errors.py checks the exit
    code of a real process)."""
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train", "trainer.devices=cpu:2", "trainer.tensor_parallel=4",
                              "model.preset=small", "run.name=tp"], only_line=True)
    assert line == (
        "paratrain: error: trainer.tensor_parallel=4 is more than the 2 process(es) per node: a "
        "tensor-parallel group stays inside a node; use one of 1, 2")
    assert not (tmp_path / "runs").exists()
