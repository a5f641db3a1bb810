"""What a run reports: the console log, metrics.jsonl, summary.json, memory per rank, the bar.

Only global rank 0 writes; every other rank gets writers that do nothing, so the loop has no
rank checks of its own.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from .dist import DistEnv
from .strategies import local_bytes


def log(env: DistEnv, msg: str) -> None:
    """One line on global rank 0's stderr (stdout stays clean for results)."""
    if env.is_master:
        print(f"[paratrain] {msg}", file=sys.stderr, flush=True)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory, fsync, rename: a reader sees the old file or the new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; outputs are for sharing
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _jsonable(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


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


class ProgressBar:
    """tqdm on global rank 0 only; a no-op elsewhere or when switched off."""

    def __init__(self, env: DistEnv, total: int, initial: int = 0, enabled: bool = True):
        self._bar = None
        self._env = env
        if env.is_master and enabled:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step",
                             dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)

    def write(self, msg: str) -> None:
        """A log line that does not tear the bar apart."""
        if self._bar is not None:
            self._bar.write(f"[paratrain] {msg}", file=sys.stderr)
        else:
            log(self._env, msg)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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


class SavedTensorMeter:
    """Bytes autograd saves for backward while this context is open: the activation memory of a
    step, measured the same way on every device (RSS on a CPU mixes in the allocator and the
    interpreter). Parameters and repeated views of one storage are counted once, not at all for
    parameters."""

    def __init__(self, model: nn.Module):
        self._params = {_storage_ptr(p) for p in model.parameters() if p.device.type != "meta"}
        self._seen: dict[int, int] = {}
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = _storage_ptr(local)
        if ptr is not None and ptr not in self._params and not isinstance(t, nn.Parameter):
            self._seen[ptr] = local.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def _storage_ptr(t: torch.Tensor) -> Optional[int]:
    """None for storages that FSDP has freed (resized to nothing) between uses."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated by the caching allocator on GPUs; peak resident set of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def memory_entry(env: DistEnv, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 grads_bytes: Optional[int] = None, activation_bytes: Optional[int] = None
                 ) -> dict:
    """This rank's state bytes. Gradients are freed between steps, so the loop passes what it
    measured while they were alive."""
    params = list(model.parameters())
    opt_tensors = []
    if optimizer is not None:
        for state in optimizer.state.values():
            opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    entry = {"rank": env.rank, "device": str(env.device),
             "params_bytes": local_bytes(params),
             "grads_bytes": local_bytes(p.grad for p in params) if grads_bytes is None
             else grads_bytes,
             "optimizer_bytes": local_bytes(opt_tensors),
             "activation_bytes": activation_bytes,
             "peak_bytes": peak_memory_bytes(env.device)}
    if env.device.type == "cuda":
        entry["reserved_bytes"] = int(torch.cuda.max_memory_reserved(env.device))
    return entry


def gather_memory(env: DistEnv, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                  grads_bytes: Optional[int] = None, activation_bytes: Optional[int] = None
                  ) -> list[dict]:
    """Every rank's memory entry, gathered to all ranks (rank 0 prints and saves them)."""
    return env.gather_objects(memory_entry(env, model, optimizer, grads_bytes,
                                           activation_bytes))


def format_memory_table(rows: list[dict]) -> str:
    def mb(x: int) -> str:
        return f"{x / 2**20:9.1f}"
    lines = ["rank  device     params MB  grads MB  optim MB  activ MB   peak MB"]
    for r in rows:
        lines.append(f"{r['rank']:>4}  {r['device']:<9} {mb(r['params_bytes'])} "
                     f"{mb(r['grads_bytes'])} {mb(r['optimizer_bytes'])} "
                     f"{mb(r.get('activation_bytes') or 0)} {mb(r['peak_bytes'])}")
    return "\n".join(lines)
