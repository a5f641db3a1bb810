"""Classification data: labelled texts as {"input_ids", "label"} examples, and stable label ids.

Texts keep the tokenizer's own special tokens (a classifier reads a whole text, nothing is
masked); they share the fine-tuning readers' checks and batching (finetune.py), and
FinetuneDataset / PadCollate carry them like any other example.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataError
from .examples import Example
from .finetune import EncodeStats, check_inputs, row_field, row_text, tokenize_texts


def encode_classify(rows: Sequence[Dict[str, Any]], tokenizer: Any, *, text_field: str = "text",
                    label_field: str = "label", max_length: int,
                    labels: Optional[Sequence[str]] = None, source_name: str = "data"
                    ) -> Tuple[List[Example], EncodeStats, List[str]]:
    """Labelled texts -> ({"input_ids", "label"} examples, stats, label names by id).

    Texts get the tokenizer's own special tokens and are cut from the right to max_length.
    Labels: ints are ids (names "0", "1", ...); strings are names mapped to ids in sorted order,
    so the mapping is stable across runs; strings that all look like integers (CSV has no
    types) count as ints. Pass the training set's names as `labels` when encoding validation
    data, so both use the same ids."""
    check_inputs(rows, max_length, source_name)
    texts = [row_text(row, text_field, "data.text_field", source_name, i)
             for i, row in enumerate(rows, start=1)]
    values = [row_field(row, label_field, "data.label_field", source_name, i)
              for i, row in enumerate(rows, start=1)]
    label_ids, label_names = _label_ids(values, labels, source_name)
    stats = EncodeStats(source_name, rows=len(texts))
    examples: List[Example] = []
    full = tokenize_texts(tokenizer, texts, specials=True)
    for text, ids, label in zip(texts, full, label_ids):
        stats._see(len(ids), 0)
        cut = len(ids) > max_length
        if cut:  # the tokenizer keeps its special tokens (e.g. a final SEP) when it truncates
            ids = tokenizer(text, add_special_tokens=True, truncation=True,
                            max_length=max_length)["input_ids"]
        if not ids:
            stats.skipped += 1
            continue
        examples.append({"input_ids": list(ids), "label": label})
        stats.kept += 1
        stats.truncated += cut
        stats.longest = max(stats.longest, len(ids))
    if not examples:
        raise DataError(f"every text in {source_name} is empty; check data.text_field")
    return examples, stats, label_names


def _label_ids(values: List[Any], labels: Optional[Sequence[str]], source_name: str
               ) -> Tuple[List[int], List[str]]:
    def as_int(value: Any) -> Any:
        if isinstance(value, (bool, np.integer)):
            return int(value)
        if isinstance(value, float) and value.is_integer():  # int columns with gaps load as float
            return int(value)
        return value

    values = [as_int(v) for v in values]
    names = [str(name) for name in labels] if labels is not None else None
    index = {name: i for i, name in enumerate(names or [])}
    if all(isinstance(v, str) for v in values) and not all(v in index for v in values) \
            and all(v.strip().isdigit() for v in values):
        values = [int(v) for v in values]
    for i, v in enumerate(values, start=1):
        if not isinstance(v, (int, str)):
            raise DataError(f"{source_name}: row {i} has a {type(v).__name__} label; labels must "
                            "be strings or integers")
        if isinstance(v, int) and v < 0:
            raise DataError(f"{source_name}: row {i} has label {v}; integer labels are class ids "
                            "from 0")
    if len({type(v) for v in values}) > 1:
        raise DataError(f"{source_name} mixes string and integer labels; use one kind")
    if isinstance(values[0], int):
        if names is None:
            names = [str(k) for k in range(max(values) + 1)]
        for i, v in enumerate(values, start=1):
            if v >= len(names):
                raise DataError(f"{source_name}: row {i} has label {v} but there are only "
                                f"{len(names)} labels ({', '.join(names)})")
        return list(values), names
    if names is None:
        names = sorted(set(values))
        index = {name: i for i, name in enumerate(names)}
    for i, v in enumerate(values, start=1):
        if v not in index:
            raise DataError(f"{source_name}: row {i} has label {v!r}, which is not one of the "
                            f"training labels ({', '.join(names)})")
    return [index[v] for v in values], names
