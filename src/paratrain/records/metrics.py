"""The run's numbers: metrics.jsonl (one line per logged step, appended so a crash keeps every
line) and the throughput of the window between two log lines. Only global rank 0 writes; the
other ranks get a writer that does nothing."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Optional


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, appended and flushed line by line so a
    crashed run keeps every line it logged (a line is one write; a reader never sees half).
    `sinks` (loggers.RunRecords: TensorBoard, W&B, MLflow) get each record too; their owner,
    train(), closes them, since the memory figures of the summary go there after the loop."""

    def __init__(self, path: Optional[Path], sinks: Any = None):
        self.path = path
        self._f = open(path, "a") if path is not None else None
        self._sinks = sinks

    def write(self, record: dict) -> None:
        if self._f is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                     for k, v in record.items()}
            self._f.write(json.dumps(clean) + "\n")
            self._f.flush()
        if self._sinks is not None:
            self._sinks.write(record)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Throughput:
    """Tokens and seconds since the last report: tokens/s and mean step time of the window."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0
        self.steps = 0
        self.data_wait = 0.0

    def wait(self, seconds: float) -> None:
        self.data_wait += seconds

    def add(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def report(self) -> dict:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"tokens_per_s": self.tokens / dt, "step_time_s": dt / max(1, self.steps),
               "data_wait_s": self.data_wait / max(1, self.steps)}
        self.reset()
        return out
