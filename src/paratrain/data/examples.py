"""Encoded fine-tuning examples as training reads them: stored flat (FinetuneDataset), padded per
micro-batch (PadCollate), and split into training and validation rows by a fixed seed.

Every fine-tuning encoder (finetune.py's pairs and chats, classify.py's labelled texts) produces
a list of `Example` dicts; the encoded-records cache (encoded.py) stores and maps the same
arrays, so this is where an example's layout is defined once.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError, DataError
from .dataset import IGNORE_INDEX

# {"input_ids": [int], "targets": [int]}, or {"input_ids": [int], "label": int} to classify
Example = Dict[str, Any]


class FinetuneDataset(Dataset):
    """Map-style dataset over encoded examples, stored as flat int32 arrays plus offsets.

    Python lists of ints cost ~36 bytes a token; flat arrays cost 4, and pickle (DataLoader
    workers, spawn) as a few buffers instead of millions of objects."""

    def __init__(self, examples: Sequence[Example]):
        if not examples:
            raise DataError("no fine-tuning examples to train on; check the data source")
        self.sequence_keys = [key for key in examples[0] if key != "label"]
        self.lengths = np.array([len(ex["input_ids"]) for ex in examples], dtype=np.int64)  # (N,)
        self.offsets = np.zeros(len(examples) + 1, dtype=np.int64)  # (N+1,)
        np.cumsum(self.lengths, out=self.offsets[1:])
        total = int(self.offsets[-1])
        self.columns: Dict[str, np.ndarray] = {}
        for key in self.sequence_keys:
            flat = np.empty(total, dtype=np.int32)  # (total tokens,)
            for ex, start, n in zip(examples, self.offsets[:-1], self.lengths):
                if len(ex[key]) != n:
                    raise ValueError(f"example {key} has {len(ex[key])} items, input_ids {n}")
                flat[start:start + n] = ex[key]
            self.columns[key] = flat
        self.labels = (np.array([ex["label"] for ex in examples], dtype=np.int64)  # (N,)
                       if "label" in examples[0] else None)
        self.rows: Optional[np.ndarray] = None  # (n,) the examples this holds; None: all

    @classmethod
    def from_arrays(cls, columns: Dict[str, np.ndarray], offsets: np.ndarray,
                    labels: Optional[np.ndarray]) -> "FinetuneDataset":
        """Over arrays laid out as `arrays()` gives them (the encoded-records cache, mapped)."""
        ds = cls.__new__(cls)
        ds.sequence_keys, ds.columns, ds.labels = list(columns), columns, labels
        ds.offsets, ds.lengths, ds.rows = offsets, np.diff(offsets), None
        return ds

    def arrays(self) -> Dict[str, np.ndarray]:
        """Every array of a whole dataset by name: its columns, "offsets" and "label"."""
        assert self.rows is None, "a selection shares its arrays with the whole dataset"
        return {**self.columns, "offsets": self.offsets,
                **({"label": self.labels} if self.labels is not None else {})}

    def select(self, rows: np.ndarray) -> "FinetuneDataset":
        """The examples at `rows` (indices into this dataset), in that order, sharing its
        arrays."""
        ds = copy.copy(self)
        ds.rows = np.asarray(rows, dtype=np.int64) if self.rows is None else self.rows[rows]
        return ds

    def __len__(self) -> int:
        return len(self.lengths) if self.rows is None else len(self.rows)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for FinetuneDataset of length {len(self)}")
        if self.rows is not None:
            i = int(self.rows[i])
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        item = {key: torch.from_numpy(col[start:end].astype(np.int64))  # (L_i,)
                for key, col in self.columns.items()}
        if self.labels is not None:
            item["label"] = torch.tensor(int(self.labels[i]))  # ()
        return item


class PadCollate:
    """list of {"input_ids": (L_i,), "targets": (L_i,)} -> (B, T) tensors, T = the longest L_i
    of THIS micro-batch (rounded up to pad_to_multiple_of), padded on the right.

    Returns input_ids (pad_id), targets (IGNORE_INDEX) and attention_mask (1 real, 0 pad); for
    classification examples ({"input_ids", "label"}) input_ids, attention_mask and labels (B,).
    A class rather than a closure so that DataLoader workers can pickle it."""

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 1):
        if pad_id is None or pad_id < 0:
            raise ConfigError(f"pad id {pad_id!r} is invalid; load the tokenizer with "
                              "load_tokenizer, which sets one")
        self.pad_id = int(pad_id)
        self.pad_to_multiple_of = max(1, int(pad_to_multiple_of))

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        rows = [torch.as_tensor(sample["input_ids"], dtype=torch.long) for sample in batch]
        m = self.pad_to_multiple_of
        T = -(-max(len(r) for r in rows) // m) * m
        B = len(rows)
        input_ids = torch.full((B, T), self.pad_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((B, T), dtype=torch.long)  # (B, T) 1 on real tokens
        classify = "label" in batch[0]
        targets = None if classify else torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        for b, (sample, row) in enumerate(zip(batch, rows)):
            n = len(row)
            input_ids[b, :n] = row
            attention_mask[b, :n] = 1
            if targets is not None:
                targets[b, :n] = torch.as_tensor(sample["targets"], dtype=torch.long)
        if classify:
            labels = torch.tensor([int(sample["label"]) for sample in batch], dtype=torch.long)
            return {"input_ids": input_ids, "attention_mask": attention_mask,
                    "labels": labels}  # (B, T), (B, T), (B,)
        return {"input_ids": input_ids, "targets": targets, "attention_mask": attention_mask}


def split_validation(examples: Sequence[Example], val_fraction: float, seed: int = 0
                     ) -> Tuple[List[Example], List[Example]]:
    """(train, validation) by a fixed seeded permutation: the same examples, fraction and seed
    always give the same split, on every rank. Both parts keep the original order."""
    train_rows, val_rows = validation_rows(len(examples), val_fraction, seed)
    return [examples[i] for i in train_rows], [examples[i] for i in val_rows]


def validation_rows(n: int, val_fraction: float, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """(training rows, validation rows) of `split_validation`, each in ascending order (for a
    dataset's `select`)."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"validation fraction {val_fraction!r} must be between 0 and 1 "
                          "(exclusive); e.g. 0.05, or give a validation set")
    if n < 2:
        raise DataError(f"{n} example(s) cannot be split into training and validation; give "
                        "more data or a separate validation set")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    order = np.random.default_rng(seed).permutation(n)
    is_val = np.zeros(n, dtype=bool)
    is_val[order[:n_val]] = True
    return np.flatnonzero(~is_val), np.flatnonzero(is_val)
