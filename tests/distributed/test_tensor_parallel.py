"""Tensor parallelism with real gloo workers: TP=2 on 2 processes against one process, FSDP x TP
(2 x 2) on 4 processes against DDP on 4, and snapshots moving between these layouts. Every run
is a cached reference run (BASE: 16 steps of 8 sequences, a snapshot every 4 steps, sample ids
recorded); the comparisons are within 1e-5, the final weights within WEIGHTS_ATOL (fp32; bitwise
equality across layouts is not possible: the sums are split differently)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics, read_summary, run_cli
from tests.distributed._snapshot_helpers import args_for, reference_run, resume_under, samples, \
    weights

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

ONE = {"trainer.devices": "cpu:1"}
TP2 = {"trainer.tensor_parallel": 2}
FOUR = {"trainer.devices": "cpu:4", "trainer.batch_size": 2}
FSDP_TP = {**FOUR, "trainer.strategy": "fsdp", "trainer.tensor_parallel": 2}
DDP4 = {**FOUR, "trainer.strategy": "ddp"}


def _ref(request, **extra):
    f = request.getfixturevalue
    return reference_run(f("tmp_path_factory"), f("corpus_dir"), f("cache_dir"), **extra)


def _state(entry: dict) -> int:
    return entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_bytes"]


# The final weights' bound. AdamW divides each update by the gradient's running RMS, so a
# weight whose gradient is near zero turns the fp32 rounding of sums split differently (TP splits
# every matmul's sum) into a visibly different step: after 16 steps at lr 2e-3 that reached
# 1.1e-5 on an AMD EPYC (2026-11-26; under 1e-5 on the CPUs before). 5e-5 is 2.5% of one step's
# largest update (lr): a missing or extra step, or a shard in the wrong place, moves a weight by
# about lr and still fails.
WEIGHTS_ATOL = 5e-5


def assert_same_run(got_dir, want_dir, first_step: int = 1, atol: float = 1e-5) -> None:
    """Losses and gradient norms step by step and the validation loss within `atol`, the final
    weights within WEIGHTS_ATOL; the same samples in every step."""
    want = [m for m in read_metrics(want_dir) if m["step"] >= first_step]
    got = read_metrics(got_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for a, b in zip(got, want):
        assert abs(a["loss"] - b["loss"]) < atol, (a["step"], a["loss"], b["loss"])
        # a norm's fp32 rounding is relative: above 1 (a deep model's), so is the tolerance
        assert abs(a["grad_norm"] - b["grad_norm"]) < atol * max(1.0, b["grad_norm"]), a["step"]
    assert abs(read_summary(got_dir)["val_loss"] - read_summary(want_dir)["val_loss"]) < atol
    if first_step == 1:
        assert samples(got_dir) == samples(want_dir)
    w_got, w_want = weights(got_dir), weights(want_dir)
    assert w_got.keys() == w_want.keys()
    for k in w_want:  # model/ holds full tensors whatever the layout
        torch.testing.assert_close(w_got[k], w_want[k], rtol=0, atol=max(atol, WEIGHTS_ATOL),
                                   msg=k)


def test_tp2_on_two_processes_is_one_process(request):
    one, tp = _ref(request, **ONE), _ref(request, **TP2)
    summary = read_summary(tp)
    assert summary["strategy"] == "tp" and summary["tensor_parallel"] == 2
    assert summary["parallel_dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert summary["global_batch_size"] == 8 and summary["grad_accum"] == 2
    assert_same_run(tp, one)
    # each rank holds half of every matrix (the norms' gains are replicated: a few hundred bytes)
    full = read_summary(one)["memory"][0]["params_bytes"]
    for entry in summary["memory"]:
        assert abs(entry["params_bytes"] - full / 2) <= 0.01 * full, entry


def test_fsdp_x_tp_on_four_processes_is_ddp_with_a_quarter_of_the_state(request):
    fsdp_tp, ddp = _ref(request, **FSDP_TP), _ref(request, **DDP4)
    summary = read_summary(fsdp_tp)
    assert summary["strategy"] == "fsdp+tp"
    assert summary["parallel_dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert_same_run(fsdp_tp, ddp)
    # parameters, gradients and AdamW state per rank from the real shards: a quarter of DDP's
    # (sharded 2 ways by FSDP, 2 ways by TP; the norms' gains only by FSDP)
    for f, d in zip(summary["memory"], read_summary(ddp)["memory"]):
        assert abs(_state(f) / _state(d) - 0.25) < 0.01, (f, d)


@pytest.mark.parametrize("layout", [{"trainer.strategy": "ddp"}, ONE], ids=["ddp2", "one"])
def test_fsdp_x_tp_snapshot_resumes_under_another_layout(request, tmp_path, layout):
    """Steps 9-16 continued from the FSDP x TP run's step-8 snapshot by DDP on 2 processes or by
    one process are the FSDP x TP run's own steps 9-16."""
    source = _ref(request, **FSDP_TP)
    assert_same_run(resume_under(request, tmp_path, source, layout), source, first_step=9)


def test_fsdp_snapshot_resumes_under_fsdp_x_tp(request, tmp_path):
    source = _ref(request, **{"trainer.strategy": "fsdp"})  # FSDP on 2 processes
    args = args_for(request.getfixturevalue("corpus_dir"), request.getfixturevalue("cache_dir"),
                    "resumed", **FSDP_TP,
                    **{"checkpoint.resume": source / "checkpoints" / "step-0000008"})
    r = run_cli(args, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 8" in r.stderr and "resharded to 4" in r.stderr
    assert_same_run(tmp_path / "runs" / "resumed", source, first_step=9)


def test_hf_llama_split_by_its_own_plan_is_one_process(tmp_path, corpus_dir, cache_dir):
    """A local tiny Llama (transformers, from its config.json: no weights), TP=2 through its
    config's base_model_tp_plan, against one process: 8 steps within 1e-5 (the weights within
    WEIGHTS_ATOL)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-llama"
    transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(folder)
    runs = {}
    for name, layout in (("one", ONE), ("tp", TP2)):
        args = args_for(corpus_dir, cache_dir, name, **layout, **{
            "model.arch": "hf", "model.path": folder, "data.tokenizer": "bpe",
            "trainer.max_steps": 8, "checkpoint.every_steps": 0,
            "checkpoint.record_samples": "false"})
        r = run_cli(args, cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = tmp_path / "runs" / name
    assert read_summary(runs["tp"])["strategy"] == "tp"
    for a, b in zip(read_metrics(runs["tp"]), read_metrics(runs["one"])):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5
    got, want = weights(runs["tp"]), weights(runs["one"])
    assert got.keys() == want.keys()  # a from_pretrained folder with the full tensors
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=WEIGHTS_ATOL, msg=k)


def test_the_simulation_holds_what_the_four_process_runs_held(request):
    """`paratrain plan` of the same config at the same world (1 node x 4), simulated on the meta
    device: rank 0's parameter, gradient and optimizer bytes equal what the real FSDP x TP and
    DDP runs measured on their rank 0 (summary.json)."""
    from paratrain import TrainConfig
    from paratrain.parallel.simulate import simulate_at_scale
    fsdp_tp, ddp = _ref(request, **FSDP_TP), _ref(request, **DDP4)
    cfg = TrainConfig.from_yaml(fsdp_tp / "config.yaml", ["plan.device_memory_gb=1"])
    rows, target, _, _ = simulate_at_scale(cfg)
    assert target.world == 4
    by = {r.label: r for r in rows}
    for label, run in (("fsdp+tp2", fsdp_tp), ("ddp", ddp)):
        real = read_summary(run)["memory"][0]
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert getattr(by[label], key) == real[key], (label, key)


def test_two_nodes_with_tp_inside_and_hsdp_across_are_ddp_on_four(request, tmp_path):
    """Two `paratrain train` commands on 127.0.0.1 as two nodes of 2 processes: TP=2 inside
    each node, HSDP across (replicas on the nodes; shard groups of one TP group each), against
    DDP on 4 processes of one node, the same global batch: within 1e-5."""
    from paratrain.launch.environment import free_port
    from tests.distributed.test_multinode import finish, start
    ddp = _ref(request, **DDP4)
    port = free_port()
    procs = [start(args_for(request.getfixturevalue("corpus_dir"),
                            request.getfixturevalue("cache_dir"), "nodes", **{
                                "trainer.devices": "cpu:2", "trainer.batch_size": 2,
                                "trainer.strategy": "hsdp", "trainer.tensor_parallel": 2,
                                "distributed.nnodes": 2, "distributed.node_rank": rank,
                                "distributed.master_addr": "127.0.0.1",
                                "distributed.master_port": port,
                                # every node's shards in one place, as on a shared filesystem
                                "checkpoint.dir": tmp_path / "checkpoints"}),
                   tmp_path / f"node{rank}")
             for rank in (0, 1)]
    results = finish(procs, timeout=600)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    run = tmp_path / "node0" / "runs" / "nodes"
    summary = read_summary(run)
    # hsdp over one process per node (a TP group each) shards nothing: its sizes are ddp's
    assert summary["strategy"] == "ddp+tp" and summary["nnodes"] == 2
    assert summary["parallel_dims"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 2}
    assert_same_run(run, ddp)
