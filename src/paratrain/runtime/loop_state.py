"""What the training loop carries from one optimizer step to the next, in one place.

`LoopState` is everything of the loop a snapshot saves and a resume gives back: with it, a resumed
run logs the same losses and stops at the same step as one that never stopped. The rest of a
snapshot is the Snapshotter's own (checkpoint/snapshotter.py): the model and optimizer tensors
(DCP), the LR schedule, the gradient scaler, every rank's RNG and the run's description (strategy,
batch, world history). The sampler's position is not stored: it follows from the step.

`LoopFigures` is what the loop measures of this run (throughput, step times, memory): not saved,
since a resumed run measures its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..checkpoint.snapshot_state import Resumed
from .early_stop import BestTracker


@dataclass
class LoopState:
    """The loop's position and running sums. A snapshot holds `step` in its marker and each
    rank's `to_snapshot()` (JSON) in marker["ranks"][rank]."""
    step: int = 0  # optimizer steps done
    # this rank's sums since the last log line: a resume continues the window, so the next
    # logged loss comes out the same. Floats, or float64 0-dim tensors on the device between
    # two log lines (read only when logged or saved: reading one on a GPU is a host sync)
    loss_sum: Any = 0.0
    count: Any = 0.0  # loss units
    counts: dict = field(default_factory=dict)  # the task's training counts (`train_counts`)
    best: BestTracker = field(default_factory=BestTracker)  # the same on every rank
    last: dict = field(default_factory=dict)  # the last log line (the run's final loss)

    def to_snapshot(self) -> dict:
        """This rank's part of a snapshot (JSON). The loop replaces `counts` and `last` rather
        than changing them, so a background save writes the values of its step."""
        return {"loss_sum": float(self.loss_sum), "count": float(self.count),
                "counts": {k: float(v) for k, v in self.counts.items()},
                "best": self.best.state_dict(), "last": self.last}

    def restore(self, resumed: Resumed, is_master: bool) -> None:
        """Continue after optimizer step `resumed.step`. The same world size: each rank takes
        its own sums back; another one: the window's sums of every rank move to rank 0 (the
        logged loss is their global mean either way). The best evaluation and the last log
        line are the same on every rank: any rank's copy will do."""
        self.step = resumed.step
        any_rank = resumed.rank or resumed.loop["ranks"][0]
        self.best.load_state_dict(any_rank.get("best", {}))
        self.last = dict(any_rank.get("last") or {})
        if resumed.rank is not None:
            self.loss_sum, self.count = resumed.rank["loss_sum"], resumed.rank["count"]
            self.counts = dict(resumed.rank.get("counts", {}))
        elif is_master:
            ranks = resumed.loop["ranks"]
            self.loss_sum = sum(r["loss_sum"] for r in ranks)
            self.count = sum(r["count"] for r in ranks)
            self.counts = add_counts({}, *(r.get("counts", {}) for r in ranks))


@dataclass
class LoopFigures:
    """What this run of the loop measured, for summary.json, `paratrain bench` and the memory
    table."""
    units: float = 0  # loss units trained on (tokens; texts or samples for other tasks)
    train_s: float = 0.0
    data_wait_s: float = 0.0  # time the loop waited for batches: should be ~0
    # Wall time of every step, end to end (data, step, logging, bar): `paratrain bench` takes
    # the median after warm-up, which leaves start-up and compilation out.
    step_times: list = field(default_factory=list)
    step_cpu_times: list = field(default_factory=list)  # CPU time of this process per step
    first_step_at: float = 0.0  # wall-clock ends of this run's first and last steps
    last_step_at: float = 0.0
    grads_bytes: Optional[int] = None  # measured once, while gradients exist
    activation_bytes: Optional[int] = None  # saved for backward by one micro-step


def add_counts(total: dict, *more: dict) -> dict:
    """Counts (numbers, or 0-dim tensors kept on the device) summed key by key (a new dict)."""
    out = dict(total)
    for counts in more:
        for key, value in counts.items():
            out[key] = out.get(key, 0.0) + value
    return out


def unread(x: Any) -> Any:
    """A sum to carry from step to step without reading it: a float, or a float64 0-dim tensor
    left on its device (reading one on a GPU is a host sync; the value is the one float() would
    give, and sums of either are the same float64 adds)."""
    return x.detach().double() if isinstance(x, torch.Tensor) else float(x)


def read_norm(norm: torch.Tensor) -> float:
    """A step's gradient norm, read at a log step. Every rank calls it: a sharded model's norm
    is a DTensor, whose whole value is a collective."""
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
