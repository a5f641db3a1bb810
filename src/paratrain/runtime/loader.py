"""The training batches one rank reads: a DataLoader over the step sampler's lists of sample
indices (data/sampler.py), with a random generator of its own, and None for a micro-batch this
rank has no samples for (a short last step: the loop then runs a stand-in that counts nothing)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.data import DataLoader

from ..config.tree import TrainConfig
from ..dist import DistEnv


class CollateOrNone:
    """The task's collate, and None for an empty micro-batch (a class: workers pickle it)."""

    def __init__(self, collate: Callable[[list], Any]):
        self.collate = collate

    def __call__(self, items: list) -> Any:
        return self.collate(items) if items else None


def step_loader(ds: Any, batches: Any, collate: Any, cfg: TrainConfig, env: DistEnv
                ) -> DataLoader:
    workers = cfg.data.num_workers
    # A generator of its own: by default every new iterator draws a seed from the global RNG,
    # and a resumed run starts its iterator mid-epoch, which would shift dropout's random stream.
    return DataLoader(ds, batch_sampler=batches, collate_fn=CollateOrNone(collate),
                      num_workers=workers, persistent_workers=workers > 0,
                      pin_memory=env.device.type == "cuda",
                      generator=torch.Generator().manual_seed(cfg.trainer.seed))
