"""What each `trainer.pipeline_schedule` is: the torch.distributed.pipelining class that runs it,
the micro-batches' activations it keeps in flight on the first stage (the memory plan's figure),
and its ideal bubble (`paratrain bench`'s figure). How many stages each process runs is the
config table's (config.checks.PIPELINE_SCHEDULES), checked before anything is imported.

With P processes in the pipeline, V stages per process and M micro-batches per step, counting
time in one stage's forward (F), backward for its input (B) and backward for its weights (W),
taken as equal, as the papers do:

- `gpipe`: all M forwards, then all M backwards; M micro-batches in flight; idle (P - 1) of
  the M + P - 1 slots of a step.
- `1f1b`: one forward, one backward in turn once the pipeline is full; at most P in flight;
  the same bubble as GPipe, (P - 1) / (M + P - 1).
- `interleaved-1f1b` (V = 2, stages s and s + P on one process): a bubble V times smaller,
  (P - 1) / (V x M + P - 1), for V times the messages.
- `zero-bubble`: torch's ScheduleInterleavedZeroBubble, the ZB-1P schedule of "Zero Bubble
  Pipeline Parallelism" (Qi et al., 2024, arXiv:2401.10241) on the interleaved placement: each
  backward is split into B, which the previous stage waits for, and W, which nothing waits for
  and which fills the slots 1F1B leaves idle. Its in-flight activations are 1F1B's (the paper's
  ZB-H1 memory bound); its bubble is ZB-H1's (P - 1)(F + B - W), a third of 1F1B's when F = B = W:
  (P - 1) / (3 x V x M + P - 1).
"""

from __future__ import annotations

from typing import Any

from ..config.checks import PIPELINE_SCHEDULES

# trainer.pipeline_schedule -> the class of torch.distributed.pipelining.schedules that runs it
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe",
                   "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zero-bubble": "ScheduleInterleavedZeroBubble"}
# the schedules that split each backward into input and weight gradients (no torch.compile)
SPLIT_BACKWARD = ("zero-bubble",)


def schedule_class(schedule: str) -> Any:
    from torch.distributed.pipelining import schedules
    return getattr(schedules, TORCH_SCHEDULES[schedule])


def in_flight(schedule: str, pp: int, micro_batches: int, pp_rank: int = 0) -> int:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at the peak of a step: GPipe
    all of them; the others (1F1B's order) one per stage from it to the end of the pipeline, so
    the first holds the most (P) and the last one."""
    return micro_batches if schedule == "gpipe" else min(micro_batches, pp - pp_rank)


def ideal_bubble(schedule: str, pp: int, micro_batches: int) -> float:
    """The fraction of a step each process idles when every forward and backward part takes the
    same time (see the module's docstring)."""
    work = PIPELINE_SCHEDULES[schedule] * micro_batches  # stage-micro-batches per process
    if schedule in SPLIT_BACKWARD:
        work *= 3  # F, B and W: the bubble is one of the three (F + B - W)
    return (pp - 1) / (work + pp - 1)
