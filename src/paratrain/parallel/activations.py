"""Activations for the memory plan: what one sample's forward (and loss) saves for backward,
measured on the CPU with the meter the training loop uses. Autocast's low-precision copies of the
weights are saved too, but once per forward whatever the micro-batch: they are counted apart (on
an H100, multiplying them by a micro-batch of 4 put a 280M Llama's planned peak 49% over the
measured one). A model whose blocks are alike can be measured cut to one block and to two and
extrapolated (tasks/probe.py), so a large one is never built whole on the CPU.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .memory import SavedTensorMeter, storage_ptr

AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.bfloat16, "bf16-true": None}


@dataclass(frozen=True)
class SavedBytes:
    """What one sample's forward (and loss) saves for backward: `casts`, autocast's low-precision
    copies of the weights, made once per forward whatever the micro-batch (none under FSDP, whose
    mixed-precision policy gathers the weights in low precision instead), and `per_sample`, the
    rest, which grows with the micro-batch."""
    casts: int
    per_sample: int

    def of_batch(self, micro_batch: int, sharded: bool = False) -> int:
        return (0 if sharded else self.casts) + micro_batch * self.per_sample

    def extrapolated(self, two: "SavedBytes", blocks: int) -> "SavedBytes":
        """From this model cut to one block and `two`, cut to two: the model of `blocks`."""
        return SavedBytes(self.casts + (blocks - 1) * (two.casts - self.casts),
                          self.per_sample + (blocks - 1) * (two.per_sample - self.per_sample))


class _WeightCasts(TorchDispatchMode):
    """Records the copies made of the parameters (autocast's `_to_copy`), weakly: a storage is a
    copy's while that copy lives (a freed copy's address may hold an activation next)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        super().__init__()
        self._params = {storage_ptr(p) for p in params}
        self._copies: dict = {}  # storage -> weakref to the copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and storage_ptr(args[0]) in self._params:
            self._copies[storage_ptr(out)] = weakref.ref(out)
        return out

    def __contains__(self, storage: Any) -> bool:
        copy = self._copies.get(storage)
        return copy is not None and copy() is not None


def activation_bytes_per_sample(factory: Callable[[], nn.Module], seq_length: int,
                                vocab_size: int, precision: str, checkpointing: bool,
                                shallow: Optional[tuple[Callable[[int], nn.Module], int]] = None
                                ) -> SavedBytes:
    """Bytes saved for backward by one sample's forward (and loss), measured on the CPU.
    `shallow`: (the model cut to n blocks, its blocks): measured on 1 and 2, extrapolated."""
    from .parallelize import apply_activation_checkpointing
    if shallow is not None:
        cut, blocks = shallow
        one, two = (activation_bytes_per_sample(partial(cut, n), seq_length, vocab_size,
                                                precision, checkpointing) for n in (1, 2))
        return one.extrapolated(two, blocks)
    model = cpu_model(factory, precision)
    if checkpointing:
        apply_activation_checkpointing(model)
    idx = torch.randint(0, vocab_size, (1, seq_length))  # (1, T)
    return saved_bytes(model, idx, idx, precision)


def cpu_model(factory: Callable[[], nn.Module], precision: str) -> nn.Module:
    """The model built on the CPU from a fixed seed, in bf16 for bf16-true."""
    torch.manual_seed(0)
    model = factory()
    return model.to(torch.bfloat16) if precision == "bf16-true" else model


def saved_bytes(module: nn.Module, x: torch.Tensor, targets: Optional[torch.Tensor],
                precision: str) -> SavedBytes:
    """What autograd saves in `module`'s forward of x (and the loss, given `targets`)."""
    dtype = AUTOCAST.get(precision)
    amp = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
    casts = _WeightCasts(module.parameters())
    with SavedTensorMeter(module, casts.__contains__) as meter, casts, amp:
        out = module(x)  # (1, T, V), a pipeline stage's (1, T, C) or a classifier's (1, C)
        if targets is not None:
            scores = out.float().flatten(0, -2)  # (T, V), or a classifier's one row (1, C)
            labels = targets.flatten()[:len(scores)] % scores.shape[-1]  # (T,) or (1,)
            torch.nn.functional.cross_entropy(scores, labels)
    return SavedBytes(meter.cast_bytes, meter.bytes - meter.cast_bytes)
