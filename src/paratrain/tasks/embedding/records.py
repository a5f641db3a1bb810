"""Records for sentence-embedding models (`data.format=embedding`), in one of two kinds:

- {"anchor", "positive"} with an optional "negative" (a hard negative): texts for the
  in-batch-negatives contrastive loss;
- {"text1", "text2", "score"}: scored pairs (a similarity, e.g. in [0, 1] or [-1, 1]) for the
  cosine-similarity loss.

Every text is tokenized whole, with the tokenizer's own special tokens and cut to data.max_length,
exactly as `sentence_transformers.SentenceTransformer.encode` tokenizes it later, so the saved
model embeds a text as training did. A batch stacks the first texts of its examples, then the
second texts, then the negatives (when the records have them), right-padded in one tensor: one
forward embeds them all.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from ...errors import DataError
from ...data.finetune import check_inputs, row_text
from ...data.ragged import RaggedDataset, pad_rows

KINDS = {("anchor", "positive", "negative"): "triplets", ("anchor", "positive"): "pairs",
         ("text1", "text2", "score"): "scored pairs"}  # the record kinds, by their fields


def record_kind(row: Dict[str, Any], source_name: str) -> Tuple[str, ...]:
    """The fields of the first kind in KINDS whose fields `row` has, or one DataError line."""
    for fields in KINDS:
        if all(f in row for f in fields):
            return fields
    raise DataError(f"{source_name}: row 1 has fields {sorted(row)}; data.format=embedding "
                    "reads {anchor, positive[, negative]} or {text1, text2, score} records")


def encode_embedding(rows: Sequence[Dict[str, Any]], tokenizer: Any, *, max_length: int,
                     source_name: str = "data", bounded: bool = True
                     ) -> Tuple[List[Dict[str, Any]], str]:
    """(examples {field: token ids, ..., "score": float}, one note for the log). `bounded`:
    scores must lie in [-1, 1] (the cosine loss; CoSENT reads only their order)."""
    check_inputs(rows, max_length, source_name)
    fields = record_kind(rows[0], source_name)
    texts = [f for f in fields if f != "score"]
    columns = {f: [row_text(row, f, "a record field", source_name, i)
                   for i, row in enumerate(rows, start=1)] for f in texts}
    for f in texts:
        for i, text in enumerate(columns[f], start=1):
            if not text.strip():
                raise DataError(f"{source_name}: row {i} has an empty {f!r}; every text of a "
                                "record needs words (an empty one embeds as the tokenizer's "
                                "special tokens alone): fill it in or drop the row")
    ids = {f: tokenizer(columns[f], truncation=True, max_length=max_length)["input_ids"]
           for f in texts}
    examples = [{f: ids[f][i] for f in texts} for i in range(len(rows))]
    if "score" in fields:
        for i, (row, ex) in enumerate(zip(rows, examples), start=1):
            score = row["score"]
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise DataError(f"{source_name}: row {i} has score {score!r}; a scored pair's "
                                "'score' is a number (the similarity the two texts should have)")
            if bounded and not -1.0 <= score <= 1.0:
                raise DataError(f"{source_name}: row {i} has score {score!r}; the loss fits "
                                "the cosine similarity, which lies in [-1, 1]: scale the scores "
                                "into it (a 0 to 5 rating: divide by 5), or set "
                                "embedding.pair_loss=cosent (it reads only their order)")
            ex["score"] = float(score)
    cut = sum(len(ids[f][i]) >= max_length for f in texts for i in range(len(rows)))
    return examples, (f"{source_name}: {len(rows)} {KINDS[fields]} ({cut} texts cut to "
                      f"data.max_length={max_length})")


def embedding_dataset(examples: Sequence[Dict[str, Any]]) -> RaggedDataset:
    return RaggedDataset(examples, what="embedding records")


class EmbeddingCollate:
    """list of examples -> {"input_ids", "attention_mask"} ((k B, T): the B first texts, then
    the B second texts, then the B negatives), "columns" (k) and "score" (B,) for scored
    pairs. A class, not a closure: DataLoader workers pickle it."""

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, batch: List[Dict[str, Any]]) -> Dict[str, Any]:
        fields = [f for f in record_kind(batch[0], "batch") if f != "score"]
        seqs = [ex[f] for f in fields for ex in batch]  # k B of (L_i,)
        input_ids, attention_mask = pad_rows(seqs, self.pad_id)  # (kB, T), (kB, T)
        out: Dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask,
                               "columns": len(fields)}
        if "score" in batch[0]:
            out["score"] = torch.tensor([float(ex["score"]) for ex in batch])  # (B,)
        return out
