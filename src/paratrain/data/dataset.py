"""Map-style datasets over a PreparedData cache: packed windows or one padded document per row.

The token shards are memory-mapped lazily in each process and dropped when pickled
(token_stream.py), so a DataLoader worker receives a few paths, not the corpus.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ..config.data_section import DataConfig
from .cache import PreparedData

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


class _TokenFile(Dataset):
    """Shared plumbing: one split's token stream (its shards, memory-mapped lazily by
    TokenStream) and its document offsets."""

    def __init__(self, prepared: PreparedData, split: str, seq_length: int):
        if seq_length <= 0:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.tokens = prepared.tokens(split)
        self.offsets_path = prepared.offsets_path(split)
        self.num_tokens = prepared.num_tokens(split)
        self.num_docs = prepared.num_docs(split)
        self.dtype = prepared.dtype
        self.split = split
        self.seq_length = seq_length

    def _check_index(self, i: int) -> int:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {type(self).__name__} of length {n}")
        return i


class PackedDataset(_TokenFile):
    """Non-overlapping windows of seq_length+1 tokens over the concatenated documents.

    Documents are separated by [EOT] in the stream, so the model learns where one ends; no
    attention mask, the model uses plain causal attention (attention crosses documents)."""

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_length)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        i = self._check_index(i)
        L = self.seq_length
        window = torch.from_numpy(self.tokens[i * L: i * L + L + 1].astype(np.int64))  # (L+1,)
        return {"input_ids": window[:-1], "targets": window[1:]}  # (L,), (L,)


class PaddedDataset(_TokenFile):
    """One document per row: [BOT] doc [EOT], cut to seq_length+1 tokens, right-padded.

    Pad positions are ignored by the loss (target -100) and masked out of attention, so each
    row is an independent sample: what fine-tuning-style or short-document data wants.
    A longer document: `overflow="truncate"` keeps its first row only (the rest is dropped);
    `"split"` continues it in as many rows as it needs, each row starting with the token the
    previous one ended on, so every token of the document is a target exactly once."""

    def __init__(self, prepared: PreparedData, split: str, seq_length: int,
                 bot_id: int, eot_id: int, pad_id: int, overflow: str = "truncate"):
        super().__init__(prepared, split, seq_length)
        if overflow not in ("truncate", "split"):
            raise ValueError(f"overflow must be 'truncate' or 'split', not {overflow!r}")
        self.bot_id, self.eot_id, self.pad_id = bot_id, eot_id, pad_id
        self.overflow = overflow
        self._offsets: Optional[np.ndarray] = None
        self._row_starts: Optional[np.ndarray] = None  # split: the first row of each document

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets = np.load(self.offsets_path)  # (num_docs+1,) int64, small
        return self._offsets

    @property
    def row_starts(self) -> np.ndarray:
        """(num_docs+1,) int64: document d fills rows row_starts[d] .. row_starts[d+1]-1."""
        if self._row_starts is None:
            lengths = np.diff(self.offsets)  # tokens of each document, its [EOT] included
            rows = np.maximum(1, -(-lengths // self.seq_length))  # ceil(len / L)
            self._row_starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        return self._row_starts

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_offsets"] = state["_row_starts"] = None
        return state

    def __len__(self) -> int:
        return self.num_docs if self.overflow == "truncate" else int(self.row_starts[-1])

    def overflow_summary(self) -> tuple[int, int]:
        """(documents longer than one row, their tokens beyond the first row): what `truncate`
        drops and `split` keeps."""
        over = np.diff(self.offsets) - self.seq_length
        return int((over > 0).sum()), int(over[over > 0].sum())

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        i = self._check_index(i)
        L = self.seq_length
        d, k = i, 0  # document, and which of its rows
        if self.overflow == "split":
            d = int(np.searchsorted(self.row_starts, i, side="right")) - 1
            k = i - int(self.row_starts[d])
        start, end = int(self.offsets[d]), int(self.offsets[d + 1])
        row = torch.full((L + 1,), self.pad_id, dtype=torch.long)  # (L+1,)
        if k == 0:  # [BOT] then the document, ending with the stored [EOT] if it fits
            doc = self.tokens[start:min(end, start + L)]
            row[0] = self.bot_id
            row[1:len(doc) + 1] = torch.from_numpy(doc.astype(np.int64))
            n = len(doc) + 1  # real tokens in the row, [BOT] included; <= L+1
        else:  # the k-th continuation: the document seen as [BOT] doc, from position k*L
            doc = self.tokens[start + k * L - 1:min(end, start + k * L + L)]
            row[:len(doc)] = torch.from_numpy(doc.astype(np.int64))
            n = len(doc)
        input_ids = row[:-1]  # (L,)
        targets = row[1:].clone()  # (L,)
        targets[n - 1:] = IGNORE_INDEX  # target j is row[j+1], real only while j+1 < n
        attention_mask = (torch.arange(L) < n).long()  # (L,) 1 on real input tokens
        return {"input_ids": input_ids, "targets": targets, "attention_mask": attention_mask}


def build_dataset(prepared: PreparedData, split: str, cfg: DataConfig, *,
                  packed: bool) -> Dataset:
    """Full windows when the task packs its corpus (`packed`: its TaskSpec says so), else one
    document per padded row."""
    if packed:
        return PackedDataset(prepared, split, cfg.seq_length)
    m = prepared.meta
    return PaddedDataset(prepared, split, cfg.seq_length, bot_id=m["bot_id"],
                         eot_id=m["eot_id"], pad_id=m["pad_id"], overflow=cfg.padded_overflow)


def collate(batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """list of {key: (L,)} -> {key: (B, L)}."""
    return {key: torch.stack([sample[key] for sample in batch]) for key in batch[0]}
