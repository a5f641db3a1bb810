"""Encoded fine-tuning records on disk, keyed by everything that changes them, so that records
are encoded once: by the launcher, and then never again, neither by its workers (which map the
arrays instead of loading the tokenizer and encoding the same records again) nor by the next run
on the same data.

The key (a fingerprint) covers the records' bytes (a file's or folder's content, or the Python
API's lists), the tokenizer's files, the task, every data.* setting that shapes an example
(chat template and its file's text, system prompt, fields, max length, ...; every key but the
few listed in `_NOT_ENCODING`), and the versions of transformers and tokenizers. The validation
split by data.val_fraction is made when loading, so changing it (or the seed) reuses the cache.

Layout of `<cache_root>/encoded/<fingerprint>/`:
    <split>.<column>.npy   flat int32 token ids of every example of the split (train, val), one
                           file per sequence column (input_ids, targets)
    <split>.offsets.npy    int64 start of each example, plus the end (n + 1)
    <split>.label.npy      int64 label of each example (classification)
    meta.json              written last (its presence means the rest is complete): the
                           encoder's log lines and task fields, the tokenizer's pad and EOS ids
                           and size, the source names the lines mention
A cache is built in a private temp dir and renamed into place: a reader never sees half of one,
and of two processes that build the same one, the first to finish wins (the other's is dropped).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..config.tree import TrainConfig
from ..fileio import atomic_write_json
from .examples import FinetuneDataset
from .tokenizer import tokenizer_files_fingerprint

FORMAT_VERSION = 1  # bump when an encoder's output changes for the same inputs
SPLITS = ("train", "val")
# data.* keys that do not change an encoded example: where files live (the records' and the
# tokenizer's bytes are keyed instead), the split made at load time, the loader's processes
_NOT_ENCODING = ("source", "val_source", "tokenizer", "cache_dir", "val_fraction", "num_workers")


@dataclass
class TokenizerFacts:
    """What training needs of the tokenizer once the records are encoded: the pad id (batches),
    the EOS id and the number of tokens (the model's embedding rows), so a process that maps the
    cache never loads transformers' tokenizer. A task that asks for anything else gets it from
    the tokenizer itself, loaded then (once)."""
    path: str
    pad_token_id: int
    eos_token_id: Optional[int]
    size: int

    def __len__(self) -> int:
        return self.size

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_loaded":  # pickling and copying look these up
            raise AttributeError(name)
        if "_loaded" not in self.__dict__:
            from .hf_tokenizer import load_tokenizer
            self.__dict__["_loaded"] = load_tokenizer(self.path)[0]
        return getattr(self.__dict__["_loaded"], name)


@dataclass
class Encoded:
    """A task's encoded records: the datasets (val None without validation records), the lines
    the encoder logged, its task fields (a classifier's label names) and the tokenizer."""
    train: FinetuneDataset
    val: Optional[FinetuneDataset]
    notes: list[str]
    task_fields: dict
    tokenizer: Any  # transformers' tokenizer when just encoded, else TokenizerFacts
    fingerprint: str = ""
    reused: bool = False  # loaded from the cache (not encoded by this process)


def fingerprint(cfg: TrainConfig, task: str, train_records: Any, val_records: Any,
                tokenizer_dir: Path) -> str:
    """The cache key of these records encoded by `task` (its class name) under `cfg`.
    `*_records`: a path (file or folder) or a list of rows; None: no validation records."""
    from .rows import rows_fingerprint
    d = cfg.data
    settings = {k: v for k, v in dataclasses.asdict(d).items() if k not in _NOT_ENCODING}
    template = Path(str(d.chat_template)).expanduser()
    parts = {"task": task, "data": settings,
             "train": rows_fingerprint(train_records),
             "val": None if val_records is None else rows_fingerprint(val_records),
             "tokenizer": tokenizer_files_fingerprint(tokenizer_dir),
             "template_file": _file_hash(template) if d.chat_template not in ("auto", "none")
             and template.is_file() else None,
             "libraries": [_version("transformers"), _version("tokenizers")],
             "version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def load_or_encode(root: Path, key: str, tokenizer_dir: Path, names: dict[str, str],
                   encode: Callable[[], Encoded], log: Callable[[str], None],
                   check_reused: Callable[[Encoded], None] = lambda encoded: None) -> Encoded:
    """The encoded records under `root`/encoded/`key`, or `encode()` them and save them there.
    `names`: the names the encoder's lines give the sources and the tokenizer ({"train": ...,
    "val": ..., "tokenizer": ...}): reused lines are said with this run's. `check_reused`: what
    `encode` checks before it reads the data, for reused records (their key holds the data and
    tokenizer, not the model): it refuses before a line about the data is said, as `encode`
    would. A cache that cannot be written is said once, and the run goes on."""
    final = Path(root).expanduser() / "encoded" / key
    if (final / "meta.json").is_file():
        encoded = load(final, tokenizer_dir, names)
        encoded.reused = True
        check_reused(encoded)
        log(f"data: reusing the encoded records in {final}")
        for line in encoded.notes:
            log(line)
        return encoded
    encoded = encode()
    encoded.fingerprint = key
    for line in encoded.notes:
        log(line)
    try:
        if save(encoded, final, names):
            log(f"data: encoded records saved in {final}; a run on the same records, tokenizer "
                "and data settings reuses them")
    except OSError as e:
        log(f"data: cannot save the encoded records in {final} ({e.strerror or e}); each "
            "process encodes them again (set data.cache_dir to a writable folder)")
    return encoded


def save(encoded: Encoded, final: Path, names: dict[str, str]) -> bool:
    """Write the cache (False: another process finished the same one first)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        counts = {}
        for split, ds in (("train", encoded.train), ("val", encoded.val)):
            if ds is None:
                continue
            counts[split] = len(ds)
            for name, array in ds.arrays().items():
                np.save(tmp / f"{split}.{name}.npy", array)
        tok = encoded.tokenizer
        atomic_write_json(tmp / "meta.json", {
            "fingerprint": encoded.fingerprint, "examples": counts, "notes": encoded.notes,
            "task_fields": encoded.task_fields, "names": names,
            "columns": encoded.train.sequence_keys,
            "tokenizer": {"pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
                          "size": len(tok)}})
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "meta.json").is_file():
                raise
            return False  # the race is harmless: the same bytes
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load(folder: Path, tokenizer_dir: Path, names: dict[str, str]) -> Encoded:
    """The cache in `folder`, its arrays memory-mapped (read-only, shared by the processes of
    this machine through the page cache); `tokenizer_dir` holds the same tokenizer files."""
    meta = json.loads((folder / "meta.json").read_text())
    datasets: dict[str, Optional[FinetuneDataset]] = {}
    for split in SPLITS:
        if split not in meta["examples"]:
            datasets[split] = None
            continue
        columns = {c: np.load(folder / f"{split}.{c}.npy", mmap_mode="r")
                   for c in meta["columns"]}
        label = folder / f"{split}.label.npy"
        datasets[split] = FinetuneDataset.from_arrays(
            columns, np.load(folder / f"{split}.offsets.npy"),
            np.load(label) if label.is_file() else None)
    notes = list(meta["notes"])
    for what, old in meta["names"].items():  # said with this run's names
        if what in names and old != names[what]:
            notes = [line.replace(old, names[what]) for line in notes]
    t = meta["tokenizer"]
    facts = TokenizerFacts(str(tokenizer_dir), t["pad_token_id"], t["eos_token_id"], t["size"])
    return Encoded(datasets["train"], datasets["val"], notes, meta["task_fields"], facts,
                   meta["fingerprint"])


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
