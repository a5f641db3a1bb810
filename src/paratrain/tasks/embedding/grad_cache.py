"""GradCache (Gao et al., 2021; sentence-transformers' CachedMultipleNegativesRankingLoss): the
in-batch-negatives loss (and CoSENT, pair_losses.py) over a whole optimizer step's micro-batches,
with the memory of one.

MultipleNegativesRankingLoss ranks each anchor against every positive and negative of the
*global* batch. Under gradient accumulation the loop runs the step's micro-batches one after the
other, so a plain loss would rank each against its own micro-batch only (1 worker x accumulation
k would not run the steps of k workers). Instead, before any is trained on (the task's `rollout`,
the loop's "whole step first" seam, tasks/base.py):

1. every micro-batch of the step is embedded without gradients (its random state noted, so that
   dropout draws the same masks again in 3.);
2. the loss of every anchor against the candidates of the whole step, gathered from every rank,
   is computed on those embeddings, and its gradient with respect to each embedding;
3. then the loop trains on the micro-batches one at a time: each is embedded again *with*
   gradients, and `surrogate` backpropagates the step's gradient of its embeddings.

The model's gradient is then that of the loss over the whole global batch (the chain rule through
the embeddings), for the price of one more forward pass without gradients; activations live for
one micro-batch at a time, the step's embeddings (step rows x hidden) for the whole step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


@dataclass
class RandomState:
    """The CPU and (on a GPU) the device's random state before a micro-batch's first forward."""
    cpu: torch.Tensor
    device: Optional[torch.device]
    accel: Optional[torch.Tensor]

    @classmethod
    def now(cls, device: torch.device) -> "RandomState":
        cuda = device.type == "cuda"
        return cls(torch.get_rng_state(), device if cuda else None,
                   torch.cuda.get_rng_state(device) if cuda else None)

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Run the block from this state; the random state outside it is left as it was."""
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.device is not None:
                torch.cuda.set_rng_state(self.accel, self.device)
            yield


@dataclass
class Cached:
    """What the whole-step pass leaves with one micro-batch (not a tensor: `to_device` leaves it
    where it is)."""
    grads: tuple  # k (B, H) float32: d(loss of the step's anchors) / d(this batch's embeddings)
    loss_sum: torch.Tensor  # 0-dim: this micro-batch's anchors' share of the step's loss
    state: RandomState


Embed = Callable[[dict], tuple]  # a collated batch (on the device) -> k (B, H) embeddings
Losses = Callable[[list], torch.Tensor]  # the step's k columns (N, H) -> (N,) row losses


def cache_step(batches: list, embed: Embed, losses_of: Losses,
               device: torch.device) -> list:
    """Steps 1 and 2 (module docstring): the micro-batches (on the device), each with its
    `Cached` under "cached". `losses_of` gives each row's loss (summed, the step's loss) and
    gathers what it compares from every rank (a collective: every rank calls this at the same
    step)."""
    states, parts = [], []
    with torch.no_grad():
        for batch in batches:
            states.append(RandomState.now(device))
            parts.append(embed(batch))  # k (B, H)
    rows = [p[0].shape[0] for p in parts]
    columns = [torch.cat([p[c] for p in parts]).detach().requires_grad_()  # k (m B, H)
               for c in range(len(parts[0]))]
    with torch.enable_grad():
        losses = losses_of(columns)  # (m B,)
        losses.sum().backward()
    grads = [c.grad.split(rows) for c in columns]  # k lists of m (B, H)
    shares = losses.detach().split(rows)
    return [{**batch, "cached": Cached(tuple(g[i] for g in grads), shares[i].sum(), states[i])}
            for i, batch in enumerate(batches)]


def surrogate(embeddings: tuple, cached: Cached) -> torch.Tensor:
    """Step 3: a 0-dim tensor worth the micro-batch's share of the loss whose gradient with
    respect to `embeddings` (k (B, H), computed with gradients) is the cached one."""
    dot = sum((e * g).sum() for e, g in zip(embeddings, cached.grads))
    return cached.loss_sum + (dot - dot.detach())
