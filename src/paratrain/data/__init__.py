"""Data: text corpus -> trained tokenizer -> token cache on disk -> datasets and samplers.

The names are imported lazily: the token cache's pool processes import `paratrain.data.shards`
and must not pay for torch (dataset.py, sampler.py) to encode text."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PreparedData": "cache", "cache_path": "cache", "data_fingerprint": "cache",
    "load_prepared": "cache", "prepare_data": "cache", "wait_for_data": "cache",
    "Corpus": "corpus", "resolve_corpus": "corpus",
    "IGNORE_INDEX": "dataset", "PackedDataset": "dataset", "PaddedDataset": "dataset",
    "build_dataset": "dataset", "collate": "dataset",
    "EvalSampler": "sampler", "GlobalSampler": "sampler",
    "Tokenizer": "tokenizer",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
