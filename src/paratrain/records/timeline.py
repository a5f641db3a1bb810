"""Where a run's first minute went: the wall-clock time at which each part of the start-up ended,
in the launcher and then in the workers, so that summary.json can say how long each took (and
benchmarks/startup.py can lay paratrain beside torchrun and Hugging Face's Trainer).

Wall-clock (Unix) times rather than a per-process counter, because the parts happen in different
processes (the launcher, then each worker) that share one clock. A phase's length is the time
from the previous mark to its own; the first mark is when the command's process started.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional


def process_start_time(pid: Optional[int] = None) -> Optional[float]:
    """When process `pid` (default: this one) was started, in Unix seconds (10 ms resolution);
    None where /proc does not say (not Linux)."""
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        ticks = int(fields[19])  # field 22 (starttime, clock ticks after boot); [0] is field 3
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's is whole s
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


@dataclass
class Timeline:
    """The start of the command and, in order, the end of each start-up phase (name -> Unix
    time). A launcher hands its timeline to its workers, which go on marking."""
    start: float
    marks: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_this_process(cls) -> "Timeline":
        return cls(process_start_time() or time.time())

    def mark(self, phase: str, at: Optional[float] = None) -> None:
        """`phase` ended now (or at `at`)."""
        self.marks[phase] = time.time() if at is None else at

    def continued_in_worker(self) -> "Timeline":
        """This (the launcher's) timeline, carried on by a worker it started: the worker's
        process start ends the `spawn` phase."""
        worker = Timeline(self.start, dict(self.marks))
        worker.mark("spawn", process_start_time())
        return worker

    def phases(self, upto: str) -> dict[str, float]:
        """{phase: seconds} for each phase up to and including `upto`, and `total`: seconds from
        the start to the end of `upto`."""
        out, before = {}, self.start
        for phase, at in self.marks.items():
            out[phase] = round(at - before, 3)
            before = at
            if phase == upto:
                out["total"] = round(at - self.start, 3)
                break
        return out
