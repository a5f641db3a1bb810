"""Building a token cache's contents: the corpus counted, a tokenizer trained, every document
encoded, on every core (shards.py runs each pass over chunks of work units, units.py).

Documents are worked out from fragments (a document, or a piece of a long one): a document is
the fragments up to one that ends it, and one with no text is no document. The split, the
tokenizer's training subset and the offsets are computed here from per-fragment arrays, so a
pool process needs only its chunk and a few flags per fragment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import numpy as np

from .node_share import NodeShare, collect, deliver
from .progress import Ticker
from .shards import ChunkJob, Workers, count, encode, select, shard_name
from .tokenizer import Tokenizer

Log = Callable[[str], None]


@dataclass
class Fragments:
    """Per fragment of the corpus (n,): its UTF-8 bytes, whether it ends its document; and the
    fragments of each chunk (its slice of those arrays)."""
    sizes: np.ndarray  # (n,) int64
    ends: np.ndarray  # (n,) bool
    per_chunk: List[int]

    @property
    def doc_of(self) -> np.ndarray:
        """(n,) int64: the (possibly empty) document each fragment belongs to."""
        return np.concatenate([[0], np.cumsum(self.ends, dtype=np.int64)])[:len(self.ends)]

    def doc_sizes(self) -> np.ndarray:
        """(documents,) int64 bytes of every document, empty ones included."""
        return _sum_per_doc(self.doc_of, self.sizes, int(self.ends.sum()))

    def chunk_slices(self) -> List[slice]:
        bounds = np.concatenate([[0], np.cumsum(self.per_chunk)])
        return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _sum_per_doc(doc_of: np.ndarray, values: np.ndarray, n_docs: int) -> np.ndarray:
    # float64 sums are exact below 2**53 bytes or tokens
    return np.bincount(doc_of, weights=values, minlength=n_docs)[:n_docs].astype(np.int64)


def count_fragments(jobs: List[ChunkJob], max_bytes: Optional[int], pool: Workers,
                    log: Log) -> tuple[List[ChunkJob], Fragments]:
    """Pass 1 over every chunk (in order, stopping at data.max_bytes: the chunk it falls in is
    counted again here with what is left of the budget). Returns the jobs that count."""
    total = sum(u.nbytes for job in jobs for u in job.units)
    done = [0]
    sizes, ends = [], []
    kept = list(jobs)
    # with data.max_bytes, chunks go out a few at a time: the pool stops soon after the cut
    wave = len(jobs) if max_bytes is None else 2 * pool.processes
    with Ticker(log, lambda s: f"reading: {done[0] / 1e6:.1f} of about {total / 1e6:.1f} MB "
                               f"({100 * done[0] / max(total, 1):.0f}%), {s:.0f} s so far"):
        before = 0
        for first in range(0, len(jobs), max(wave, 1)):
            batch = [(job,) for job in jobs[first:first + wave]]
            for k, (s, e) in enumerate(pool.imap(count, batch), start=first):
                if max_bytes is not None and before + int(s.sum()) >= max_bytes:
                    kept = jobs[:k] + [replace(jobs[k], budget=max_bytes - before)]
                    s, e = count(kept[-1])
                    sizes.append(s)
                    ends.append(e)
                    break
                before += int(s.sum())
                done[0] += sum(u.nbytes for u in jobs[k].units)
                sizes.append(s)
                ends.append(e)
            if len(kept) < len(jobs):
                break
    return kept, Fragments(np.concatenate(sizes) if sizes else np.zeros(0, np.int64),
                           np.concatenate(ends) if ends else np.zeros(0, bool),
                           [len(s) for s in sizes])


def training_texts(jobs: Sequence[ChunkJob], frags: Fragments, keep_docs: np.ndarray,
                   chars_only: bool, pool: Workers):
    """Pass 2: the text of the documents in `keep_docs` (documents with text only), in corpus
    order, fragment by fragment (a long document never whole in memory)."""
    keep = _per_fragment(frags, keep_docs)
    args = [(job, keep[sl], chars_only) for job, sl in zip(jobs, frags.chunk_slices())]
    for texts in pool.imap(select, args):
        yield from texts


def _per_fragment(frags: Fragments, per_doc: np.ndarray) -> np.ndarray:
    """A per-document flag (documents with text) spread to every fragment of the document;
    False on the fragments of empty documents."""
    doc_sizes = frags.doc_sizes()
    nonempty = doc_sizes > 0
    number = np.cumsum(nonempty) - 1  # the document's index among those with text
    doc_of = frags.doc_of
    padded = np.concatenate([per_doc, [False]])  # index -1 (before the first): False
    return nonempty[doc_of] & padded[number[doc_of]]


def encode_shards(jobs: Sequence[ChunkJob], frags: Fragments, is_val: np.ndarray,
                  tokenizer: Tokenizer, tokenizer_path: Path, dtype: np.dtype, out: Path,
                  pool: Workers, log: Log, share: Optional[NodeShare] = None) -> Optional[dict]:
    """Pass 3: every chunk's shards written in `out`; each split's document offsets saved;
    returns {split: {"docs", "tokens", "shards": [[name, tokens], ...]}}. `share`: nodes that
    split the chunks (node_share.py): this node encodes its own and delivers their counts;
    node 0 collects the others' and writes the index, another node returns None."""
    val = _per_fragment(frags, is_val)
    doc_sizes = frags.doc_sizes()
    eot_after = frags.ends & (doc_sizes[frags.doc_of] > 0)
    slices = frags.chunk_slices()
    text_bytes = int(frags.sizes.sum())
    done, tokens = [0], [np.zeros(0, np.int64)] * len(jobs)
    t0 = time.perf_counter()
    mine = [k for k in range(len(jobs)) if share is None or share.mine(k)]
    args = [(jobs[k], val[slices[k]], eot_after[slices[k]], str(tokenizer_path), str(out),
             dtype.name) for k in mine]
    with Ticker(log, lambda s: f"tokenizing: {done[0] / 1e6:.1f} of {text_bytes / 1e6:.1f} MB "
                               f"({100 * done[0] / max(text_bytes, 1):.0f}%), {s:.0f} s so far"):
        for i, counts in pool.unordered(encode, args):
            k = mine[i]
            tokens[k] = counts
            done[0] += int(frags.sizes[slices[k]].sum())
            if share is not None:
                deliver(out, k, counts)
    if share is not None:
        log(f"tokenized {len(mine)} of {len(jobs)} chunks on node {share.node_rank} in "
            f"{time.perf_counter() - t0:.1f} s")
        if share.node_rank != 0:
            return None
        tokens = collect(out, tokens, share)
    stats = _index(jobs, frags, np.concatenate(tokens) if tokens else np.zeros(0, np.int64),
                   val, eot_after, out)
    total = sum(s["tokens"] for s in stats.values())
    log(f"tokenized {text_bytes / 1e6:.1f} MB -> {total / 1e6:.2f}M tokens in "
        f"{time.perf_counter() - t0:.1f} s ({len(jobs)} shard{'s' if len(jobs) != 1 else ''}, "
        f"{pool.processes} process{'es' if pool.processes != 1 else ''})")
    return stats


def _index(jobs: Sequence[ChunkJob], frags: Fragments, frag_tokens: np.ndarray,
           val: np.ndarray, eot_after: np.ndarray, out: Path) -> dict:
    """Each split's offsets (.npy) and shard list, from every fragment's token count; shards
    with no tokens are removed (a memory map cannot be empty)."""
    with_eot = frag_tokens + eot_after
    doc_of = frags.doc_of
    n_docs = int(frags.ends.sum())
    doc_tokens = _sum_per_doc(doc_of, with_eot, n_docs)
    nonempty = frags.doc_sizes() > 0
    stats = {}
    for split, mine in (("train", ~val), ("val", val)):
        docs = np.zeros(n_docs, dtype=bool)
        docs[doc_of[mine & eot_after]] = True  # the documents of this split (with text)
        lengths = doc_tokens[docs & nonempty]
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        np.save(out / f"{split}_offsets.npy", offsets)
        shards = []
        for job, sl in zip(jobs, frags.chunk_slices()):
            n = int(with_eot[sl][mine[sl]].sum())
            name = shard_name(split, job.index)
            if n:
                shards.append([name, n])
            else:
                (out / name).unlink()
        stats[split] = {"docs": len(lengths), "tokens": int(offsets[-1]), "shards": shards}
    return stats
