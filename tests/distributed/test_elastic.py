"""Elastic node membership (distributed.nnodes=MIN:MAX, torch's c10d rendezvous): "nodes" are
separate `paratrain train` commands on 127.0.0.1, each with its own process tree and one CPU
worker, sharing one run dir. A node SIGKILLed whole: the others re-form the job from the last
committed snapshot and finish; a node that starts late is taken in. Either way the same samples
and (within 1e-5) the same losses as the run that never changed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from paratrain.launch.environment import free_port
from tests._runs import tiny_run
from tests.conftest import cli_error, finish_all, read_metrics, read_summary, start_cli
from tests.distributed._snapshot_helpers import committed_steps, samples, steps_logged
from tests.distributed.test_multinode import node_args

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

# 3 nodes x 1 worker or 2 x 1: a global batch of 24 splits over both (accumulation 2 or 3).
# 300 steps (0.1-0.3 s each on a loaded 2-core machine): the late node's start-up (a launcher,
# its imports, the rendezvous: it joined at step ~130 at load 5) must end before the job does.
ELASTIC = {"distributed.nnodes": "2:3", "trainer.devices": "cpu:1", "trainer.batch_size": 4,
           "trainer.global_batch_size": 24, "trainer.max_steps": 300,
           "checkpoint.every_steps": 10, "checkpoint.record_samples": "true",
           "trainer.eval_samples": 16, "distributed.timeout_s": 30, "run.name": "el"}


def _nodes(corpus_dir, cache_dir, cwd: Path, ranks, port):
    return {r: start_cli(node_args(corpus_dir, cache_dir, r, port, **ELASTIC), cwd) for r in ranks}


def _wait(cond, procs, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if any(p.poll() is not None for p in procs):
            errs = "\n".join(p.communicate()[1][-2000:] for p in procs if p.poll() is not None)
            pytest.fail(f"a node ended before {what}:\n{errs}")
        time.sleep(0.05)
    for p in procs:
        os.killpg(p.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_dir, cache_dir):
    """The run that never changed: the same 3 workers in one command (the session's cached run;
    3 nodes of one worker each on this host are that run, as test_multinode.py checks for 2),
    rather than 3 more node commands to start."""
    layout = {k: v for k, v in ELASTIC.items() if not k.startswith(("distributed.", "run."))}
    run = tiny_run(tmp_path_factory, corpus_dir, cache_dir, timeout=300,
                   **{**layout, "trainer.devices": "cpu:3", "distributed.timeout_s": 30}).dir
    assert read_summary(run)["world_history"] == [[0, 3]]
    return run


def _assert_continues_exactly(run: Path, ref: Path, change_step: int) -> None:
    """From the resume point on: the same sample ids per step, losses within 1e-5."""
    got, want = samples(run), samples(ref)
    assert sorted(got) == sorted(want) == list(range(1, ELASTIC["trainer.max_steps"] + 1))
    assert all(got[s] == want[s] for s in got), "a sample was repeated or skipped"
    a = {m["step"]: m["loss"] for m in read_metrics(run)}
    b = {m["step"]: m["loss"] for m in read_metrics(ref)}
    after = [s for s in b if s > change_step]
    assert after and max(abs(a[s] - b[s]) for s in after) < 1e-5


def test_a_lost_node_leaves_and_the_others_finish(tmp_path, reference, corpus_dir, cache_dir):
    procs = _nodes(corpus_dir, cache_dir, tmp_path, (0, 1, 2), free_port())
    run = tmp_path / "runs" / "el"
    _wait(lambda: len(committed_steps(run / "checkpoints")) >= 1 and steps_logged(run) >= 11,
          list(procs.values()), 240, "a committed snapshot")
    os.killpg(procs[2].pid, signal.SIGKILL)  # node 2's launcher and its worker
    procs[2].communicate()
    results = finish_all([procs[0], procs[1]], timeout=300)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    history = read_summary(run)["world_history"]
    assert history[0] == [0, 3] and history[-1][1] == 2 and len(history) == 2, history
    shrink = history[-1][0]
    assert shrink >= 10 and shrink % 10 == 0
    logs = "".join(err for _, _, err in results)
    assert f"world size 3 -> 2 at step {shrink} (a node left)" in logs
    _assert_continues_exactly(run, reference, shrink)


def test_a_late_node_is_taken_in(tmp_path, reference, corpus_dir, cache_dir):
    port = free_port()
    procs = _nodes(corpus_dir, cache_dir, tmp_path, (0, 1), port)
    run = tmp_path / "runs" / "el"
    # early: the new node's start-up (seconds under load) must end before the job does
    _wait(lambda: steps_logged(run) >= 2, list(procs.values()), 240, "step 2 on two nodes")
    procs[2] = start_cli(node_args(corpus_dir, cache_dir, 2, port, **ELASTIC), tmp_path)
    results = finish_all(list(procs.values()), timeout=300)
    for rc, _, err in results:
        assert rc == 0, err[-3000:]
    history = read_summary(run)["world_history"]
    assert history[0] == [0, 2] and history[-1][1] == 3, history
    grow = history[-1][0]
    logs = "".join(err for _, _, err in results)
    assert f"world size 2 -> 3 at step {grow} (a node joined)" in logs
    _assert_continues_exactly(run, reference, grow)


def test_a_global_batch_that_some_world_cannot_split(tmp_path, monkeypatch, capsys, corpus_dir,
                                                    cache_dir):
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, node_args(corpus_dir, cache_dir, 0, free_port(), **{
        **ELASTIC, "distributed.nnodes": "2:4", "trainer.global_batch_size": 16}))
    assert "cannot be split evenly over 3 worker(s)" in line and "multiple of 48" in line, line


@pytest.mark.parametrize("nnodes,words", [("3:2", "MIN (3) is larger than MAX (2)"),
                                          ("0:2", "at least 1"), ("two", "MIN:MAX")])
def test_bad_node_ranges(tmp_path, monkeypatch, capsys, nnodes, words):
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, ["train", f"distributed.nnodes={nnodes}",
                              "distributed.master_port=29999"])
    assert words in line, line
