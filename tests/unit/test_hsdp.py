"""HSDP without processes: how `trainer.strategy=hsdp` and `trainer.shard_group_size` resolve,
what share of the state a rank holds, the plan's row and `auto`'s pick, and the bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain import TrainConfig
from paratrain.errors import ConfigError
from paratrain.models import build_model, resolve_model_config
from paratrain.parallel.memory_estimate import choose, estimate
from paratrain.parallel.strategies import DDP, FSDP, HSDP, resolve_parallelism

CPU = torch.device("cpu")


def resolve(requested="hsdp", world=4, local=2, group=None, **kw):
    return resolve_parallelism(requested, world_size=world, local_world_size=local, device=CPU,
                               shard_group_size=group, **kw)


def test_hsdp_shards_within_a_node_by_default():
    p, why = resolve(world=8, local=4)
    assert isinstance(p, HSDP) and p.shard_group_size == 4 and p.label == "hsdp"
    assert "2 replicas x shard groups of 4" in why


def test_shard_group_size_overrides_the_node():
    p, _ = resolve(world=8, local=4, group=2)
    assert isinstance(p, HSDP) and p.shard_group_size == 2
    p, _ = resolve(world=4, local=4, group=2)  # one node, a 2 x 2 mesh
    assert isinstance(p, HSDP) and p.shard_group_size == 2


def test_hsdp_on_one_node_without_override_is_fsdp():
    p, why = resolve(world=4, local=4)
    assert type(p) is FSDP
    assert "that is fsdp" in why and "one shard group spans all 4" in why
    p, why = resolve(world=1, local=1)  # one process: single, as for any strategy
    assert p.name == "single" and "only one process" in why


@pytest.mark.parametrize("requested", ["hsdp", "auto"])
@pytest.mark.parametrize("group", [3, 0, 8])
def test_shard_group_size_must_divide_the_world(requested, group):
    with pytest.raises(ConfigError, match=rf"trainer.shard_group_size={group} must divide the "
                                          r"world size \(4 processes\): one of 1, 2, 4"):
        resolve(requested, world=4, local=4, group=group)


def test_cpu_offload_is_fsdp_only():
    with pytest.raises(ConfigError, match="cpu_offload=true needs trainer.strategy=fsdp"):
        resolve(cpu_offload=True)


def test_a_rank_holds_its_shard_group_share():
    hsdp, fsdp = HSDP(shard_group_size=2), FSDP()
    shape = torch.Size([10, 3])
    assert [hsdp.state_numel(shape, 4, r) for r in range(4)] == [15, 15, 15, 15]
    assert [fsdp.state_numel(shape, 4, r) for r in range(4)] == [9, 9, 9, 3]
    odd = torch.Size([5])
    assert [hsdp.state_numel(odd, 4, r) for r in range(4)] == [3, 2, 3, 2]  # each replica whole


def _rows(world, group):
    args = resolve_model_config(TrainConfig.from_yaml(None, ["model.preset=tiny"]).model,
                                vocab_size=384, seq_length=32)
    return estimate(lambda: build_model(args), world=world, precision="fp32", micro_batch=2,
                    seq_length=32, vocab_size=384, shard_group_size=group)


def test_plan_has_an_hsdp_row_between_ddp_and_fsdp():
    rows = _rows(world=8, group=2)
    assert [r.label for r in rows] == ["ddp", "hsdp", "fsdp", "fsdp+ac", "fsdp+offload"]
    ddp, hsdp, fsdp = rows[0], rows[1], rows[2]
    # parameters split evenly here: half of DDP's per rank (4 bytes of step per tensor aside)
    assert hsdp.params_bytes * 2 == ddp.params_bytes
    assert math.isclose(hsdp.state_bytes / ddp.state_bytes, 0.5, rel_tol=0.01)
    assert fsdp.state_bytes < hsdp.state_bytes
    # one node (the group is the world), or one process per node: no hsdp row
    assert "hsdp" not in [r.label for r in _rows(world=4, group=4)]
    assert "hsdp" not in [r.label for r in _rows(world=4, group=1)]


def test_auto_picks_hsdp_when_ddp_does_not_fit_but_a_node_shard_does():
    rows = _rows(world=8, group=2)
    ddp, hsdp = rows[0], rows[1]
    assert choose(rows, int(ddp.device_bytes / 0.8) + 1).parallelism == DDP()
    pick = choose(rows, int(hsdp.device_bytes / 0.8) + 1)
    assert pick.parallelism == HSDP(shard_group_size=2) and pick.label == "hsdp"
    assert choose(rows, int(rows[2].device_bytes / 0.8) + 1).label == "fsdp"


@pytest.mark.parametrize("overrides, words", [
    (["trainer.shard_group_size=0"], ["trainer.shard_group_size=0 must be positive"]),
    (["trainer.strategy=ddp", "trainer.shard_group_size=2"],
     ["trainer.shard_group_size", "does not apply to trainer.strategy=ddp"]),
])
def test_config_checks(overrides, words):
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(None, overrides)
    for w in words:
        assert w in str(e.value)
    cfg = TrainConfig.from_yaml(None, ["trainer.strategy=hsdp", "trainer.shard_group_size=2"])
    assert cfg.trainer.shard_group_size == 2


def test_paratrain_plan_shows_hsdp_and_refuses_a_bad_group():
    from paratrain.parallel.memory_estimate import estimates_for_config
    over = ["model.preset=tiny", "data.vocab_size=384", "data.seq_length=32",
            "trainer.devices=cpu:2", "distributed.nnodes=2", "distributed.master_port=29500"]
    rows, capacity, pick = estimates_for_config(TrainConfig.from_yaml(None, over))
    assert [r.label for r in rows][:3] == ["ddp", "hsdp", "fsdp"]
    from paratrain.parallel.memory_estimate import format_estimates  # the pick, and the keys that fix it
    assert format_estimates(rows, capacity, pick).endswith(
        f"trainer.strategy=auto picks {pick.label} ({pick.why}); to fix it: "
        f"trainer.strategy={pick.parallelism.name}")
    with pytest.raises(ConfigError, match="trainer.shard_group_size=3 must divide"):
        estimates_for_config(TrainConfig.from_yaml(None, over + ["trainer.shard_group_size=3"]))
