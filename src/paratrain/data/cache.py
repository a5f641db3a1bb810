"""The tokenized corpus on disk, keyed by a fingerprint of everything that changes its bytes.

Layout of `<cache_root>/data/<fingerprint>/`:
    tokenizer.json                 the trained tokenizer, or with data.tokenizer=DIR:
    tokenizer/                     the pretrained tokenizer's files, copied byte for byte
    train.bin, val.bin             flat token ids (uint16, or uint32 for vocabularies > 65536);
                                   every document is followed by one [EOT] (a pretrained
                                   tokenizer's EOS)
    train_offsets.npy, val_...     int64 start of each document in the .bin, plus the end (n+1)
    meta.json                      written last: its presence means the rest is complete

A cache is built in a private temp dir and renamed into place, so a reader never sees half of one
and two racing builders both end up using whichever finished first. Windows (seq_length) and the
packed/padded format are cut at load time, so changing them reuses the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import numpy as np

from ..config.defaults import resolve_tokenizer
from ..config.sections import DataConfig
from ..errors import DataError
from ..fileio import atomic_write_json
from .corpus import Corpus, resolve_corpus
from .tokenizer import TOKENIZER_FILE, Tokenizer, copy_tokenizer_files, tokenizer_files_fingerprint

FORMAT_VERSION = 1
SPLIT_SEED = 20240611  # fixed: the train/val split must not move when the training seed does
TOKENIZER_TRAIN_BYTES = 64 * 2**20  # BPE trains on at most this much text (~15 s on 2 cores)
ENCODE_BATCH_BYTES = 4 * 2**20  # text per encode_batch call: bounds memory, keeps cores busy
SPLITS = ("train", "val")
PROGRESS_EVERY_S = 5.0  # a stage that runs longer says how far it is, this often
PRETRAINED_DIR = "tokenizer"  # where a pretrained tokenizer's files go in a cache


@dataclass(frozen=True)
class PreparedData:
    dir: Path
    tokenizer_path: Path
    train_tokens: Path
    train_offsets: Path
    val_tokens: Path
    val_offsets: Path
    meta: dict  # vocab_size, num_docs/num_tokens {train, val}, dtype, special ids, fingerprint...

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.load(self.tokenizer_path)

    def tokens_path(self, split: str) -> Path:
        return {"train": self.train_tokens, "val": self.val_tokens}[_check_split(split)]

    def offsets_path(self, split: str) -> Path:
        return {"train": self.train_offsets, "val": self.val_offsets}[_check_split(split)]

    def num_tokens(self, split: str) -> int:
        return int(self.meta["num_tokens"][_check_split(split)])

    def num_docs(self, split: str) -> int:
        return int(self.meta["num_docs"][_check_split(split)])

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
                        train_tokens=d / "train.bin", train_offsets=d / "train_offsets.npy",
                        val_tokens=d / "val.bin", val_offsets=d / "val_offsets.npy", meta=meta)


def cache_path(cfg: DataConfig, cache_root: str | os.PathLike) -> Path:
    """Where the cache for this config lives (resolves the corpus: stats every file)."""
    corpus = resolve_corpus(cfg.source, cfg.text_field, cfg.max_bytes)
    return Path(cache_root) / "data" / data_fingerprint(cfg, corpus)


def prepare_data(cfg: DataConfig, cache_root: str | os.PathLike,
                 log: Callable[[str], None] = print, packed: bool = True) -> PreparedData:
    """Reuse the cache for this config, or build it. Call on one process per node (local rank
    0, or one per shared filesystem); the others call `wait_for_data`. `packed`: whether the
    task cuts the corpus into full windows (its TaskSpec), else padded rows: only the log's
    words differ, the cache is the same."""
    corpus = resolve_corpus(cfg.source, cfg.text_field, cfg.max_bytes)
    fingerprint = data_fingerprint(cfg, corpus)
    final = Path(cache_root) / "data" / fingerprint
    if (final / "meta.json").is_file():
        log(f"data: reusing {final}")
        return load_prepared(final)
    if final.exists():  # no meta.json: never renamed into place complete, so it is debris
        shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{fingerprint}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _build(cfg, corpus, fingerprint, tmp, log, packed)
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
           log: Callable[[str], None], packed: bool) -> None:
    # Pass 1: count documents. Streaming three passes over the files keeps memory bounded by a
    # batch, not the corpus; the reads are cheap next to tokenization.
    sizes = [len(doc.encode("utf-8")) for doc in corpus.documents()]
    if not sizes:
        raise DataError(f"data.source={cfg.source!r} holds no text (every document is empty); "
                        "point it at files with content")
    is_val = _split_mask(len(sizes), cfg.val_fraction)  # (n_docs,) bool
    text_bytes = sum(sizes)
    log(f"data: {len(sizes)} documents, {text_bytes / 1e6:.1f} MB of text from "
        f"{corpus.describe()}; {int(is_val.sum())} held out for validation")

    # Pass 2: a pretrained tokenizer is used as it is; one of ours is trained on training
    # documents only, so validation stays unseen text.
    pretrained = pretrained_dir(cfg)
    if pretrained is not None:
        tokenizer_file = f"{PRETRAINED_DIR}/{TOKENIZER_FILE}"
        tokenizer, note = Tokenizer.from_pretrained(pretrained)
        (out / PRETRAINED_DIR).mkdir()
        copy_tokenizer_files(pretrained, out / PRETRAINED_DIR)
        log(f"tokenizer: pretrained, {tokenizer.vocab_size} tokens, from {pretrained} (documents "
            f"end with id {tokenizer.eot_id}, padded rows start with {tokenizer.bot_id})"
            + (f"; {note}" if note and not packed else ""))
    else:
        tokenizer_file = TOKENIZER_FILE
        tokenizer = _train_tokenizer(cfg, corpus, sizes, is_val, log)
        tokenizer.save(out / tokenizer_file)

    # Pass 3: tokenize everything, appending each split's ids to its .bin.
    t0 = time.perf_counter()
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)
    done = [0]  # text bytes tokenized so far, updated by the loop below
    with _Ticker(log, lambda s: f"tokenizing: {done[0] / 1e6:.1f} of {text_bytes / 1e6:.1f} MB "
                                f"({100 * done[0] / max(text_bytes, 1):.0f}%), {s:.0f} s so far"):
        stats = _tokenize_to_disk(corpus, is_val, tokenizer, dtype, out, done)
    total = sum(s["tokens"] for s in stats.values())
    log(f"tokenized {text_bytes / 1e6:.1f} MB -> {total / 1e6:.2f}M tokens in "
        f"{time.perf_counter() - t0:.1f} s")

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
    }
    atomic_write_json(out / "meta.json", meta, sort_keys=True)  # last: marks the directory complete


def _train_tokenizer(cfg: DataConfig, corpus: Corpus, sizes: List[int], is_val: np.ndarray,
                     log: Callable[[str], None]) -> Tokenizer:
    t0 = time.perf_counter()
    kind = resolve_tokenizer(cfg)  # bpe or char
    keep = ~is_val if kind == "char" else \
        _spread_subsample(np.asarray(sizes), ~is_val, TOKENIZER_TRAIN_BYTES)
    trained_on = int(np.asarray(sizes)[keep].sum())
    with _Ticker(log, lambda s: f"tokenizer: training {kind} on "
                                f"{trained_on / 1e6:.1f} MB of text, {s:.0f} s so far"):
        tokenizer = Tokenizer.train_char(_select(corpus, keep)) if kind == "char" \
            else Tokenizer.train_bpe(_select(corpus, keep), cfg.vocab_size)
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


def _select(corpus: Corpus, mask: np.ndarray) -> Iterator[str]:
    for i, doc in enumerate(corpus.documents()):
        if mask[i]:
            yield doc


def _tokenize_to_disk(corpus: Corpus, is_val: np.ndarray, tokenizer: Tokenizer,
                      dtype: np.dtype, out: Path, done: Optional[List[int]] = None) -> dict:
    files = {s: open(out / f"{s}.bin", "wb") for s in SPLITS}
    offsets = {s: [0] for s in SPLITS}
    eot = tokenizer.eot_id
    try:
        batch: List[str] = []
        splits: List[str] = []
        batch_bytes = 0

        def flush() -> None:
            for split, ids in zip(splits, tokenizer.encode_batch(batch)):
                ids.append(eot)  # document boundary, seen by packed windows
                np.asarray(ids, dtype=dtype).tofile(files[split])
                offsets[split].append(offsets[split][-1] + len(ids))
            batch.clear()
            splits.clear()

        for i, doc in enumerate(corpus.documents()):
            batch.append(doc)
            splits.append("val" if is_val[i] else "train")
            batch_bytes += len(doc)
            if batch_bytes >= ENCODE_BATCH_BYTES:
                flush()
                if done is not None:
                    done[0] += batch_bytes
                batch_bytes = 0
        flush()
    finally:
        for f in files.values():
            f.close()
    for s in SPLITS:
        np.save(out / f"{s}_offsets.npy", np.asarray(offsets[s], dtype=np.int64))
    return {s: {"docs": len(offsets[s]) - 1, "tokens": offsets[s][-1]} for s in SPLITS}


class _Ticker:
    """`with _Ticker(log, text):` a stage that runs longer than PROGRESS_EVERY_S logs
    `text(seconds so far)` that often, from a thread of its own (so a stage that is one blocking
    call, such as BPE training, is covered too); a short stage logs nothing extra."""

    def __init__(self, log: Callable[[str], None], text: Callable[[float], str],
                 every_s: float = PROGRESS_EVERY_S):
        self.log, self.text, self.every_s = log, text, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-progress", daemon=True)

    def __enter__(self) -> "_Ticker":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.log(self.text(time.perf_counter() - self._t0))
