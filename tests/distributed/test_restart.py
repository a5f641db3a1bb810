"""A worker dies (SIGKILL) in the middle of a 2-worker run with distributed.max_restarts=1: the
elastic agent restarts the group, it resumes from the last committed snapshot, and the run ends
bit-identical to one that was never interrupted (losses, sample ids, final weights)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import finish, read_summary, start_cli
from tests.distributed._snapshot_helpers import (
    args_for,
    assert_bit_identical,
    committed_steps,
    reference_run,
    steps_logged,
    wait_for,
    worker_pids,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


# ddp: BASE's auto; pp: a pipeline of 2 stages, killing the last stage's process
LAYOUTS = {"ddp": {}, "fsdp": {"trainer.strategy": "fsdp"},
           "pp": {"model.num_layers": 4, "trainer.batch_size": 2, "trainer.pipeline_parallel": 2}}


@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_sigkill_one_worker_restarts_and_ends_bit_identical(tmp_path, tmp_path_factory,
                                                            corpus_dir, cache_dir, strategy):
    extra = LAYOUTS[strategy]
    ref = reference_run(tmp_path_factory, corpus_dir, cache_dir, **extra)
    assert read_summary(ref)["strategy"] == strategy
    args = args_for(corpus_dir, cache_dir, "restarted", **extra,
                    **{"distributed.max_restarts": 1})
    run_dir = tmp_path / "runs" / "restarted"

    proc = start_cli(args, tmp_path)
    wait_for(lambda: committed_steps(run_dir / "checkpoints") and steps_logged(run_dir) >= 10,
             proc, what="step 10 with a committed snapshot")
    workers = worker_pids(proc.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)  # rank 1 (spawned second), mid-run
    r = finish(proc, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = read_summary(run_dir)["resumed_from"]
    assert resumed is not None and resumed["step"] in (4, 8, 12), resumed
    assert f"resumed from step {resumed['step']} " in r.stderr
    assert_bit_identical(run_dir, ref)


def test_restarts_exhausted_fail_naming_the_rank(tmp_path, corpus_dir, cache_dir):
    """max_restarts=0: the first death ends the run, with one line that names rank and cause."""
    args = args_for(corpus_dir, cache_dir, "dies", **{"distributed.max_restarts": 0})
    run_dir = tmp_path / "runs" / "dies"
    proc = start_cli(args, tmp_path)
    wait_for(lambda: steps_logged(run_dir) >= 2, proc, what="step 2")
    workers = worker_pids(proc.pid)
    os.kill(workers[1], signal.SIGKILL)
    r = finish(proc, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain: error: worker rank") and "SIGKILL" in last, last
