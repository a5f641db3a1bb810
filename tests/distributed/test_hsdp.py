"""HSDP with real gloo workers: shard within a group (a node), replicate across groups.

Two layouts of the same 2 x 2 mesh: one command with `cpu:4` and `trainer.shard_group_size=2`
(quick), and two "nodes" of 2 CPU workers each on 127.0.0.1 (slow). Both must train exactly as
data parallelism does (losses within 1e-5), hold half of DDP's state per rank, and write
snapshots that FSDP and DDP on other world sizes continue from."""

from __future__ import annotations

import pytest

from paratrain.launch.environment import free_port
from tests._runs import ONE_WORKER, tiny_run
from tests.conftest import (
    cli_error,
    finish_all,
    read_metrics,
    read_summary,
    run_cli,
    start_cli,
    tiny_overrides,
)
from tests.distributed._snapshot_helpers import interrupted_copy

pytestmark = pytest.mark.timeout(300)

GLOBAL_BATCH = 8  # = 2 x 4 workers = 4 x 2 = 8 x 1: the same run on every world size
EVAL_SAMPLES = ONE_WORKER["trainer.eval_samples"]  # 37: uneven over 4 ranks, counted once


def _args(corpus_dir, cache_dir, name, per_device, **extra) -> list[str]:
    return ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "run.name": name, "trainer.batch_size": per_device,
        "trainer.global_batch_size": GLOBAL_BATCH, "trainer.eval_samples": EVAL_SAMPLES,
        **extra})


def _train(cwd, args, timeout=240):
    cwd.mkdir(parents=True, exist_ok=True)
    r = run_cli(args, cwd=cwd, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def _max_diff(run_dir, ref_dir) -> float:
    got, want = _losses(run_dir), _losses(ref_dir)
    assert sorted(got) == sorted(want) == list(range(1, 11)), (sorted(got), sorted(want))
    return max(abs(got[s] - want[s]) for s in want)


def _state_bytes(entry: dict) -> int:
    return entry["params_bytes"] + entry["grads_bytes"] + entry["optimizer_bytes"]


def _assert_half(summary: dict, ref: dict) -> None:
    """Each rank holds half of the replicated state: parameters and gradients exactly, AdamW's
    moments too (only the 4-byte step counter per tensor is not split)."""
    full = ref["memory"][0]
    for entry in summary["memory"]:
        assert 2 * entry["params_bytes"] == full["params_bytes"], (entry, full)
        assert 2 * entry["grads_bytes"] == full["grads_bytes"], (entry, full)
        assert abs(_state_bytes(entry) / _state_bytes(full) - 0.5) < 0.001, (entry, full)


@pytest.mark.slow  # 4 processes: 25-60 s; the quick subset stays under 3 minutes
def test_hsdp_two_shard_groups_on_one_node(tmp_path, tmp_path_factory, corpus_dir, cache_dir):
    """cpu:4 with shard groups of 2: a 2 x 2 mesh in one command. Same losses as one process
    with the same global batch (the session's one-process run), half the state per rank."""
    hsdp = _train(tmp_path, _args(corpus_dir, cache_dir, "hsdp", 2, **{
        "trainer.devices": "cpu:4", "trainer.strategy": "hsdp", "trainer.shard_group_size": 2}))
    assert "strategy hsdp (asked for: 2 replicas x shard groups of 2)" in hsdp.stderr
    run = tmp_path / "runs" / "hsdp"
    ref = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **ONE_WORKER).dir
    s = read_summary(run)
    assert (s["strategy"], s["world_size"]) == ("hsdp", 4)
    assert _max_diff(run, ref) < 1e-5
    assert abs(s["val_loss"] - read_summary(ref)["val_loss"]) < 1e-5
    _assert_half(s, read_summary(ref))


def test_shard_group_size_not_dividing_the_world_is_one_line(tmp_path, monkeypatch, capsys,
                                                             corpus_dir, cache_dir):
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, _args(corpus_dir, cache_dir, "bad", 2, **{
        "trainer.devices": "cpu:4", "trainer.strategy": "hsdp", "trainer.shard_group_size": 3}))
    assert "trainer.shard_group_size=3 must divide the world size (4 processes)" in line
    assert not (tmp_path / "runs" / "bad" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, corpus_dir, cache_dir):
    """HSDP on 2 nodes x 2 CPU workers (a snapshot at step 5), and what data parallelism does
    with the same global batch: the session's one-process run (`ONE_WORKER`, which DDP on N
    workers reproduces within 1e-5, test_ddp.py; the one-command HSDP test compares with it too),
    not a 4-process DDP run of its own. Every rank writes its own shard of a snapshot: the nodes share
    one checkpoint.dir (here node 0's default one, named by absolute path), as nodes on a
    cluster share a filesystem or a bucket."""
    tmp = tmp_path_factory.mktemp("hsdp")
    port = free_port()
    procs = [start_cli(_args(corpus_dir, cache_dir, "hsdp", 2, **{
        "trainer.devices": "cpu:2", "trainer.strategy": "hsdp", "checkpoint.every_steps": 5,
        "checkpoint.dir": tmp / "node0" / "runs" / "hsdp" / "checkpoints",
        "distributed.nnodes": 2, "distributed.node_rank": rank,
        "distributed.master_addr": "127.0.0.1", "distributed.master_port": port,
        "distributed.timeout_s": 60}), tmp / f"node{rank}") for rank in (0, 1)]
    results = finish_all(procs, timeout=240)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    one = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **ONE_WORKER)
    return {"hsdp": tmp / "node0" / "runs" / "hsdp", "one": one.dir, "log": results[0][2],
            "tmp": tmp}


@pytest.mark.slow
def test_hsdp_on_two_nodes_trains_like_ddp_with_half_the_state(two_nodes):
    s, ref = read_summary(two_nodes["hsdp"]), read_summary(two_nodes["one"])
    assert "strategy hsdp (asked for: 2 replicas x shard groups of 2)" in two_nodes["log"]
    assert (s["strategy"], s["world_size"], s["nnodes"]) == ("hsdp", 4, 2)
    assert (ref["strategy"], ref["world_size"]) == ("single", 1)
    diff = _max_diff(two_nodes["hsdp"], two_nodes["one"])
    assert diff < 1e-5
    assert abs(s["val_loss"] - ref["val_loss"]) < 1e-5
    _assert_half(s, ref)
    print(f"max loss difference hsdp vs one process: {diff:.2g}; per-rank state bytes (params, "
          "grads, optimizer): hsdp",
          [(m["params_bytes"], m["grads_bytes"], m["optimizer_bytes"]) for m in s["memory"]],
          "one process (= ddp's replica)", [(m["params_bytes"], m["grads_bytes"],
                                             m["optimizer_bytes"]) for m in ref["memory"]])


@pytest.mark.slow
@pytest.mark.parametrize("devices, per_device, strategy, runs_as", [
    ("cpu:2", 4, "hsdp", "fsdp"),  # hsdp on one node without an override: fsdp, and it says so
    ("cpu:1", 8, "ddp", "single"),  # one process
])
def test_hsdp_snapshot_resumes_on_other_strategies_and_world_sizes(
        two_nodes, corpus_dir, cache_dir, devices, per_device, strategy, runs_as):
    """The HSDP run's step-5 snapshot (2 replicas x 2 shards, DCP) continued by FSDP on 2
    workers and by one process: steps 6-10 within 1e-5 of the uninterrupted HSDP run."""
    cwd = two_nodes["tmp"] / f"resume-{runs_as}"
    name = "hsdp"  # the snapshot's run dir, copied as if the job had died after step 5
    run = interrupted_copy(two_nodes["hsdp"], cwd / "runs" / name, keep_until=5)
    r = _train(cwd, _args(corpus_dir, cache_dir, name, per_device, **{
        "trainer.devices": devices, "trainer.strategy": strategy}))
    world = int(devices.split(":")[1])
    assert "resumed from step 5 " in r.stderr
    assert f"saved by 4 worker(s), resharded to {world}" in r.stderr
    if runs_as == "fsdp":
        assert "strategy fsdp (hsdp asked for, but its one shard group spans all 2 processes" \
            in r.stderr
    s = read_summary(run)
    assert (s["strategy"], s["world_size"], s["resumed_from"]["world_size"]) == (runs_as, world, 4)
    assert _max_diff(run, two_nodes["hsdp"]) < 1e-5
