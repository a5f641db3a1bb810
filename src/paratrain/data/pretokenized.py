"""A folder of token shards written elsewhere (nanoGPT-style preparation scripts), trained on as
it is: no copy, no re-tokenizing.

The folder holds flat token ids in `.bin` files (little-endian uint16, or uint32 for
vocabularies over 65,536), EOS between documents, and a `meta.json` saying what they are:

    {"vocab_size": 50304, "eos_id": 50256}            # optional: "dtype", "bos_id", "pad_id"

Files whose name contains "val" are the validation split, the rest (in sorted order) the
training stream. `train_offsets.npy` / `val_offsets.npy` (each document's start in its split's
stream, then the end) are optional: packed windows need none, padded rows do. A `tokenizer.json`
next to them travels into the run's model/ folder. nanoGPT's `meta.pkl` is never unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..errors import DataError
from .corpus import TEXT_SUFFIXES
from .tokenizer import TOKENIZER_FILE

META = "meta.json"
_META_HELP = ('write meta.json next to them: {"vocab_size": N, "eos_id": E} (optional: "dtype": '
              '"uint16" | "uint32", "bos_id", "pad_id")')


def token_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.bin") if p.is_file())


def is_pretokenized(source: str) -> bool:
    """A directory of .bin token files with a meta.json, or with no file a text corpus would
    read (a stray .bin in a folder of text leaves it a text corpus)."""
    folder = Path(os.path.expanduser(source))
    if not folder.is_dir() or not token_files(folder):
        return False
    return (folder / META).is_file() or not any(
        p.suffix.lower() in TEXT_SUFFIXES or p.suffix.lower() in (".jsonl", ".parquet")
        for p in folder.rglob("*") if p.is_file())


def load_tokens(source: str, packed: bool) -> dict:
    """The meta of a PreparedData over the folder (see cache.load_prepared); DataError, one line
    naming data.source, when the folder does not say what its ids are."""
    folder = Path(os.path.expanduser(source)).resolve()
    where = f"data.source={source!r}"
    if not (folder / META).is_file():
        hint = " (nanoGPT's meta.pkl is not read: pickles can run code)" \
            if (folder / "meta.pkl").is_file() else ""
        raise DataError(f"{where} holds token files (.bin) but no {META}{hint}; {_META_HELP}")
    meta = json.loads((folder / META).read_text())
    if not isinstance(meta.get("vocab_size"), int) or not isinstance(meta.get("eos_id"), int):
        raise DataError(f"{where}: {META} needs integer vocab_size and eos_id; {_META_HELP}")
    vocab, eos = meta["vocab_size"], meta["eos_id"]
    dtype = _dtype(meta.get("dtype"), vocab, where)
    shards: dict = {"train": [], "val": []}
    for path in token_files(folder):
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{where}: {path.name} is {size} bytes, not a whole number of "
                            f"{dtype.name} ids; set \"dtype\" in {META}")
        split = "val" if "val" in path.name.lower() else "train"
        if size:
            shards[split].append([str(path.relative_to(folder)), size // dtype.itemsize])
    num_docs = {s: _num_docs(folder, s, packed, where) for s in shards}
    return {"version": "tokens", "source": source, "kind": "tokens", "tokenizer": None,
            "tokenizer_file": TOKENIZER_FILE if (folder / TOKENIZER_FILE).is_file() else None,
            "vocab_size": vocab, "dtype": dtype.name, "eot_id": eos,
            "bot_id": meta.get("bos_id", eos), "pad_id": meta.get("pad_id", eos),
            "shards": shards, "num_docs": num_docs,
            "num_tokens": {s: sum(n for _, n in shards[s]) for s in shards},
            "fingerprint": _fingerprint(folder)}


DTYPES = ("uint16", "uint32")  # what nanoGPT-style scripts write; numpy reads them as they are
CHUNK = 2**24  # ids read at a time when looking for the largest


def _dtype(given: object, vocab: int, where: str) -> np.dtype:
    """meta.json's "dtype" (or the smallest that holds the vocabulary), checked: one line
    for a name numpy does not know, a float type, or ids too narrow for vocab_size."""
    if given is None:
        return np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    if given not in DTYPES:
        raise DataError(f'{where}: {META} has "dtype": {given!r}; token ids are one of '
                        f'{", ".join(DTYPES)} (what the .bin files hold), or leave it out')
    if given == "uint16" and vocab > 2**16:
        raise DataError(f'{where}: {META} has "dtype": "uint16" but vocab_size {vocab} needs '
                        'ids over 65,535; uint16 files cannot hold them: use "uint32"')
    return np.dtype(given)


def largest_ids(folder: Path, meta: dict) -> dict:
    """{shard file: its largest id}, reading every shard once, a chunk at a time."""
    dtype, out = np.dtype(meta["dtype"]), {}
    for name, n in meta["shards"]["train"] + meta["shards"]["val"]:
        ids = np.memmap(folder / name, dtype=dtype, mode="r", shape=(n,))
        out[name] = max(int(ids[s:s + CHUNK].max()) for s in range(0, n, CHUNK))
    return out


def check_ids(meta: dict, largest: dict) -> None:
    """Every id below vocab_size, else one line naming the file, the id and the fix (a
    model's embedding table has vocab_size rows: a larger id fails in a worker otherwise)."""
    vocab = meta["vocab_size"]
    for name, top in largest.items():
        if top >= vocab:
            raise DataError(f"data.source={meta['source']!r}: {name} holds token id {top}, "
                            f"beyond {META}'s vocab_size {vocab} (ids are 0 to {vocab - 1}); set "
                            f"vocab_size to at least {top + 1}, or fix the tokenization")


def _num_docs(folder: Path, split: str, packed: bool, where: str) -> Optional[int]:
    offsets = folder / f"{split}_offsets.npy"
    if offsets.is_file():
        return len(np.load(offsets, mmap_mode="r")) - 1
    if not packed:
        raise DataError(f"{where}: padded rows need each document's start, and the folder has "
                        f"no {split}_offsets.npy; use data.format=packed, or write it")
    return None


def _fingerprint(folder: Path) -> str:
    """Names, sizes and modification times of the folder's files: cheap, changes with them."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return "tokens-" + h.hexdigest()[:24]
