"""Memory accounting: what each rank holds (parameters, gradients, optimizer state), what autograd
saves for backward (activations), and the peak. The verbose tables, summary.json's `memory`, the
memory plan and `bench` all count with these functions, so their figures agree."""

from __future__ import annotations

import resource
import sys
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from ..dist import DistEnv


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for these tensors (the local shard of a DTensor)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


class SavedTensorMeter:
    """Bytes autograd saves for backward while this context is open: the activation memory of a
    step, measured the same way on every device (RSS on a CPU mixes in the allocator and the
    interpreter). Parameters and repeated views of one storage are counted once, not at all for
    parameters."""

    def __init__(self, model: nn.Module, is_cast: Optional[Callable[[Any], bool]] = None):
        self._params = {storage_ptr(_local(p)) for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._casts: set = set()
        self._is_cast = is_cast
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        ptr = storage_ptr(local)
        if ptr is not None and ptr not in self._params and not isinstance(t, nn.Parameter):
            self._seen[ptr] = local.untyped_storage().nbytes()
            if self._is_cast is not None and self._is_cast(ptr):
                self._casts.add(ptr)
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def cast_bytes(self) -> int:
        """The saved bytes that `is_cast` named copies of the weights when they were saved."""
        return sum(self._seen[p] for p in self._casts)

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def storage_ptr(t: torch.Tensor) -> Optional[int]:
    """What identifies a storage: its address, or on the meta device (the plan's simulation),
    where every address is 0, the storage object itself. None for storages that FSDP has freed
    (resized to nothing) between uses."""
    try:
        storage = t.untyped_storage()
        return storage._cdata if t.device.type == "meta" else storage.data_ptr()
    except RuntimeError:
        return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated by the caching allocator on GPUs; peak resident set of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def memory_entry(env: DistEnv, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                 grads_bytes: Optional[int] = None, activation_bytes: Optional[int] = None,
                 frozen: Sequence[nn.Module] = ()) -> dict:
    """This rank's state bytes. Gradients are freed between steps, so the loop passes what it
    measured while they were alive. `frozen`: models run but not trained (their parameters are
    `frozen_bytes`, reported only when a task has any)."""
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
    if frozen:
        entry["frozen_bytes"] = local_bytes(p for m in frozen for p in m.parameters())
    if env.device.type == "cuda":
        entry["reserved_bytes"] = int(torch.cuda.max_memory_reserved(env.device))
    return entry


def gather_memory(env: DistEnv, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
                  grads_bytes: Optional[int] = None, activation_bytes: Optional[int] = None,
                  frozen: Sequence[nn.Module] = ()) -> list[dict]:
    """Every rank's memory entry, gathered to all ranks (rank 0 prints and saves them)."""
    return env.gather_objects(memory_entry(env, model, optimizer, grads_bytes,
                                           activation_bytes, frozen))


def format_memory_table(rows: list[dict]) -> str:
    def mb(x: int) -> str:
        return f"{x / 2**20:9.1f}"
    frozen = any("frozen_bytes" in r for r in rows)  # a task's untrained models, when it has any
    lines = ["rank  device     params MB  grads MB  optim MB  activ MB   peak MB"
             + (" frozen MB" if frozen else "")]
    for r in rows:
        lines.append(f"{r['rank']:>4}  {r['device']:<9} {mb(r['params_bytes'])} "
                     f"{mb(r['grads_bytes'])} {mb(r['optimizer_bytes'])} "
                     f"{mb(r.get('activation_bytes') or 0)} {mb(r['peak_bytes'])}"
                     + (f" {mb(r.get('frozen_bytes', 0))}" if frozen else ""))
    return "\n".join(lines)
