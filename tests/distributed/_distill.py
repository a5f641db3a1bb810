"""A task of the test's own with a frozen model (a distillation teacher), handed to
`Trainer(task=...)`: it exercises the seam DPO's reference model uses. Importable by name, so
the worker processes can unpickle it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.tasks.base import NO_FROZEN, Frozen
from paratrain.tasks.user import UserTask

DIM = 16


def make_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, DIM))


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randn(n, DIM, generator=g))


def local_sum(model: nn.Module) -> float:
    """The sum of this rank's share of the parameters (a DTensor's local shard under FSDP)."""
    return sum(float((p.to_local() if hasattr(p, "to_local") else p).double().sum())
               for p in model.parameters())


@dataclass
class DistillTask(UserTask):
    """The student (model_factory) learns to match a fixed teacher's outputs."""
    teacher_seed: int = 7

    def build_frozen(self) -> dict[str, nn.Module]:
        torch.manual_seed(self.teacher_seed)
        return {"teacher": make_mlp()}

    def loss(self, model: nn.Module, batch: Any, device: torch.device, amp: ContextManager,
             frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        teacher = frozen["teacher"]
        # the seam's promises, checked on every micro-step in every worker
        assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
        seen = local_sum(teacher)
        if not hasattr(self, "_teacher_sum"):
            self._teacher_sum = seen
        assert seen == self._teacher_sum, "the frozen model changed"
        x = batch.to(device)  # (B, DIM)
        with torch.no_grad():
            target = teacher(x)  # (B, DIM)
        with amp:
            out = model(x)  # (B, DIM)
        per_sample = F.mse_loss(out.float(), target.float(), reduction="none").mean(-1)  # (B,)
        return per_sample.sum(), int(x.shape[0])
