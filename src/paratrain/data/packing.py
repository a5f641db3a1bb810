"""Packing fine-tuning examples into rows (data.pack=true), and the padding a batch computes.

Padding each micro-batch to its longest example wastes the difference: with lengths spread like
real instruction sets (log-normal, a long tail) that is 40-70% of the tokens a step computes.
Packing puts several examples into one row of up to `capacity` tokens by best-fit decreasing
(the longest examples first, each into the fullest row it still fits), so rows are nearly full.

The rows are made once, from the example lengths and the seed, before the data is dealt to
workers: the sampler then shuffles and deals *rows*, so 1 and N workers train the same rows and
`trainer.batch_size` counts rows. Inside a row each example restarts its position ids at 0; the
models read those positions to keep attention inside each example (models/llama.py
`document_mask`; Hugging Face models detect packed rows from the position ids), so an example's
logits do not depend on its neighbours, and the loss, a sum over counted tokens, does not depend
on how examples were laid out.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import ConfigError
from .dataset import IGNORE_INDEX


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int) -> List[np.ndarray]:
    """Rows of example indices, each summing to at most `capacity` tokens.

    Examples are taken longest first (ties in a seeded order, so the seed decides which equal
    examples share a row); each goes into the row with the least room that still holds it, or a
    new row. Deterministic from (lengths, capacity, seed). An example longer than `capacity`
    gets a row of its own (the encoders already cut examples to data.max_length)."""
    lengths = np.asarray(lengths, dtype=np.int64)  # (N,)
    order = np.random.default_rng(seed).permutation(len(lengths))  # (N,) ties broken by seed
    order = order[np.argsort(-lengths[order], kind="stable")]  # (N,) longest first
    rows: List[List[int]] = []
    free: List[tuple] = []  # sorted (room left, row id)
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
            rows[r].append(i)
            bisect.insort(free, (room - n, r))
        else:
            rows.append([i])
            if capacity - n > 0:
                bisect.insort(free, (capacity - n, len(rows) - 1))
    return [np.array(r, dtype=np.int64) for r in rows]


class PackedRows(Dataset):
    """A dataset of rows over `inner` (a map-style dataset of examples or pairs): item i is the
    list of the examples of row i. `lengths[j]`: the tokens example j takes in a row."""

    def __init__(self, inner: Any, lengths: np.ndarray, capacity: int, seed: int):
        if len(lengths) != len(inner):
            raise ValueError(f"{len(lengths)} lengths for {len(inner)} examples")
        self.inner, self.capacity = inner, int(capacity)
        self.rows = best_fit_decreasing(lengths, capacity, seed)  # list of (n_i,)
        self.fill = np.array([int(np.asarray(lengths)[r].sum()) for r in self.rows],
                             dtype=np.int64)  # (R,) tokens in each row

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> List[Any]:
        return [self.inner[int(j)] for j in self.rows[i]]

    def lengths(self, name: str) -> np.ndarray:
        """(N,) the inner examples' lengths of one sequence column (a RaggedDataset's)."""
        return self.inner.lengths(name)

    @property
    def examples(self) -> int:
        return len(self.inner)

    def describe(self, what: str, length_key: str) -> str:
        """One log line: how many examples went into how many rows, and what a batch counts."""
        return (f"data.pack: {self.examples:,} {what} in {len(self):,} rows of up to "
                f"{self.capacity} tokens ({length_key}), {self.examples / max(1, len(self)):.2f} "
                f"{what} per row on average ({_share(self.fill.sum(), self.capacity * len(self))}"
                " of each row filled); trainer.batch_size counts rows")


def _share(part: float, whole: float) -> str:
    return f"{100.0 * part / max(whole, 1):.0f}%"


def restarting_positions(lengths: Sequence[int]) -> torch.Tensor:
    """(sum(lengths),) position ids that restart at 0 for each piece: [0..n_0-1, 0..n_1-1, ...]."""
    lengths_t = torch.as_tensor(list(lengths), dtype=torch.long)  # (k,)
    starts = torch.cumsum(lengths_t, 0) - lengths_t  # (k,)
    total = int(lengths_t.sum())
    return torch.arange(total) - torch.repeat_interleave(starts, lengths_t)  # (total,)


class PackCollate:
    """list of rows (each a list of {"input_ids": (L_i,), "targets": (L_i,)}) -> (R, T) tensors,
    T the longest row of THIS micro-batch: input_ids (pad_id at a row's end), targets
    (IGNORE_INDEX on pads) and position_ids restarting at 0 for every example (and for the pads
    at a row's end, which form a piece of their own). No attention_mask: the position ids say
    where each example starts, which is how the models keep attention inside it."""

    def __init__(self, pad_id: int):
        if pad_id is None or pad_id < 0:
            raise ConfigError(f"pad id {pad_id!r} is invalid; load the tokenizer with "
                              "load_tokenizer, which sets one")
        self.pad_id = int(pad_id)

    def __call__(self, batch: List[List[Dict[str, Any]]]) -> Dict[str, torch.Tensor]:
        rows = [[torch.as_tensor(ex["input_ids"], dtype=torch.long) for ex in row]
                for row in batch]
        fills = [sum(len(x) for x in row) for row in rows]
        T = max(fills)
        R = len(rows)
        input_ids = torch.full((R, T), self.pad_id, dtype=torch.long)  # (R, T)
        targets = torch.full((R, T), IGNORE_INDEX, dtype=torch.long)  # (R, T)
        position_ids = torch.zeros((R, T), dtype=torch.long)  # (R, T)
        for r, (row, examples) in enumerate(zip(rows, batch)):
            n = fills[r]
            input_ids[r, :n] = torch.cat(row)
            targets[r, :n] = torch.cat([torch.as_tensor(ex["targets"], dtype=torch.long)
                                        for ex in examples])
            pieces = [len(x) for x in row] + ([T - n] if T > n else [])
            position_ids[r] = restarting_positions(pieces)
        return {"input_ids": input_ids, "targets": targets, "position_ids": position_ids}


def padding_share(lengths: np.ndarray, micro_batch: int, seed: int,
                  grouped: bool = False) -> Optional[float]:
    """The share of the tokens a micro-batch computes that are pads, when samples of these
    lengths (tokens per sample; a packed row's fill) are batched `micro_batch` at a time in a
    seeded order (`grouped`: data.group_by_length's) and padded to the longest of each batch:
    an estimate over one epoch."""
    from .sampler import GROUP_WINDOW, group_by_length
    lengths = np.asarray(lengths, dtype=np.int64)  # (N,)
    if len(lengths) == 0 or micro_batch < 1:
        return None
    order = np.random.default_rng(seed).permutation(len(lengths))  # (N,)
    if grouped:
        order = group_by_length(torch.from_numpy(order), torch.from_numpy(lengths),
                                GROUP_WINDOW * micro_batch).numpy()
    order = lengths[order]  # (N,)
    cut = len(order) // micro_batch * micro_batch or len(order)
    batches = order[:cut].reshape(-1, min(micro_batch, cut))  # (N/b, b)
    computed = int(batches.max(axis=1).sum()) * batches.shape[1]
    return 1.0 - float(batches.sum()) / max(computed, 1)


def padding_line(share: Optional[float], packed: bool) -> Optional[str]:
    """The log line saying the waste, with what cuts it above a quarter."""
    if share is None:
        return None
    line = (f"padding: about {100 * share:.0f}% of the tokens each step computes are pads "
            + ("(packed rows padded to the longest row of a micro-batch)" if packed else
               "(examples padded to the longest of each micro-batch)"))
    if share > 0.25 and not packed:
        line += ("; data.pack=true packs several examples into each row and cuts it (or "
                 "data.group_by_length=true, for the formats that cannot pack)")
    return line


def document_positions(input_ids: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) position ids that restart at 0 after every end-of-document token: a pretraining
    window spanning several documents (data.document_mask=true, torchtitan's block-causal
    attention). The [EOT] itself ends its document (it predicts the next one's first token from
    its own document only)."""
    B, T = input_ids.shape
    idx = torch.arange(T, device=input_ids.device).expand(B, T)  # (B, T)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)  # (B, T)
    starts[:, 1:] = input_ids[:, :-1] == eot_id
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values  # (B, T)
    return idx - first  # (B, T)


class DocumentCollate:
    """Pretraining windows (list of {key: (L,)}) -> (B, L) tensors plus position_ids restarting
    at each document (`document_positions`): the model keeps attention inside each document."""

    def __init__(self, eot_id: int):
        self.eot_id = int(eot_id)

    def __call__(self, batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        out = {key: torch.stack([sample[key] for sample in batch]) for key in batch[0]}
        out["position_ids"] = document_positions(out["input_ids"], self.eot_id)  # (B, L)
        return out
