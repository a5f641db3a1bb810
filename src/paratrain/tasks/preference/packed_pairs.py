"""Preference pairs packed into rows (data.pack=true, DPO, KTO and reward models): a row of the
packed dataset holds several pairs; its batch keeps each pair's two sequences apart as the padded
batch does.

A micro-batch of R packed rows becomes 2R model rows: row r holds the first sides (chosen, or
KTO's completions) of packed row r's pairs one after the other, row R + r their second sides
(rejected, or the mismatched sequences), each sequence with position ids restarting at 0 (the
model keeps attention inside it). `seq_index` says which sequence each token belongs to, in the
padded batch's order: the P pairs' first sides 0..P-1, then their second sides P..2P-1 (-1 on
pads). So `sequence_logps` gives the same (2P,) scores as on padded rows, and DPO's pair terms,
rewards and a precomputed reference line up unchanged; KTO's two halves are rows [0, R) and
[R, 2R). A reward model (no shift) reads one score per sequence: `ends` (2P,) flat indices into
the (2R, T) tokens of each sequence's last non-pad token (where transformers'
*ForSequenceClassification pools a padded row), and `margin` (P,).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from ...data.dataset import IGNORE_INDEX
from ...data.packing import restarting_positions


def pair_sizes(ds: Any, sides: Sequence[str], shift: bool) -> np.ndarray:
    """(N,) the tokens a pair's two sequences put in a packed row (shifted: one fewer each)."""
    first, second = sides
    return ds.lengths(first) + ds.lengths(second) - (2 if shift else 0)


def packed_pairs(rows: List[List[Dict[str, Any]]], sides: Sequence[str], pad_id: int,
                 shift: bool) -> Dict[str, torch.Tensor]:
    """R packed rows of pairs -> (2R, T) input_ids, targets (shift), position_ids, seq_index,
    and num_sequences (2P, a 0-dim tensor); "reference" (2P,) when the pairs carry it; without
    shift (a reward model) "ends" (2P,) and "margin" (P,) instead of targets."""
    pairs = [p for row in rows for p in row]  # P, in row order
    P, R = len(pairs), len(rows)
    pieces: List[List[tuple]] = [[] for _ in range(2 * R)]  # per model row: (ids, targets, seq)
    at = 0
    for r, row in enumerate(rows):
        for p in row:
            for half, side in enumerate(sides):
                seq = torch.as_tensor(p[side], dtype=torch.long)  # (L,)
                ids, tgt = _shifted(seq, p["prompt_len"]) if shift else (seq, None)
                pieces[half * R + r].append((ids, tgt, half * P + at))
            at += 1
    T = max(sum(len(ids) for ids, _, _ in row) for row in pieces)
    input_ids = torch.full((2 * R, T), pad_id, dtype=torch.long)  # (2R, T)
    targets = torch.full((2 * R, T), IGNORE_INDEX, dtype=torch.long)  # (2R, T)
    position_ids = torch.zeros((2 * R, T), dtype=torch.long)  # (2R, T)
    seq_index = torch.full((2 * R, T), -1, dtype=torch.long)  # (2R, T)
    for r, row in enumerate(pieces):
        n = sum(len(ids) for ids, _, _ in row)
        input_ids[r, :n] = torch.cat([ids for ids, _, _ in row])
        if shift:
            targets[r, :n] = torch.cat([tgt for _, tgt, _ in row])
        seq_index[r, :n] = torch.cat([torch.full((len(ids),), s) for ids, _, s in row])
        position_ids[r] = restarting_positions([len(ids) for ids, _, _ in row] +
                                               ([T - n] if T > n else []))
    out = {"input_ids": input_ids, "position_ids": position_ids, "seq_index": seq_index,
           "num_sequences": torch.tensor(2 * P)}
    if shift:
        out["targets"] = targets
    else:
        out["ends"] = _last_tokens(pieces, T, pad_id, 2 * P)  # (2P,)
        out["margin"] = torch.tensor([p["margin"] for p in pairs], dtype=torch.float32)  # (P,)
    if "reference" in pairs[0]:  # (2P,): first sides, then second sides
        ref = torch.as_tensor(np.stack([p["reference"] for p in pairs]))  # (P, 2)
        out["reference"] = torch.cat([ref[:, 0], ref[:, 1]])
    return out


def _last_tokens(pieces: List[List[tuple]], T: int, pad_id: int, n: int) -> torch.Tensor:
    """(n,) for each sequence the flat index (row * T + column) of its last token that is not
    pad_id (its first when all are, as transformers' argmax does): the token a padded row's score
    is read from."""
    ends = torch.zeros(n, dtype=torch.long)  # (n,)
    for r, row in enumerate(pieces):
        at = 0
        for ids, _, s in row:
            real = (ids != pad_id).nonzero()  # (k, 1)
            ends[s] = r * T + at + (int(real[-1]) if len(real) else 0)
            at += len(ids)
    return ends


def _shifted(seq: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one sequence: all but its last token, and the next tokens counted
    from the response's first (IGNORE_INDEX over the prompt), as PairCollate's rows."""
    ids = seq[:-1]  # (L-1,)
    targets = torch.full_like(ids, IGNORE_INDEX)  # (L-1,)
    targets[prompt_len - 1:] = seq[prompt_len:]
    return ids, targets


def half_rows(batch: dict, second: bool) -> dict:
    """KTO's halves of a batch: the first sides' rows or the second sides', with the sequence
    ids of that half counted from 0 (packed), or the rows [0, B) / [B, 2B) (padded)."""
    n = batch["input_ids"].shape[0] // 2
    rows = slice(n, None) if second else slice(0, n)
    keys = ("input_ids", "attention_mask", "position_ids", "targets")
    out = {k: batch[k][rows] for k in keys if k in batch}
    if "seq_index" in batch:
        pairs = batch["num_sequences"] // 2
        index = batch["seq_index"][rows]  # (R, T)
        out["seq_index"] = torch.where(index >= 0, index - pairs * int(second), index)
        out["num_sequences"] = pairs
    return out
