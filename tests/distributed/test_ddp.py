"""DDP with 2 real gloo worker processes: replicas agree, and the run does not depend on the
world size (same global batch and seed -> same losses, same validation loss; with accumulation
and padded rows: the task contract, tests/e2e/test_task_contract.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp

from paratrain.launch.environment import free_port
from tests._progress import join_while_progressing
from tests._runs import tiny_run
from tests.conftest import read_metrics, read_summary
from tests.distributed import _workers

pytestmark = pytest.mark.timeout(300)


@pytest.mark.timeout(1800)  # the last resort: the wait is bounded by the workers' progress
def test_ddp_parameters_stay_identical_across_ranks(tmp_path):
    out = str(tmp_path / "params")
    ctx = mp.start_processes(_workers.ddp_replicas, args=(2, free_port(), out), nprocs=2,
                             join=False, start_method="spawn")
    join_while_progressing(ctx)
    p0, p1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert torch.equal(p0, p1)
    # and they moved: the ranks trained, they did not just keep the initial weights
    assert p0.abs().sum() > 0


def _train(tmp_path_factory, corpus_dir, cache_dir, devices, batch, global_batch, **extra):
    """The session's run of this layout (with `ONE_WORKER` / `TWO_WORKERS`'s layout it is the one
    the FSDP, HSDP and multi-node tests compare against too)."""
    run = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **{
        "trainer.devices": devices, "trainer.batch_size": batch,
        "trainer.global_batch_size": global_batch, "trainer.eval_samples": 37, **extra})
    return [m["loss"] for m in read_metrics(run.dir)], read_summary(run.dir)


@pytest.mark.slow
def test_one_and_two_workers_give_the_same_run(tmp_path_factory, corpus_dir, cache_dir):
    """The session's standard runs (`ONE_WORKER`, `TWO_WORKERS`: what the FSDP, HSDP and
    multi-node tests compare against): the first 10 losses within 1e-5, each run says its
    layout, and every validation sample counts once. Accumulation (on 1 and on 2 workers),
    padded rows and a killed run's resume: the task contract's lm rows
    (tests/e2e/test_task_contract.py)."""
    one, s1 = _train(tmp_path_factory, corpus_dir, cache_dir, "cpu:1", 8, 8)
    two, s2 = _train(tmp_path_factory, corpus_dir, cache_dir, "cpu:2", 4, 8)
    assert len(one) == len(two) == 10
    assert (s1["world_size"], s2["world_size"], s2["grad_accum"]) == (1, 2, 1)
    assert s2["strategy"] == "ddp" and s1["strategy"] == "single"
    assert max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)
    assert one[-1] < one[0]  # it learns
    assert math.isclose(s1["val_loss"], s2["val_loss"], abs_tol=1e-6)
