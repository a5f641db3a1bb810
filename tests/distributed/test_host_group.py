"""The loop's per-step agreement (runtime/host_group.py) on 2 real gloo ranks: a stop signal
noted on one rank reaches every rank at the same check, one check after the one it was noted
for (the check runs during a step); the first check answers at once; sums are sums."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp

from paratrain.launch.environment import free_port
from tests.distributed import _workers

pytestmark = pytest.mark.timeout(180)


def test_stop_check_reaches_every_rank_at_the_same_step(tmp_path):
    out = str(tmp_path / "host")
    ctx = mp.start_processes(_workers.host_group_checks, args=(2, free_port(), out), nprocs=2,
                             join=False, start_method="spawn")
    assert ctx.join(timeout=120) or ctx.join(timeout=30), "workers did not finish in time"
    got = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    # rank 1 noted SIGTERM (15) at its third check: every rank sees it at the fourth
    assert got[0]["seen"] == got[1]["seen"] == [0, 0, 0, 15, 15], got
    assert got[0]["sum"] == got[1]["sum"] == [3.0, 5.0], got


def test_one_process_needs_no_group():
    from paratrain.dist import DistEnv
    from paratrain.runtime.host_group import HostGroup
    host = HostGroup(DistEnv.single())
    assert host.group is None
    assert host.stop_agreed(15) == 15 and host.sum([2.0, 3.0]) == [2.0, 3.0]
