"""A rank that stalls must not hang the job silently: the job ends within timeout_s + 30 s, the
error names the stalled rank and the step, and the live ranks' stacks are in the run dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from paratrain.dist import DistEnv
from paratrain.launch.watchdog import Watchdog
from tests.conftest import tiny_overrides
from tests.distributed._snapshot_helpers import worker_pids

pytestmark = pytest.mark.timeout(150)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.slow
def test_sigstopped_worker_is_named_and_the_job_ends(tmp_path, corpus_dir, cache_dir):
    args = ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "run.name": "stall", "trainer.devices": "cpu:2", "trainer.max_steps": 100000,
        "distributed.timeout_s": 10})  # how long a stall lasts before it is named: the wait
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "paratrain"] + args, cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    run_dir = tmp_path / "runs" / "stall"
    try:
        deadline = time.monotonic() + 90
        while not ((run_dir / "metrics.jsonl").exists() and
                   len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 30):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        time.sleep(2.0)  # a few heartbeats from inside the loop
        workers = worker_pids(p.pid)  # in local-rank order (started one after another)
        assert len(workers) == 2, workers
        stopped, other = 1, 0
        os.kill(workers[stopped], signal.SIGSTOP)
        t_stop = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t_stop
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # SIGKILL ends stopped processes too
            p.communicate()
    assert p.returncode != 0
    assert took < 60, took
    line = [x for x in err.splitlines() if x.startswith("paratrain: error: ")][-1]
    assert f"rank {stopped} stalled at step " in line, line
    assert "stopped or frozen" in line and "distributed.timeout_s=10" in line
    stack = (run_dir / "stacks" / f"rank-{other}.txt").read_text()
    assert "all threads" in stack and "trainer.py" in stack  # where the live rank waited
    assert not (run_dir / "stacks" / f"rank-{stopped}.txt").exists()
    assert not any(Path(f"/proc/{w}").exists() and "multiprocessing" in
                   Path(f"/proc/{w}/cmdline").read_text(errors="ignore") for w in workers)


# ---- the diagnosis, without processes: two watchdogs over one in-memory store -----------------
def _pair(tmp_path, timeout_s=20.0):
    store = dist.HashStore()
    dogs = [Watchdog(DistEnv(rank=r, world_size=2, local_world_size=2, timeout_s=timeout_s),
                     tmp_path, timeout_s, store) for r in (0, 1)]
    return store, dogs


def test_a_rank_behind_the_others_is_named(tmp_path, monkeypatch):
    """Rank 1 never returns from data loading while rank 0 waits in backward of the same step."""
    store, (d0, d1) = _pair(tmp_path)
    d0.progress.at(7, "backward")
    d1.progress.at(7, "data")
    for beat in (1, 2):
        d0._beat(beat)
        d1._beat(beat)
        d0._observe()
    v = d0._diagnose(dead_after=10, collective=True)
    assert [s["rank"] for s in v["stalled"]] == [1]
    assert "rank 1 stalled at step 7" in v["message"]
    assert "alive but not moving" in v["message"] and "step 7 (data)" in v["message"]


def test_a_silent_rank_is_named_and_verdict_is_shared(tmp_path, monkeypatch):
    store, (d0, d1) = _pair(tmp_path)
    d0.progress.at(3, "backward")
    d1.progress.at(3, "forward")
    d0._beat(1)
    d1._beat(1)
    d0._observe()
    clock = time.monotonic() + 30  # rank 1 says nothing for 30 s, rank 0 keeps beating
    monkeypatch.setattr(time, "monotonic", lambda: clock)
    d0._beat(2)
    d0._observe()
    v = d0._publish(d0._diagnose(dead_after=10, collective=True))
    assert v["stalled"][0]["rank"] == 1 and v["stalled"][0]["frozen"]
    assert "no heartbeat for 30 s" in v["message"]
    assert json.loads(store.get("verdict"))["message"] == v["message"]
    assert d1._read_verdict()["message"] == v["message"]  # everyone ends with the same line
    d1._dump(v)
    assert "rank 1" in (tmp_path / "stacks" / "rank-1.txt").read_text()


def test_everyone_alive_and_level_is_not_a_stall(tmp_path):
    """A slow phase on every rank (compilation, a long evaluation) names nobody."""
    store, (d0, d1) = _pair(tmp_path)
    for d in (d0, d1):
        d.progress.at(1, "forward")
        d._beat(1)
    d0._observe()
    v = d0._diagnose(dead_after=10, collective=False)
    assert v["stalled"] == []
