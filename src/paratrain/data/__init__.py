"""Data: text corpus -> trained tokenizer -> token cache on disk -> datasets and samplers."""

from .cache import (
                    PreparedData,
                    cache_path,
                    data_fingerprint,
                    load_prepared,
                    prepare_data,
                    wait_for_data,
)
from .corpus import Corpus, resolve_corpus
from .dataset import IGNORE_INDEX, PackedDataset, PaddedDataset, build_dataset, collate
from .sampler import EvalSampler, GlobalSampler
from .tokenizer import Tokenizer

__all__ = [
    "Corpus", "resolve_corpus", "Tokenizer", "PreparedData", "prepare_data", "wait_for_data",
    "load_prepared", "data_fingerprint", "cache_path", "PackedDataset", "PaddedDataset",
    "build_dataset", "collate", "IGNORE_INDEX", "GlobalSampler", "EvalSampler",
]
