"""Pipeline parallelism with real gloo workers: P=2 on 2 processes (1f1b, gpipe, interleaved-1f1b,
zero-bubble) against one process; P=2 x DDP 2, x FSDP 2, x TP 2 and x CP 2 on 4 processes;
snapshots moving between pipeline and data-parallel layouts. Every run is a cached reference run
(BASE: 16 steps of 8 sequences, a snapshot every 4 steps, sample ids recorded) of the tiny Llama
with 4 blocks, 2 sequences per micro-batch: the pipeline's micro-batches are the accumulation
micro-batches of a step (4, or 2 per data-parallel group)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import cli_error, read_summary
from tests.distributed._snapshot_helpers import args_for, reference_run, resume_under
from tests.distributed.test_tensor_parallel import assert_same_run

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

L4 = {"model.num_layers": 4, "trainer.batch_size": 2}
ONE = {**L4, "trainer.devices": "cpu:1"}
PP2 = {**L4, "trainer.pipeline_parallel": 2}
DDP2 = {**L4, "trainer.strategy": "ddp"}
PP2_DDP2 = {**PP2, "trainer.devices": "cpu:4"}
PP2_FSDP2 = {**PP2_DDP2, "trainer.strategy": "fsdp"}
PP2_TP2 = {**PP2_DDP2, "trainer.tensor_parallel": 2}
# each stage's 2 processes a CP group: every 32-token window cut into 4 chunks of 8 (head-tail)
PP2_CP2 = {**PP2_DDP2, "trainer.context_parallel": 2}


def _ref(request, **extra):
    f = request.getfixturevalue
    return reference_run(f("tmp_path_factory"), f("corpus_dir"), f("cache_dir"), **extra)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_on_two_processes_is_one_process(request, schedule):
    one, pp = _ref(request, **ONE), _ref(request, **PP2, **{"trainer.pipeline_schedule": schedule})
    summary = read_summary(pp)
    assert summary["strategy"] == "pp" and summary["pipeline_parallel"] == 2
    assert summary["parallel_dims"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert summary["global_batch_size"] == 8 and summary["grad_accum"] == 4
    assert_same_run(pp, one)  # losses, grad norms, samples, weights: 1e-5
    assert abs(summary["val_loss"] - read_summary(one)["val_loss"]) < 1e-6


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
def test_two_stages_per_process_is_one_process(request, schedule):
    """interleaved-1f1b, and zero-bubble (the same placement, each backward split into the
    input's gradient and the weights', the latter run later to fill the bubble)."""
    # 8 blocks at the default learning rate spike (gradient norms of 5-8) and amplify fp32
    # rounding step by step; at a quarter of it the run is smooth and the comparison meaningful
    l8 = {"model.num_layers": 8, "trainer.max_steps": 10, "checkpoint.every_steps": 0,
          "optim.lr": 5e-4}
    one = _ref(request, **{**ONE, **l8})
    pp = _ref(request, **{**PP2, **l8, "trainer.pipeline_schedule": schedule})
    assert f"({schedule}, blocks per stage [2, 2, 2, 2])" in read_summary(pp)["strategy_reason"]
    assert_same_run(pp, one)


@pytest.mark.parametrize("layout, strategy, dims, share", [
    (PP2_DDP2, "ddp+pp", {"dp_replicate": 2}, 0.5),
    (PP2_FSDP2, "fsdp+pp", {"dp_shard": 2}, 0.25),
    (PP2_TP2, "tp+pp", {"tp": 2}, 0.25),
    (PP2_CP2, "ddp+cp+pp", {"cp": 2}, 0.5),
], ids=["ddp2", "fsdp2", "tp2", "cp2"])
def test_pp2_x_two_on_four_processes_is_one_process(request, layout, strategy, dims, share):
    """A stage replicated (DDP), sharded (FSDP2, its gradients reduced by the schedule once per
    step), split (TP, the sequence-split stream crossing stages as a DTensor) or a CP group
    (each rank its head-tail chunks of every micro-batch, attention gathering the group's keys
    and values, gradients averaged over the group): the same run as one process, and each rank
    holds half the blocks, or a half of that."""
    one, run = _ref(request, **ONE), _ref(request, **layout)
    summary = read_summary(run)
    assert summary["strategy"] == strategy
    assert summary["parallel_dims"] == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1,
                                        **dims}
    assert summary["grad_accum"] == (2 if "dp_replicate" in dims or "dp_shard" in dims
                                     else 4)  # micro-batches per data group
    assert_same_run(run, one)  # losses, grad norms, samples, weights: 1e-5
    assert abs(summary["val_loss"] - read_summary(one)["val_loss"]) < 1e-5
    full = read_summary(one)["memory"][0]["params_bytes"]
    for entry in summary["memory"]:  # the embedding and the head are alike in size
        assert abs(entry["params_bytes"] / full - share) < 0.01, entry


@pytest.mark.parametrize("layout", [PP2_DDP2, PP2_FSDP2, PP2_TP2], ids=["ddp2", "fsdp2", "tp2"])
def test_the_simulation_holds_what_the_pipeline_run_held(request, layout):
    """`paratrain plan` of a P=2 x 2 run's config at its world (1 node x 4), on the meta
    device: rank 0's parameter, gradient and optimizer bytes are what the real run measured
    (its stage sharded by FSDP or split by TP as the run did it)."""
    from paratrain import TrainConfig
    from paratrain.parallel.simulate import simulate_at_scale
    run = _ref(request, **layout)
    cfg = TrainConfig.from_yaml(run / "config.yaml", ["plan.device_memory_gb=1"])
    [row] = [r for r in simulate_at_scale(cfg)[0] if r.asked]
    real = read_summary(run)["memory"][0]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(row, key) == real[key], key


@pytest.mark.parametrize("source, layout", [(PP2, DDP2), (PP2, ONE), (PP2_FSDP2, ONE)],
                         ids=["pp2-to-ddp2", "pp2-to-one", "pp2xfsdp2-to-one"])
def test_pp2_snapshot_resumes_under_another_layout(request, tmp_path, source, layout):
    """Steps 9-16 continued from a P=2 run's step-8 snapshot (its stages whole, or sharded by
    FSDP: DCP reshards) by DDP on 2 processes or by one process are the P=2 run's own steps."""
    source = _ref(request, **source)
    assert_same_run(resume_under(request, tmp_path, source, layout), source, first_step=9)


@pytest.mark.parametrize("layout", [PP2, PP2_FSDP2], ids=["pp2", "pp2xfsdp2"])
def test_ddp_snapshot_resumes_under_pp2(request, tmp_path, layout):
    source = _ref(request, **DDP2)
    assert_same_run(resume_under(request, tmp_path, source, layout), source, first_step=9)


def test_a_pipeline_that_does_not_divide_the_world_exits_2(request, tmp_path, monkeypatch,
                                                          capsys):
    """In this process, through cli.main (test_errors.py checks a real process's exit code)."""
    args = args_for(request.getfixturevalue("corpus_dir"), request.getfixturevalue("cache_dir"),
                    "bad", **{**PP2, "trainer.pipeline_parallel": 3})
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, args)
    assert "trainer.pipeline_parallel=3 does not divide the world of 2 processes" in line
    assert not (tmp_path / "runs" / "bad" / "checkpoints").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs: the stages' activations and gradients go over nccl's "
                           "point-to-point transport (`paratrain doctor` suggests "
                           "NCCL_P2P_DISABLE=1 where that transport hangs)")
def test_pp2_on_two_gpus_over_nccl_is_one_gpu(request):
    """The same P=2 run on cuda:0,1 (nccl send/recv between the stages) against one GPU: GPU
    kernels differ from the CPU's, so the comparison is between the two GPU runs."""
    one = _ref(request, **{**L4, "trainer.devices": "cuda:0"})
    pp = _ref(request, **{**PP2, "trainer.devices": "cuda:0,1"})
    assert read_summary(pp)["strategy"] == "pp"
    assert_same_run(pp, one)
