"""One split's token ids: flat shard files read by memory map, seen as one array.

The token cache writes a shard per chunk of the corpus, and a folder of pre-tokenized shards
is the same form, so both are read here. Slicing `stream[a:b]` gives an ndarray; a slice that
crosses shards is joined (a copy of just those ids). Maps are opened lazily, per process, and
dropped when pickled: a DataLoader worker receives paths, not the corpus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Sequence

import numpy as np


class TokenStream:
    def __init__(self, paths: Sequence[str | Path], counts: Sequence[int], dtype: np.dtype):
        if len(paths) != len(counts):
            raise ValueError("one token count per shard")
        self.paths = [str(p) for p in paths]
        self.counts = [int(n) for n in counts]
        self.dtype = np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])  # (S+1,)
        self._maps: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, step = window.indices(len(self))
        if step != 1:
            raise ValueError("a token stream is sliced with step 1")
        parts = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            base = int(self.starts[k])
            end = min(stop, int(self.starts[k + 1]))
            parts.append(self._shard(k)[start - base:end - base])
            start, k = end, k + 1
        if not parts:
            return np.zeros(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _shard(self, k: int) -> np.ndarray:
        if k not in self._maps:
            self._maps[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r",
                                      shape=(self.counts[k],))
        return self._maps[k]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = {}  # reopened in the receiving process
        return state
