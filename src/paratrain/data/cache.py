"""The tokenized corpus on disk, keyed by a fingerprint of everything that changes its bytes.

Layout of `<cache_root>/data/<fingerprint>/`:
    tokenizer.json                 the trained tokenizer, or with data.tokenizer=DIR:
    tokenizer/                     the pretrained tokenizer's files, copied byte for byte
    train-00000.bin, ...           token shards, one per chunk of the corpus and split (written in
    val-00000.bin, ...             parallel: shards.py), flat ids (uint16, or uint32 for
                                   vocabularies > 65536); in order they are the split's token
                                   stream, every document followed by one [EOT] (a pretrained
                                   tokenizer's EOS)
    train_offsets.npy, val_...     int64 start of each document in the stream, plus the end (n+1)
    meta.json                      the index (`shards`: each split's shards and their token
                                   counts, in order), written last: it means the rest is complete

A cache is built in a private temp dir and renamed into place, so a reader never sees half of one
(a killed preparation leaves only its temp dir) and two racing builders both end up using
whichever finished first. Windows (seq_length) and the packed/padded format are cut at load
time, so changing them reuses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..config.defaults import resolve_tokenizer
from ..config.data_section import DataConfig
from ..errors import DataError
from ..fileio import atomic_write_json
from .corpus import Corpus, resolve_corpus
from .node_share import NodeShare, failed, temp_dir, wait_for_plan, wait_published, \
    write_plan
from .stale_temps import remove_stale_temps, temp_name
from .pretokenized import check_ids, is_pretokenized, largest_ids, load_tokens
from .preparation import Fragments, count_fragments, encode_shards, training_texts
from .progress import Ticker
from .shards import Workers, chunk_jobs, default_processes, workers
from .token_stream import TokenStream
from .tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    copy_tokenizer_files,
    pre_tokenizer_for,
    tokenizer_files_fingerprint,
)
from .units import group_chunks, piece_cutter, plan_units

FORMAT_VERSION = 2  # 2: token shards and an index (meta.json's shards)
SPLIT_SEED = 20240611  # fixed: the train/val split must not move when the training seed does
TOKENIZER_TRAIN_BYTES = 64 * 2**20  # BPE trains on at most this much text (~15 s on 2 cores)
SPLITS = ("train", "val")
PRETRAINED_DIR = "tokenizer"  # where a pretrained tokenizer's files go in a cache


@dataclass(frozen=True)
class PreparedData:
    dir: Path
    tokenizer_path: Optional[Path]  # None: pre-tokenized shards without a tokenizer.json
    meta: dict  # vocab_size, num_docs/num_tokens/shards {train, val}, dtype, special ids, ...

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.tokenizer_path)

    def tokens(self, split: str) -> TokenStream:
        """The split's token ids, its shards read by memory map as one array."""
        shards = self.meta["shards"][_check_split(split)]
        return TokenStream([self.dir / name for name, _ in shards], [n for _, n in shards],
                           self.dtype)

    def offsets_path(self, split: str) -> Path:
        return self.dir / f"{_check_split(split)}_offsets.npy"

    def num_tokens(self, split: str) -> int:
        return int(self.meta["num_tokens"][_check_split(split)])

    def num_docs(self, split: str) -> Optional[int]:
        """None: pre-tokenized shards without an offsets file (packed windows need none)."""
        n = self.meta["num_docs"][_check_split(split)]
        return None if n is None else int(n)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    return split


def pretrained_dir(cfg: DataConfig) -> Optional[Path]:
    """data.tokenizer when it names a pretrained tokenizer's folder; None: bpe or char. Pass
    `TrainConfig.corpus_data` (auto decided for the model); a DataConfig alone reads auto as
    bpe."""
    kind = resolve_tokenizer(cfg)
    return None if kind in ("bpe", "char") else Path(kind).expanduser()


def data_fingerprint(cfg: DataConfig, corpus: Corpus) -> str:
    pretrained = pretrained_dir(cfg)
    kind = resolve_tokenizer(cfg)
    tokenizer = kind if pretrained is None else \
        "pretrained:" + tokenizer_files_fingerprint(pretrained)  # its bytes, not where it lies
    parts = {"corpus": corpus.fingerprint(), "tokenizer": tokenizer,
             "vocab_size": cfg.vocab_size if kind == "bpe" else None,
             "val_fraction": cfg.val_fraction, "split_seed": SPLIT_SEED,
             "version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def load_prepared(path: str | os.PathLike) -> PreparedData:
    d = Path(path)
    meta_path = d / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{d} is not a prepared data cache (no meta.json); delete it and run "
                        "again to rebuild")
    meta = json.loads(meta_path.read_text())
    return PreparedData(dir=d, tokenizer_path=d / meta.get("tokenizer_file", TOKENIZER_FILE),
                        meta=meta)


def _pretokenized(cfg: DataConfig, packed: bool) -> PreparedData:
    meta = load_tokens(cfg.source, packed)
    folder = Path(os.path.expanduser(cfg.source)).resolve()
    tokenizer = meta["tokenizer_file"]
    return PreparedData(dir=folder, tokenizer_path=folder / tokenizer if tokenizer else None,
                        meta=meta)


def _check_token_ids(prepared: PreparedData, cache_root: Path,
                     log: Callable[[str], None]) -> None:
    """A pre-tokenized folder's ids all below its vocab_size (pretokenized.check_ids). The
    largest ids take a pass over the files, once: noted under data.cache_dir by the folder's
    fingerprint (its files' names, sizes and times), later runs read the note."""
    note = cache_root / "data" / f"{prepared.meta['fingerprint']}.largest-ids.json"
    if note.is_file():
        largest = json.loads(note.read_text())
    else:
        log(f"data: checking the token ids of {prepared.meta['source']} (once)")
        largest = largest_ids(prepared.dir, prepared.meta)
        note.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(note, largest)
    check_ids(prepared.meta, largest)


def cache_path(cfg: DataConfig, cache_root: str | os.PathLike) -> Path:
    """Where the cache for this config lives (resolves the corpus: stats every file)."""
    corpus = resolve_corpus(cfg.source, cfg.text_field, cfg.max_bytes)
    return Path(cache_root) / "data" / data_fingerprint(cfg, corpus)


def prepare_data(cfg: DataConfig, cache_root: str | os.PathLike,
                 log: Callable[[str], None] = print, packed: bool = True,
                 processes: Optional[int] = None,
                 nodes: Optional[NodeShare] = None) -> PreparedData:
    """Reuse the cache for this config, or build it. Call on one process per node (local rank
    0, or one per shared filesystem); the others call `wait_for_data`. `packed`: whether the
    task cuts the corpus into full windows (its TaskSpec), else padded rows: only the log's
    words differ, the cache is the same. `processes`: how many processes encode (None: one
    per core, or this one alone for a small corpus); the cache is the same bytes whatever it
    is. `nodes`: several nodes that share `cache_root` split the work (node_share.py); call it
    on every node at once."""
    if is_pretokenized(cfg.source):
        prepared = _pretokenized(cfg, packed)
        _check_token_ids(prepared, Path(cache_root), log)
        n = prepared.meta["num_tokens"]
        log(f"data: {cfg.source} is tokenized already: {n['train']:,} training and "
            f"{n['val']:,} validation ids in {len(prepared.meta['shards']['train'])} + "
            f"{len(prepared.meta['shards']['val'])} shards, vocabulary {prepared.vocab_size}, "
            f"EOS {prepared.meta['eot_id']}")
        return prepared
    corpus = resolve_corpus(cfg.source, cfg.text_field, cfg.max_bytes)
    fingerprint = data_fingerprint(cfg, corpus)
    final = Path(cache_root) / "data" / fingerprint
    if (final / "meta.json").is_file():
        log(f"data: reusing {final}")
        return load_prepared(final)
    splits = nodes is not None and nodes.splits
    if splits and nodes.node_rank != 0:  # a helper: its part in node 0's folder, then wait
        tmp = temp_dir(final, nodes)
        try:
            _build(cfg, corpus, fingerprint, tmp, log, packed, processes, nodes)
        except Exception as e:
            if tmp.is_dir():  # node 0 stops waiting for this node's part, and says why
                failed(tmp, nodes, e)
            elif isinstance(e, OSError):  # node 0 removed the folder under us: it failed
                raise DataError(f"node 0 stopped preparing the shared data cache {final}; "
                                "see node 0's log") from e
            raise
        wait_published(final, nodes)
        return load_prepared(final)
    if final.exists():  # no meta.json: never renamed into place complete, so it is debris
        shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final.parent, log)
    tmp = temp_dir(final, nodes) if splits else final.parent / temp_name(fingerprint)
    tmp.mkdir()
    if splits:
        log(nodes.line(cache_root))
    try:
        _build(cfg, corpus, fingerprint, tmp, log, packed, processes, nodes if splits else None)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            log(f"data: another process built {final} first; using it")  # the race is harmless
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load_prepared(final)


def wait_for_data(cfg: DataConfig, cache_root: str | os.PathLike, timeout_s: float,
                  poll_s: float = 0.2) -> PreparedData:
    """For processes that must not build: wait for the builder's meta.json to appear."""
    if is_pretokenized(cfg.source):
        return _pretokenized(cfg, packed=True)  # the launching process checked the format
    final = cache_path(cfg, cache_root)
    deadline = time.monotonic() + timeout_s
    while not (final / "meta.json").is_file():
        if time.monotonic() >= deadline:
            raise DataError(f"data cache {final} did not appear within {timeout_s:.0f} s; the "
                            "process preparing it (local rank 0) failed or is slow "
                            "(see its log, or raise distributed.timeout_s)")
        time.sleep(poll_s)
    return load_prepared(final)


# ---- building ------------------------------------------------------------------------------
def _build(cfg: DataConfig, corpus: Corpus, fingerprint: str, out: Path,
           log: Callable[[str], None], packed: bool, processes: Optional[int],
           nodes: Optional[NodeShare] = None) -> None:
    """The cache's files in `out`. `nodes`: the nodes that split the chunks (node 0 plans and
    publishes; another node encodes its part of node 0's plan and returns)."""
    # A pretrained tokenizer is known first: whether long documents may be cut depends on it.
    pretrained = pretrained_dir(cfg)
    kind = resolve_tokenizer(cfg)
    tokenizer, note = Tokenizer.from_pretrained(pretrained) if pretrained is not None \
        else (None, "")
    cutter = piece_cutter(tokenizer.hf) if tokenizer is not None else pre_tokenizer_for(kind)
    units = plan_units(corpus, pieces=cutter is not None)
    total = sum(u.nbytes for u in units)
    processes = processes or default_processes(min(total, corpus.max_bytes or total))
    if nodes is not None and nodes.node_rank != 0:
        plan = wait_for_plan(out, out.parent / fingerprint, nodes)
        if plan is None:
            return
        jobs = chunk_jobs(corpus, group_chunks(units, plan["chunking"], corpus.max_bytes),
                          cutter)[:len(plan["per_chunk"])]
        jobs[-1] = replace(jobs[-1], budget=plan["budget"])
        frags = Fragments(plan["sizes"], plan["ends"], plan["per_chunk"])
        tokenizer = Tokenizer.load(out / plan["tokenizer_file"])
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
        with workers(processes) as pool:
            encode_shards(jobs, frags, plan["is_val"], tokenizer, out / plan["tokenizer_file"],
                          dtype, out, pool, log, nodes)
        return
    chunking = processes * (nodes.nnodes if nodes is not None else 1)  # chunks for every node
    jobs = chunk_jobs(corpus, group_chunks(units, chunking, corpus.max_bytes), cutter)
    with workers(processes) as pool:
        # Pass 1: count documents (their sizes pick the tokenizer's training text).
        jobs, frags = count_fragments(jobs, corpus.max_bytes, pool, log)
        doc_sizes = frags.doc_sizes()
        sizes = doc_sizes[doc_sizes > 0]
        if not len(sizes):
            raise DataError(f"data.source={cfg.source!r} holds no text (every document is "
                            "empty); point it at files with content")
        is_val = _split_mask(len(sizes), cfg.val_fraction)  # (n_docs,) bool
        text_bytes = int(sizes.sum())
        log(f"data: {len(sizes)} documents, {text_bytes / 1e6:.1f} MB of text from "
            f"{corpus.describe()}; {int(is_val.sum())} held out for validation")

        # Pass 2: a pretrained tokenizer is used as it is; one of ours is trained on training
        # documents only, so validation stays unseen text.
        if tokenizer is not None:
            tokenizer_file = f"{PRETRAINED_DIR}/{TOKENIZER_FILE}"
            (out / PRETRAINED_DIR).mkdir()
            copy_tokenizer_files(pretrained, out / PRETRAINED_DIR)
            log(f"tokenizer: pretrained, {tokenizer.vocab_size} tokens, from {pretrained} "
                f"(documents end with id {tokenizer.eot_id}, padded rows start with "
                f"{tokenizer.bot_id})" + (f"; {note}" if note and not packed else ""))
        else:
            tokenizer_file = TOKENIZER_FILE
            tokenizer = _train_tokenizer(cfg, jobs, frags, sizes, is_val, pool, log)
            tokenizer.save(out / tokenizer_file)

        # Pass 3: every chunk's ids into shards of its own, in parallel.
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
        if nodes is not None:  # the others may start: node 0's plan, their part of it
            write_plan(out, frags.sizes, frags.ends, frags.per_chunk, is_val, chunking,
                       jobs[-1].budget, tokenizer_file)
        stats = encode_shards(jobs, frags, is_val, tokenizer, out / tokenizer_file, dtype, out,
                              pool, log, nodes)

    meta = {
        "version": FORMAT_VERSION, "fingerprint": fingerprint, "source": cfg.source,
        "kind": corpus.kind, "num_files": corpus.num_files, "text_bytes": text_bytes,
        "tokenizer": tokenizer.kind, "tokenizer_file": tokenizer_file,
        "tokenizer_source": str(pretrained) if pretrained is not None else None,
        "vocab_size": tokenizer.vocab_size, "dtype": dtype.name,
        "pad_id": tokenizer.pad_id, "bot_id": tokenizer.bot_id, "eot_id": tokenizer.eot_id,
        "val_fraction": cfg.val_fraction,
        "num_docs": {s: stats[s]["docs"] for s in SPLITS},
        "num_tokens": {s: stats[s]["tokens"] for s in SPLITS},
        "shards": {s: stats[s]["shards"] for s in SPLITS},
        "chunks_per_node": [sum(1 for k in range(len(jobs)) if k % n == r)
                            for n in [nodes.nnodes if nodes is not None else 1]
                            for r in range(n)],
    }
    atomic_write_json(out / "meta.json", meta, sort_keys=True)  # last: marks the directory complete


def _train_tokenizer(cfg: DataConfig, jobs: list, frags: Fragments, sizes: np.ndarray,
                     is_val: np.ndarray, pool: Workers, log: Callable[[str], None]) -> Tokenizer:
    t0 = time.perf_counter()
    kind = resolve_tokenizer(cfg)  # bpe or char
    keep = ~is_val if kind == "char" else _spread_subsample(sizes, ~is_val, TOKENIZER_TRAIN_BYTES)
    trained_on = int(sizes[keep].sum())
    texts = training_texts(jobs, frags, keep, kind == "char", pool)
    with Ticker(log, lambda s: f"tokenizer: training {kind} on "
                               f"{trained_on / 1e6:.1f} MB of text, {s:.0f} s so far"):
        tokenizer = Tokenizer.train_char(texts) if kind == "char" \
            else Tokenizer.train_bpe(texts, cfg.vocab_size)
    log(f"tokenizer: trained {tokenizer.kind} with {tokenizer.vocab_size} tokens on "
        f"{trained_on / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
    return tokenizer


def _split_mask(n: int, val_fraction: float) -> np.ndarray:
    """(n,) bool, True for validation documents: a seeded permutation's first round(f*n) docs.

    At least one validation doc when asked for any (an empty validation set breaks evaluation),
    and at least one training doc."""
    n_val = int(round(val_fraction * n))
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)
    else:
        n_val = 0 if n < 2 else n_val
    mask = np.zeros(n, dtype=bool)
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    mask[perm[:n_val]] = True
    return mask


def _spread_subsample(sizes: np.ndarray, allowed: np.ndarray, budget: int) -> np.ndarray:
    """(n,) bool: allowed docs, thinned to ~budget bytes by taking every k-th one.

    Strided rather than a prefix: files are sorted by path, so a prefix would train the
    tokenizer on one corner of the corpus (say, only asyncio/)."""
    total = int(sizes[allowed].sum())
    if total <= budget:
        return allowed.copy()
    stride = int(np.ceil(total / budget))
    idx = np.flatnonzero(allowed)[::stride]
    keep = np.zeros_like(allowed)
    keep[idx] = True
    return keep
