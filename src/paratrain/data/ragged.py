"""A map-style dataset over examples that hold several token sequences of their own lengths (a
preference pair's two responses, a seq2seq example's input and target) plus per-example numbers.

Each sequence column is one flat int32 array with offsets, as FinetuneDataset stores its single
length: a few buffers instead of millions of Python ints, cheap to pickle to DataLoader workers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError


class RaggedColumn:
    """Sequences of ints of any lengths, flat."""

    def __init__(self, seqs: Sequence[Sequence[int]]):
        lengths = np.array([len(s) for s in seqs], dtype=np.int64)  # (N,)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # (N+1,)
        self.tokens = np.fromiter((t for s in seqs for t in s), dtype=np.int32,
                                  count=int(self.offsets[-1]))  # (total,)

    def __getitem__(self, i: int) -> torch.Tensor:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return torch.from_numpy(self.tokens[start:end].astype(np.int64))  # (L_i,)


class RaggedDataset(Dataset):
    """Examples {name: [int, ...] (a sequence) or a number}: every example has the same keys.
    An item gives the sequences as int64 tensors and the numbers as Python numbers; a column
    added later (`add`, e.g. precomputed reference log-probs, (N, k)) gives arrays."""

    def __init__(self, examples: Sequence[Dict[str, Any]], what: str = "examples"):
        if not examples:
            raise DataError(f"no {what} to train on; check the data source")
        first = examples[0]
        self.sequences = {k: RaggedColumn([ex[k] for ex in examples])
                          for k, v in first.items() if isinstance(v, (list, tuple))}
        self.numbers = {k: np.array([ex[k] for ex in examples])  # (N,)
                        for k, v in first.items() if not isinstance(v, (list, tuple))}
        self.extra: Dict[str, np.ndarray] = {}
        self.n = len(examples)

    def add(self, name: str, values: np.ndarray) -> None:
        """A column of one row per example (e.g. (N, 2) float64), in every item from now on."""
        assert len(values) == self.n, (name, len(values), self.n)
        self.extra[name] = values

    def lengths(self, name: str) -> np.ndarray:
        """(N,) the lengths of one sequence column."""
        return np.diff(self.sequences[name].offsets)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Dict[str, Any]:
        if not -self.n <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} examples")
        i %= self.n
        item: Dict[str, Any] = {k: col[i] for k, col in self.sequences.items()}
        item.update({k: col[i].item() for k, col in self.numbers.items()})
        item.update({k: col[i] for k, col in self.extra.items()})
        return item


def pad_rows(seqs: List[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) rows right-padded to the longest with `pad`, and their attention mask (1 real)."""
    T = max(len(s) for s in seqs)
    rows = torch.full((len(seqs), T), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)  # (B, T)
    for b, s in enumerate(seqs):
        rows[b, :len(s)] = s
        mask[b, :len(s)] = 1
    return rows, mask
