"""The few numbers the loop must agree on between ranks every step, kept off the device and out of
the step's critical path.

Each step the ranks must agree whether to stop (a stop signal on any rank), and, for padded rows,
how many loss units the whole global batch has (the loss scale, needed before backward). On a
GPU job (nccl) a reduction on the default group puts a tensor on the GPU and reads it back: a
host sync that drains the device queue every step. Here both go through a gloo group of their
own (host memory only, as the snapshotter's background saves do), so they never touch the GPU
and never interleave with the model's collectives on one communicator.

The stop flag is also asynchronous: each step's check is started at the top of the step and
read at the top of the next, so it runs while the step computes. Every rank still learns it at
the same step boundary, one step later than a blocking check would (a signal that comes during
step k stops the job after step k + 1 instead of after step k); the first check, before the
first step, is read at once, so a signal that came during start-up still stops before any step.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Optional, Sequence

import torch

from ..dist import DistEnv


class HostGroup:
    """Reductions of host numbers over every rank, on a gloo group of the job's ranks (None
    for a single process: the values are already everyone's)."""

    def __init__(self, env: DistEnv):
        self.env = env
        self.group: Any = None
        if env.distributed:
            import torch.distributed as dist
            self.group = dist.new_group(backend="gloo",
                                        timeout=_dt.timedelta(seconds=env.timeout_s))
        self._inflight: Optional[tuple[torch.Tensor, Any]] = None  # a stop check: flag, work

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks (blocking: the caller needs the result now)."""
        t = torch.tensor(list(values), dtype=torch.float64)  # (n,), host memory
        if self.group is not None:
            import torch.distributed as dist
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def stop_agreed(self, signum: int) -> int:
        """The largest stop signal number any rank had noted when the previous call was made
        (0: none); this rank's `signum` goes into the check the next call reads. The first
        call reads its own check at once. Every rank must call it at the same points."""
        if self.group is None:
            return signum
        if self._inflight is None:  # the first check: read at once
            self._inflight = self._start(signum)
        flag, work = self._inflight
        self._inflight = self._start(signum)  # read by the next call: runs during the step
        work.wait()
        return int(flag.item())

    def _start(self, signum: int) -> tuple[torch.Tensor, Any]:
        import torch.distributed as dist
        flag = torch.tensor([float(signum)], dtype=torch.float64)  # (1,), host memory
        return flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)

    def drain(self) -> None:
        """Wait for the check in flight (the loop ended normally on every rank: each rank
        started it, so it completes)."""
        if self._inflight is not None:
            self._inflight[1].wait()
            self._inflight = None
