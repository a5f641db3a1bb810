"""Samplers: one global order per epoch, dealt to ranks so that the world size does not matter.

Rank r of W takes positions r, r+W, r+2W, ... of the epoch's global order. Then the b samples
each rank reads at local step k are, together, exactly global positions [k*b*W, (k+1)*b*W): the
same global batch a single process with batch b*W reads at step k. That is what lets a run move
between 1 and W devices (and resume after doing so) without changing what it trains on.

`StepBatches` turns that order into each optimizer step's micro-batches. With drop_last=False an
epoch's last global batch may be short; it is dealt the same way, so some micro-batches of some
ranks come out short or empty (an empty one is `[]`: the loop runs a stand-in that counts
nothing, so every rank still takes part in every collective). The loss is weighted by the units
of the whole global batch, so a short step is exact too.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import torch
from torch.utils.data import Sampler


class GlobalSampler(Sampler[int]):
    """Like DistributedSampler, plus a resumable position inside the epoch.

    `position` counts samples this rank has already consumed in the current epoch; iteration
    starts after them. The sampler cannot see what the training loop consumed (a DataLoader
    prefetches), so on resume the loop tells it with load_state_dict(): the position is the
    steps done in this epoch times this rank's samples per step.
    """

    def __init__(self, num_samples: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True,
                 global_batch: Optional[int] = None, lengths: Optional[Sequence[int]] = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        unit = global_batch or world_size
        if unit % world_size:
            raise ValueError(f"global_batch={global_batch} must be a multiple of "
                             f"world_size={world_size}")
        self.num_samples = num_samples
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.unit = unit  # the epoch length is a multiple of this
        # data.group_by_length: each sample's length; the order is grouped by it (None: not)
        self.lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.long)
        self.epoch = 0
        self.position = 0

    def epoch_order(self, epoch: Optional[int] = None) -> torch.Tensor:
        """The global order of one epoch, (epoch_length,) int64, identical on every rank."""
        epoch = self.epoch if epoch is None else epoch
        n = self.num_samples
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g)  # (n,)
        else:
            order = torch.arange(n)
        if self.lengths is not None:
            order = group_by_length(order, self.lengths, GROUP_WINDOW * self.unit)
        if self.drop_last:
            return order[: n // self.unit * self.unit]
        return order  # the last global batch is short: StepBatches deals it

    @property
    def epoch_length(self) -> int:
        """Samples in one epoch: len(epoch_order()), without drawing the order."""
        n = self.num_samples
        return n // self.unit * self.unit if self.drop_last else n

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch (the last one short when drop_last is False)."""
        return -(-self.epoch_length // self.unit)

    def samples_in_step(self, step_in_epoch: int) -> int:
        """Samples of the global batch of `step_in_epoch`: `unit` but for a short last one."""
        return max(0, min(self.unit, self.epoch_length - step_in_epoch * self.unit))

    def step_indices(self, order: torch.Tensor, step_in_epoch: int) -> list[int]:
        """This rank's share of one global batch of the epoch's `order`."""
        start = step_in_epoch * self.unit
        return order[start:start + self.unit][self.rank::self.world_size].tolist()

    @property
    def samples_per_rank(self) -> int:
        """This rank's full share of one epoch (position ignored); ranks differ by one when
        drop_last is False and the epoch does not divide."""
        return len(range(self.rank, self.epoch_length, self.world_size))

    def __iter__(self) -> Iterator[int]:
        mine = self.epoch_order()[self.rank::self.world_size]  # (samples_per_rank,)
        return iter(mine[self.position:].tolist())

    def __len__(self) -> int:
        return max(0, self.samples_per_rank - self.position)

    def set_epoch(self, epoch: int) -> None:
        """Start of an epoch. A new epoch starts at position 0; setting the epoch already set
        (say, after load_state_dict on resume) keeps the position."""
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


GROUP_WINDOW = 50  # global batches per window sorted by length (HF's mega-batch multiplier)


def group_by_length(order: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """data.group_by_length, as Hugging Face's LengthGroupedSampler: the shuffled `order` (n,)
    cut into windows of `window` samples, each sorted by length, longest first (stable), so a
    micro-batch holds samples of similar lengths and pads little, while the order across windows
    stays random. The window is a whole number of global batches and the order is the global
    one, so 1 and N workers get the same global batches."""
    parts = [chunk[torch.argsort(-lengths[chunk], stable=True)]
             for chunk in order.split(max(1, window))]
    return torch.cat(parts) if parts else order  # (n,)


class StepBatches(Sampler[list]):
    """This rank's micro-batches, `accum` per optimizer step, from the GlobalSampler's epoch order
    and position (a batch sampler for DataLoader). A full step gives `micro_batch` indices per
    micro-batch: the same batches as reading the rank's positions r, r+W, ... in chunks; the
    short last step of an epoch (drop_last=False) gives fewer, or `[]`."""

    def __init__(self, sampler: GlobalSampler, micro_batch: int, accum: int):
        if micro_batch * accum * sampler.world_size != sampler.unit:
            raise ValueError(f"micro_batch={micro_batch} x accum={accum} x world="
                             f"{sampler.world_size} must equal the global batch {sampler.unit}")
        self.sampler, self.micro_batch, self.accum = sampler, micro_batch, accum

    def __iter__(self) -> Iterator[list]:
        s, b = self.sampler, self.micro_batch
        order = s.epoch_order()  # (epoch_length,)
        for step in range(s.position // (b * self.accum), s.steps_per_epoch):
            mine = s.step_indices(order, step)
            for i in range(self.accum):
                yield mine[i * b:(i + 1) * b]

    def __len__(self) -> int:
        s = self.sampler
        return (s.steps_per_epoch - s.position // (self.micro_batch * self.accum)) * self.accum


class EvalSampler(Sampler[int]):
    """Every sample exactly once over all ranks: no shuffle, no padding, no dropping.

    Ranks may differ by one sample; evaluation must sum (loss, count) over ranks rather than
    assume equal shares, and must not put a collective inside the per-batch loop."""

    def __init__(self, num_samples: int, world_size: int = 1, rank: int = 0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        self.num_samples, self.world_size, self.rank = num_samples, world_size, rank

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.num_samples, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))


class SampleRecorder(Sampler[list]):
    """A test aid (`checkpoint.record_samples=true`): passes a batch sampler's micro-batches
    through and remembers their indices, so the loop can write which samples every step
    trained on."""

    def __init__(self, inner: torch.utils.data.Sampler):
        self.inner = inner
        self.taken: list[int] = []

    def __iter__(self):
        for batch in self.inner:
            self.taken.extend(int(i) for i in batch)
            yield batch

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def pop(self) -> list[int]:
        out, self.taken = self.taken, []
        return out
