"""Fine-tuning's input rows (not the run records of records/): every supported source becomes
one list of plain dicts.

Fine-tuning sets are small next to pretraining corpora (thousands to a few million rows), so
they are read whole; a list of dicts is what the encoders need and what a user can inspect.
One reader per format keeps the row order of the file, so "row N" in an error message is the
N-th record of the file (1-based; a CSV header and blank JSONL lines do not count).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..config.hub import is_hub_dataset, load_hub_dataset
from ..errors import ConfigError, DataError
from .saved_dataset import is_saved_dataset, read_saved_rows

Row = Dict[str, Any]
_FORMATS_HELP = ("give a .jsonl, .json, .parquet, .csv or .tsv file, or a datasets.save_to_disk "
                 "folder")


def read_rows(source: Any, *, what: str, subset: Optional[str] = None, split: str = "train",
              notes: Optional[List[str]] = None) -> List[Row]:
    """Rows from a file path, a `datasets.load_from_disk` folder, a Hub dataset
    (hf://datasets/org/name@commit: its `subset` and `split`), a list of dicts or a
    `datasets.Dataset`. `what` names the setting the source came from (e.g. "data.train"),
    so that errors say which one to fix. `notes` gets a line for the log when a .jsonl file
    has blank lines (skipped, but said: a blank line is often a record lost by an editor)."""
    if is_hub_dataset(source):
        rows = _dataset_rows(load_hub_dataset(source, subset, split, what), what)
    elif isinstance(source, (list, tuple)):
        rows = list(source)
        for i, row in enumerate(rows, start=1):
            if not isinstance(row, dict):
                raise DataError(f"{what}: item {i} is a {type(row).__name__}, not a dict; give "
                                "a list of dicts such as {'input': ..., 'output': ...}")
    elif _is_hf_dataset(source):
        rows = _dataset_rows(source, what)
    elif isinstance(source, (str, os.PathLike)):
        rows = _path_rows(str(source), what, notes if notes is not None else [])
    else:
        raise ConfigError(f"{what} is a {type(source).__name__}; {_FORMATS_HELP}, a list of "
                          "dicts or a datasets.Dataset")
    if not rows:
        raise DataError(f"{what}={_describe(source)} has no rows; point it at a non-empty dataset")
    return rows


def rows_from_lists(inputs: Sequence[str], outputs: Sequence[str], input_field: str = "input",
                    output_field: str = "output", *, what: str = "train") -> List[Row]:
    """Rows from parallel lists (the Python API's train_input=[...], train_output=[...])."""
    for name, values in ((f"{what}_input", inputs), (f"{what}_output", outputs)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ConfigError(f"{name} must be a list of strings, got a {type(values).__name__}")
    if len(inputs) != len(outputs):
        raise ConfigError(f"{what}_input has {len(inputs)} items but {what}_output has "
                          f"{len(outputs)}; give exactly one output per input")
    return [{input_field: x, output_field: y} for x, y in zip(inputs, outputs)]


def rows_fingerprint(source: Any) -> str:
    """sha256 of what the rows are: a file's bytes, a folder's files (names and bytes), or the
    rows of a list (as sorted-key JSON). Not where they lie: a copied file is the same rows.
    A path that does not exist hashes as its name (reading it then says what is wrong)."""
    h = hashlib.sha256()
    if isinstance(source, (str, os.PathLike)):
        path = Path(os.path.expanduser(str(source)))
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else \
            [path] if path.is_file() else []
        if not files:
            return "missing:" + str(source)
        for f in files:
            h.update((str(f.relative_to(path)) if f != path else "").encode() + b"\0")
            with open(f, "rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()
    try:
        text = json.dumps(list(source), sort_keys=True, ensure_ascii=False, default=repr)
    except TypeError:  # keys of mixed types cannot be sorted
        text = repr(list(source))
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _describe(source: Any) -> str:
    return repr(str(source)) if isinstance(source, (str, os.PathLike)) else type(source).__name__


# ---- files -------------------------------------------------------------------------------
def _path_rows(source: str, what: str, notes: List[str]) -> List[Row]:
    path = Path(os.path.expanduser(source))
    if path.is_dir():
        return _disk_dataset_rows(path, source, what)
    if not path.is_file():
        raise DataError(f"{what}={source!r} does not exist; {_FORMATS_HELP}")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return _jsonl_rows(path, source, what, notes)
    if name.endswith(".json"):
        return _json_rows(path, source, what)
    if name.endswith(".parquet"):
        return _parquet_rows(path, source, what)
    if name.endswith((".csv", ".tsv")):
        return _csv_rows(path, delimiter="\t" if name.endswith(".tsv") else ",")
    raise DataError(f"{what}={source!r} has an unknown suffix; {_FORMATS_HELP}")


def iter_jsonl(path: str | Path, where: str,
               byte_range: Optional[Tuple[int, int]] = None,
               blank: Optional[List[int]] = None) -> Iterator[tuple[int, Any]]:
    """(line number, JSON value) of each non-blank line of a .jsonl (or .jsonl.gz) file; a line
    that is not JSON is a DataError naming `where` and the line. Corpora read it too, a part
    of a long file at a time (`byte_range`, cut after a newline: line numbers count from it).
    `blank` collects the numbers of the blank lines skipped."""
    if byte_range is not None:
        with open(path, "rb") as raw:
            raw.seek(byte_range[0])
            part = raw.read(byte_range[1] - byte_range[0])
        f = io.TextIOWrapper(io.BytesIO(part), encoding="utf-8", errors="replace")
        where = f"{where} (the part from byte {byte_range[0]})"
    else:
        opener = gzip.open if str(path).lower().endswith(".gz") else open
        f = opener(path, "rt", encoding="utf-8", errors="replace")
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                if blank is not None:
                    blank.append(lineno)
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: line {lineno} is not valid JSON ({e.msg}); fix or "
                                "remove that line") from None


def _jsonl_rows(path: Path, source: str, what: str, notes: List[str]) -> List[Row]:
    rows: List[Row] = []
    blank: List[int] = []
    for lineno, record in iter_jsonl(path, f"{what}={source!r}", blank=blank):
        if not isinstance(record, dict):
            raise DataError(f"{what}={source!r}: line {lineno} is a JSON "
                            f"{type(record).__name__}, not an object; write one object "
                            "per line")
        rows.append(record)
    if blank:
        shown = ", ".join(map(str, blank[:5])) + (", ..." if len(blank) > 5 else "")
        notes.append(f"{what}={source!r}: {len(blank)} blank line(s) skipped (line {shown}); "
                     f"{len(rows)} records read")
    return rows


def _json_rows(path: Path, source: str, what: str) -> List[Row]:
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{what}={source!r} is not valid JSON ({e.msg} at line {e.lineno}); "
                        "fix it, or write one object per line as .jsonl") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise DataError(f"{what}={source!r} must hold a JSON list of objects; or write one "
                        "object per line as .jsonl")
    return records


def _parquet_rows(path: Path, source: str, what: str) -> List[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{what}={source!r} is parquet, which needs pyarrow; "
                          "pip install 'paratrain[parquet]'") from None
    return pq.read_table(path).to_pylist()


def _csv_rows(path: Path, delimiter: str) -> List[Row]:
    # newline="" lets the csv module handle quoted fields that contain line breaks.
    with open(path, "r", encoding="utf-8", newline="") as f:
        return [dict(row) for row in csv.DictReader(f, delimiter=delimiter)]


# ---- datasets ----------------------------------------------------------------------------
def _is_hf_dataset(source: Any) -> bool:
    # Duck-typed so that a list or a path never imports the (slow, optional) datasets package.
    return type(source).__module__.split(".")[0] == "datasets"


def _dataset_rows(dataset: Any, what: str) -> List[Row]:
    if type(dataset).__name__ != "Dataset" or not hasattr(dataset, "to_list"):
        splits = ", ".join(getattr(dataset, "keys", lambda: [])())
        raise ConfigError(f"{what} is a {type(dataset).__name__}" +
                          (f" with splits {splits}" if splits else "") +
                          "; pass one split, e.g. dataset['train']")
    return dataset.to_list()


def _disk_dataset_rows(path: Path, source: str, what: str) -> List[Row]:
    if not is_saved_dataset(path):
        raise DataError(f"{what}={source!r} is a directory but not a datasets.save_to_disk "
                        f"folder; {_FORMATS_HELP}")
    return read_saved_rows(path, what)
