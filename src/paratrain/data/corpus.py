"""Corpus: which files hold the training text, and how to read documents out of them.

`resolve_corpus` turns the one string in `data.source` into a frozen list of files, so that
everything downstream (the cache fingerprint, the train/val split) depends on that list only.
Every mistake a user can make in `data.source` becomes one DataError line saying what to do.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import os
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

from ..errors import DataError
from .rows import iter_jsonl
from .saved_dataset import arrow_files, column_batches, is_saved_dataset

# Suffixes we read as plain text when `data.source` is a directory (a glob takes what it matches).
TEXT_SUFFIXES = frozenset({
    ".txt", ".text", ".md", ".markdown", ".rst", ".tex", ".py", ".pyi", ".pyx", ".c", ".h",
    ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".java", ".js", ".mjs", ".ts", ".tsx",
    ".jsx", ".go", ".rs", ".rb", ".php", ".pl", ".lua", ".sh", ".bash", ".zsh", ".sql", ".r",
    ".swift", ".kt", ".scala", ".hs", ".ml", ".json", ".yaml", ".yml", ".toml", ".ini", ".cfg",
    ".xml", ".html", ".htm", ".css", ".csv", ".tsv", ".log", ".org", ".asciidoc", ".adoc",
})
_KIND_SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".parquet": "parquet",
                  ".arrow": "arrow"}
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SOURCE_HELP = ("give a text file, a directory, a glob, a .jsonl/.parquet file, a "
                "datasets.save_to_disk folder, or 'stdlib'")


@dataclass(frozen=True)
class Corpus:
    source: str  # what the user wrote in data.source
    files: tuple[str, ...]  # sorted absolute paths
    kind: str  # "text" | "jsonl" | "parquet" | "arrow" (a save_to_disk folder's streams)
    text_field: str = "text"
    max_bytes: Optional[int] = None
    left_out: int = 0  # files of a directory that were not read (other suffixes or kinds)

    def documents(self) -> Iterator[str]:
        """Non-empty documents in file order, cut off after max_bytes (UTF-8) of text.

        The cut is exact and depends only on the sorted file list, so two processes that read
        the same corpus see the same documents (the train/val split relies on it)."""
        whole = ((doc, True) for path in self.files for doc in self.file_documents(path) if doc)
        for doc, _ in budgeted(whole, self.max_bytes):
            if doc:  # a cut that leaves nothing of its document
                yield doc

    def file_documents(self, path: str, part: Optional[int] = None,
                       byte_range: Optional[Tuple[int, int]] = None) -> Iterator[str]:
        """The documents of one file (empty ones included): a parquet file's row group `part`,
        an .arrow file's record batch `part`, the lines of a .jsonl in `byte_range`, or all of
        them (None)."""
        if self.kind == "text":
            yield from _read_text(path)
        elif self.kind == "jsonl":
            yield from self._read_jsonl(path, byte_range)
        elif self.kind == "parquet":
            yield from self._read_parquet(path, part)
        else:
            yield from self._read_arrow(path, part)

    def fingerprint(self) -> str:
        """Changes when any file changes (size or mtime) or the reading options do.

        Cheap: one stat per file, no reading, so every rank can compute it at start-up."""
        h = hashlib.sha256()
        h.update(json.dumps([self.kind, self.text_field, self.max_bytes]).encode())
        for path in self.files:
            st = os.stat(path)
            h.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
        return h.hexdigest()

    @property
    def num_files(self) -> int:
        return len(self.files)

    def describe(self) -> str:
        """Which files were read, for the log: "3 files (2 .txt, 1 .json)", and their names when
        there are few, so that a folder read wrongly shows it at once."""
        suffixes = Counter(_suffix(f) for f in self.files)
        counts = ", ".join(f"{n} {suffix}" for suffix, n in suffixes.most_common())
        names = f": {', '.join(os.path.basename(f) for f in self.files)}" \
            if len(self.files) <= 3 else ""
        left_out = f"; {self.left_out} other files left out" if self.left_out else ""
        return f"{self.num_files} {self.kind} file{'s' if self.num_files != 1 else ''} " \
               f"({counts}{names}{left_out})"

    # ---- readers ---------------------------------------------------------------------------
    def _read_jsonl(self, path: str, byte_range: Optional[Tuple[int, int]] = None
                    ) -> Iterator[str]:
        where = f"data.source={self.source!r}: {path}"
        for lineno, record in iter_jsonl(path, where, byte_range):
            yield self._field(record, f"{path}:{lineno}" if byte_range is None else
                              f"{path}:{lineno} of the part from byte {byte_range[0]}")

    def _field(self, record: object, where: str) -> str:
        if not isinstance(record, dict) or self.text_field not in record:
            raise DataError(f"data.source={self.source!r}: record at {where} has no field "
                            f"{self.text_field!r}; set data.text_field to the field that holds "
                            "the text")
        value = record[self.text_field]
        if value is None:
            return ""
        if not isinstance(value, str):
            raise DataError(f"data.source={self.source!r}: field {self.text_field!r} at {where} "
                            f"is a {type(value).__name__}, not a string; set data.text_field "
                            "to a text field")
        return value

    def _read_parquet(self, path: str, row_group: Optional[int] = None) -> Iterator[str]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"data.source={self.source!r} is parquet, which needs pyarrow; "
                            "pip install 'paratrain[parquet]'") from None
        pf = pq.ParquetFile(path)
        if self.text_field not in pf.schema_arrow.names:
            raise DataError(f"data.source={self.source!r}: {path} has no column "
                            f"{self.text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                            "set data.text_field to the column that holds the text")
        groups = None if row_group is None else [row_group]
        for batch in pf.iter_batches(batch_size=1024, columns=[self.text_field],
                                     row_groups=groups):
            for value in batch.column(0).to_pylist():
                if value is not None and not isinstance(value, str):
                    raise DataError(f"data.source={self.source!r}: column {self.text_field!r} "
                                    f"of {path} is not text; set data.text_field to a string "
                                    "column")
                yield value or ""

    def _read_arrow(self, path: str, batch: Optional[int] = None) -> Iterator[str]:
        where = f"data.source={self.source!r}"
        for values in column_batches(path, self.text_field, where, batch):
            for value in values:
                yield self._field({self.text_field: value}, path)


def budgeted(fragments: Iterable[Tuple[str, bool]],
             budget: Optional[int]) -> Iterator[Tuple[str, bool]]:
    """(text, ends its document) fragments, cut off after `budget` bytes of UTF-8 text (None:
    all): the fragment that reaches the budget is cut at that byte (a character split by the
    cut is dropped) and ends its document there. The one home of data.max_bytes' cut."""
    for text, ends in fragments:
        if budget is None:
            yield text, ends
            continue
        raw = text.encode("utf-8")
        if len(raw) >= budget:
            # errors="ignore" drops a character split by the cut instead of mangling it.
            yield raw[:budget].decode("utf-8", errors="ignore"), True
            return
        budget -= len(raw)
        yield text, ends


def _read_text(path: str) -> Iterator[str]:
    # errors="replace": one latin-1 file in a directory of code must not stop a run.
    with open(path, "r", encoding="utf-8", errors="replace", newline="") as f:
        yield f.read()


# ---- resolution ----------------------------------------------------------------------------
def resolve_corpus(source: str, text_field: str = "text",
                   max_bytes: Optional[int] = None) -> Corpus:
    """`data.source` -> Corpus. Raises DataError (one line, naming data.source) on any problem."""
    if source == "stdlib":
        files = _stdlib_files()
        return Corpus(source, files, "text", text_field, max_bytes)
    expanded = os.path.expanduser(source)
    if _glob.has_magic(expanded):
        matched = [p for p in _glob.glob(expanded, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise DataError(f"data.source={source!r} is a glob that matches no files; check the "
                            "pattern (use ** for subdirectories) or " + _SOURCE_HELP)
        files = _sorted_abs(matched)
        return Corpus(source, files, _kind_of(source, files), text_field, max_bytes)
    path = Path(expanded)
    if path.is_file():
        files = _sorted_abs([str(path)])
        return Corpus(source, files, _suffix_kind(str(path)) or "text", text_field, max_bytes)
    if path.is_dir() and is_saved_dataset(path):  # streamed, never its .json metadata
        return Corpus(source, arrow_files(path, "data.source"), "arrow", text_field, max_bytes)
    if path.is_dir():
        files, kind, left_out = _dir_files(source, path)
        return Corpus(source, files, kind, text_field, max_bytes, left_out)
    raise DataError(f"data.source={source!r} does not exist; {_SOURCE_HELP}")


def _stdlib_files() -> tuple[str, ...]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    if not found:
        raise DataError(f"data.source='stdlib' found no .py files under {root}; this Python has "
                        "no standard library source, so " + _SOURCE_HELP)
    return _sorted_abs(found)


def _dir_files(source: str, root: Path) -> tuple[tuple[str, ...], str, int]:
    """(files, kind, how many others were left out): text files if there are any; else a
    directory of .jsonl or of .parquet files."""
    text, data, seen = [], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if name.startswith("."):
                continue
            full = os.path.join(dirpath, name)
            seen += 1
            if _suffix_kind(name):
                data.append(full)
            elif os.path.splitext(name)[1].lower() in TEXT_SUFFIXES:
                text.append(full)
    if text:
        return _sorted_abs(text), "text", seen - len(text)
    if data:
        files = _sorted_abs(data)
        return files, _kind_of(source, files), seen - len(data)
    raise DataError(f"data.source={source!r} is a directory with no text files (looked for "
                    f"{', '.join(sorted(TEXT_SUFFIXES)[:8])}, ... and .jsonl/.parquet); "
                    + _SOURCE_HELP)


def _suffix_kind(path: str) -> Optional[str]:
    lower = path.lower()
    for suffix, kind in _KIND_SUFFIXES.items():
        if lower.endswith(suffix):
            return kind
    return None


def _kind_of(source: str, files: tuple[str, ...]) -> str:
    """All-jsonl -> jsonl, all-parquet -> parquet, none of either -> text; a mix is an error."""
    kinds = {_suffix_kind(f) or "text" for f in files}
    if len(kinds) > 1:
        raise DataError(f"data.source={source!r} mixes {' and '.join(sorted(kinds))} files; "
                        "point it at one kind (for example a glob like data/*.jsonl)")
    return kinds.pop()


def _suffix(path: str) -> str:
    lower = path.lower()
    return next((s for s in _KIND_SUFFIXES if lower.endswith(s)), None) \
        or os.path.splitext(lower)[1] or "no suffix"


def _sorted_abs(paths: list[str]) -> tuple[str, ...]:
    return tuple(sorted({os.path.abspath(p) for p in paths}))
