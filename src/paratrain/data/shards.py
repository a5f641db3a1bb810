"""The three passes of a token cache's preparation, over chunks of work units, on a pool of
processes (one per core) or, for a small corpus, in this process.

1. count: each chunk's fragments (their UTF-8 sizes and which end a document);
2. select: the text of the documents a tokenizer trained here learns from;
3. encode: each chunk's token ids, written to a shard of its own per split
   (`train-00000.bin`, ...): the shards in chunk order are the token stream, the same bytes as
   encoding the documents one after another in one process.
Documents, the train/val split and the offsets are worked out here, in the calling process,
from what the chunks report; a process gets one chunk's files and a few flags per fragment.

The pool's processes are forked: "spawn" would run the user's main module again in each (a
script without `if __name__ == "__main__":` would start over), and a forked child needs
nothing but this module. They are forked before any thread of ours starts, with
TOKENIZERS_PARALLELISM=false in their environment: each encodes on one thread, so N processes
keep N cores busy whatever the documents' sizes (and the tokenizers library does not warn
about a fork after its thread pool ran).
"""

from __future__ import annotations

import multiprocessing
import os
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .corpus import Corpus
from .tokenizer import Tokenizer
from .units import Unit, chunk_fragments

SMALL_CORPUS_BYTES = 8 * 2**20  # below this, starting a pool costs more than it saves
ENCODE_BATCH_BYTES = 2**20  # text per encode_batch call: ~150 MB of a process's memory (units.py)


@dataclass(frozen=True)
class ChunkJob:
    """One chunk as a process receives it: the chunk's own files only (not the corpus')."""
    index: int
    corpus: Corpus
    units: Tuple[Unit, ...]
    cutter: Any  # the pre-tokenizer long documents are cut by; None: not cut
    budget: Optional[int] = None  # data.max_bytes left when the chunk starts; None: no cut


def chunk_jobs(corpus: Corpus, chunks: Sequence[Tuple[Unit, ...]], cutter: Any) -> List[ChunkJob]:
    jobs = []
    for k, chunk in enumerate(chunks):
        files = sorted({u.file for u in chunk})
        renumber = {f: i for i, f in enumerate(files)}
        sub = replace(corpus, files=tuple(corpus.files[f] for f in files), max_bytes=None)
        jobs.append(ChunkJob(k, sub, tuple(replace(u, file=renumber[u.file]) for u in chunk),
                             cutter))
    return jobs


def fragments(job: ChunkJob) -> Iterator[Tuple[str, bool]]:
    return chunk_fragments(job.corpus, job.units, job.cutter, job.budget)


# ---- the passes (each runs in a pool process, or here) -------------------------------------
def count(job: ChunkJob) -> Tuple[np.ndarray, np.ndarray]:
    """(UTF-8 bytes of each fragment (n,) int64, whether it ends its document (n,) bool)."""
    sizes, ends = [], []
    for text, end in fragments(job):
        sizes.append(len(text.encode("utf-8")))
        ends.append(end)
    return np.asarray(sizes, dtype=np.int64), np.asarray(ends, dtype=bool)


def select(job: ChunkJob, keep: np.ndarray, chars_only: bool) -> List[str]:
    """The text of the fragments marked in `keep` (n,) bool; `chars_only`: just the distinct
    characters they hold (all a character vocabulary needs)."""
    texts = [text for (text, _), k in zip(fragments(job), keep) if k and text]
    return ["".join(set("".join(texts)))] if chars_only else texts


def encode(job: ChunkJob, is_val: np.ndarray, eot_after: np.ndarray, tokenizer_path: str,
           out: str, dtype: str) -> np.ndarray:
    """Writes the chunk's shards `out/{split}-{index:05d}.bin` (each fragment's ids, [EOT]
    after each that ends a non-empty document); returns each fragment's ids (n,) int64,
    without the [EOT]."""
    tokenizer = _tokenizer(tokenizer_path)
    paths = {s: Path(out) / shard_name(s, job.index) for s in ("train", "val")}
    counts: List[int] = []
    with open(paths["train"], "wb") as train, open(paths["val"], "wb") as val:
        batch: List[str] = []

        def flush() -> None:
            for ids in tokenizer.encode_batch(batch):
                i = len(counts)
                counts.append(len(ids))
                if eot_after[i]:
                    ids.append(tokenizer.eot_id)
                np.asarray(ids, dtype=dtype).tofile(val if is_val[i] else train)
            batch.clear()

        size = 0
        for text, _ in fragments(job):
            batch.append(text)
            size += len(text)
            if size >= ENCODE_BATCH_BYTES:
                flush()
                size = 0
        flush()
    return np.asarray(counts, dtype=np.int64)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.bin"


_TOKENIZERS: Dict[str, Tokenizer] = {}  # a pool process's tokenizer, loaded once per path


def _tokenizer(path: str) -> Tokenizer:
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = Tokenizer.load(path)
    return _TOKENIZERS[path]


# ---- where the passes run ------------------------------------------------------------------
class Workers:
    """`map(fn, args)` over a pool of `processes` spawned processes, or here when 1; results
    in order, as they come (`ordered=False`: in completion order, with their index)."""

    def __init__(self, processes: int):
        self.processes = processes
        self._pool: Any = None

    def imap(self, fn: Callable, args: Sequence[tuple]) -> Iterator[Any]:
        if self._pool is None:
            return (fn(*a) for a in args)
        return self._pool.imap(_call, [(fn, a) for a in args])

    def unordered(self, fn: Callable, args: Sequence[tuple]) -> Iterator[Tuple[int, Any]]:
        if self._pool is None:
            return ((i, fn(*a)) for i, a in enumerate(args))
        return self._pool.imap_unordered(_call_indexed,
                                         [(i, fn, a) for i, a in enumerate(args)])


def _call(item: tuple) -> Any:
    fn, args = item
    return fn(*args)


def _call_indexed(item: tuple) -> Tuple[int, Any]:
    i, fn, args = item
    return i, fn(*args)


@contextmanager
def workers(processes: int) -> Iterator[Workers]:
    """A pool for the passes; terminated on the way out, whatever happened (a failed or killed
    preparation leaves no process behind)."""
    w = Workers(processes)
    if processes > 1:
        w._pool = _forked_pool(processes)
    try:
        yield w
    finally:
        if w._pool is not None:
            w._pool.terminate()
            w._pool.join()


def _forked_pool(processes: int) -> Any:
    """The pool's children get TOKENIZERS_PARALLELISM=false; this process keeps its own."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return multiprocessing.get_context("fork").Pool(processes)
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def default_processes(text_bytes_estimate: int) -> int:
    """One process per usable core, or this process alone for a small corpus."""
    if text_bytes_estimate < SMALL_CORPUS_BYTES:
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
