"""A DPO task that checks, on every micro-step of every worker (and in every evaluation), that
its frozen reference is bitwise the model it was loaded from: the full tensors (gathered from
their FSDP shards) against model.path's safetensors. Importable by name, so the worker processes
can unpickle it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paratrain.tasks.preference.dpo import DPOTask


@dataclass
class CheckedDPOTask(DPOTask):
    report_dir: str = ""  # each process writes how many checks it made here
    checks: int = 0

    def _check_reference(self, frozen: Any) -> None:
        from safetensors.torch import load_file
        if not hasattr(self, "_original"):
            self._original = load_file(f"{self.cfg.model.path}/model.safetensors")
        for name, p in frozen["reference"].named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective under FSDP
            assert not p.requires_grad and torch.equal(full.detach().cpu(), self._original[name]), \
                f"the reference's {name} changed"
        self.checks += 1
        Path(self.report_dir, f"{os.getpid()}.checks").write_text(str(self.checks))

    def train_counts(self, model, batch, device, amp, frozen=None):
        self._check_reference(frozen)
        return super().train_counts(model, batch, device, amp, frozen)

    def eval_counts(self, model, batch, device, amp, frozen=None):
        self._check_reference(frozen)
        return super().train_counts(model, batch, device, amp, frozen)
