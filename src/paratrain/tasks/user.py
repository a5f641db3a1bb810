"""The user's own model and data (`Trainer(model=..., train_data=...)`) as a task: any nn.Module
factory, map-style dataset, collate and loss. Samples are the loss unit: the user's batch-mean
loss is turned back into a sum, so micro-batches and ranks of any size weigh each sample equally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigError
from ..formatting import human_count
from .base import NO_FROZEN, Frozen, MemoryProbe, Task, to_device


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch
    for v in items:
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
        if isinstance(v, (dict, list, tuple)):
            return batch_len(v)
    raise ConfigError("cannot tell the batch size of a batch without tensors; make collate_fn "
                      "return tensors (or dicts / tuples of tensors)")


@dataclass
class UserTask(Task):
    """The user's own model and data (see `Trainer(model=..., train_data=...)`)."""
    model_factory: Callable[[], nn.Module]
    train_ds: Any
    val_ds: Any = None
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
    collate_fn: Optional[Callable] = None
    fsdp_wrap: Sequence[type] = field(default_factory=tuple)
    units_per_sample: Optional[int] = 1  # samples are the loss unit
    sample_name: str = "samples"
    unit_name: str = "samples"
    perplexity: bool = False
    tokenizer_path: Optional[Path] = None
    data_fingerprint: Optional[str] = None

    def build_model(self) -> nn.Module:
        model = self.model_factory()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model= must be a callable returning an nn.Module; it returned "
                              f"{type(model).__name__}")
        return model

    @property
    def collate(self) -> Callable:
        from torch.utils.data import default_collate
        return self.collate_fn or default_collate

    def count_units(self, batch: Any) -> int:
        return batch_len(batch)

    def loss(self, model: nn.Module, batch: Any, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        """(loss x samples, samples): the user's batch mean turned back into a sum, so that
        micro-batches and ranks of different sizes weigh each sample equally."""
        batch = to_device(batch, device)
        n = batch_len(batch)
        with amp:
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, (list, tuple)):
                out = model(batch[0])
            else:
                out = model(batch)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, batch)
        elif hasattr(out, "loss") and out.loss is not None:
            loss = out.loss
        elif isinstance(out, dict) and "loss" in out:
            loss = out["loss"]
        elif isinstance(out, torch.Tensor) and out.dim() == 0:
            loss = out
        else:
            raise ConfigError("the model did not return a loss; pass loss_fn=(output, batch) -> "
                              "loss to Trainer, or return a scalar (or an object with .loss)")
        return loss.float() * n, n

    def describe(self, n_params: int) -> str:
        return f"model {self.model_info['factory']}: {human_count(n_params)} parameters"

    def shortage_message(self, global_batch: int) -> str:
        return (f"train_data has {len(self.train_ds)} samples, fewer than one global batch of "
                f"{global_batch} (trainer.batch_size x workers x accumulation); use more data "
                "or a smaller batch")

    def memory_probe(self) -> Optional[MemoryProbe]:
        return None  # no sample shape to probe with: auto picks ddp

    @property
    def model_info(self) -> dict:
        return {"arch": "user", "factory": getattr(self.model_factory, "__qualname__", "?")}

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """Hugging Face models as a `from_pretrained` directory; any other module as
        model.safetensors (load it into a fresh model from your factory)."""
        from ..models.files import save_model
        from ..models.hf import save_hf
        if hasattr(model, "save_pretrained"):
            save_hf(model, out_dir, state, self.tokenizer_path)
        else:
            save_model(out_dir, state, self.model_info, self.tokenizer_path)
