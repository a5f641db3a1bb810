"""Torch threads per rank (runplan.thread_share): OMP_NUM_THREADS when set, else the cores
shared by the ranks on the host; a single-process run on a shared machine pinned by the user
keeps the user's number (issue 41: 23-50 s steps unpinned against 0.4-3 s pinned)."""

from __future__ import annotations

import pytest

from paratrain.runplan import thread_share


@pytest.mark.parametrize("omp, ranks, want", [
    ("3", 1, (3, "OMP_NUM_THREADS")),
    ("1", 4, (1, "OMP_NUM_THREADS")),
    (None, 1, (16, "cores")),
    (None, 4, (4, "cores")),
    ("", 2, (8, "cores")),
    ("zero", 1, (16, "cores")),
    ("0", 1, (16, "cores")),
])
def test_omp_num_threads_is_respected_when_set(omp, ranks, want):
    share = thread_share(16, ranks, omp)
    assert (share["cpu_threads"], share["threads_from"]) == want


def test_a_single_process_run_sets_the_threads_the_plan_says(monkeypatch):
    """What the rank applies: the plan's number, whatever the cores."""
    import torch

    from paratrain.launch.environment import cpu_count
    from paratrain.runtime.rank import _share_cores
    before = torch.get_num_threads()

    class Env:
        device = torch.device("cpu")
        local_world_size = 1

    class Plan:
        cpu_threads = 1 if cpu_count() > 1 else 2

    try:
        _share_cores(Env(), Plan())
        assert torch.get_num_threads() == Plan.cpu_threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("omp, want", [("1", 1), (None, None)])
def test_a_rank_without_a_plan_keeps_omp_num_threads(monkeypatch, omp, want):
    """torchrun, Slurm and every elastic round start their ranks with no plan: they take the
    share the plan would (OMP_NUM_THREADS when set), not the cores alone (an elastic job on a
    2-core host with OMP_NUM_THREADS=1 ran 2 OpenMP threads per rank, each step spinning)."""
    import torch

    from paratrain.launch.environment import cpu_count
    from paratrain.runtime.rank import _share_cores
    before = torch.get_num_threads()

    class Env:
        device = torch.device("cpu")
        local_world_size = 1

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    try:
        _share_cores(Env(), None)
        assert torch.get_num_threads() == (want or max(1, cpu_count()))
    finally:
        torch.set_num_threads(before)
