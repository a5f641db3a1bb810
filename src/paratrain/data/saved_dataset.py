"""A `datasets.save_to_disk` folder, read with pyarrow alone (the `datasets` package is optional).

`save_to_disk` writes a folder holding `state.json` (the order of its data files),
`dataset_info.json` (the features) and `data-0000N-of-0000M.arrow`: Arrow IPC *streams*, one
record batch after another. Reading them through a memory map, batch by batch, is what
`datasets` itself does; it keeps a corpus of any size out of RAM. A `DatasetDict` folder
(`dataset_dict.json` and one sub-folder per split) is refused with the split to pick.
Pretraining (corpus.py) streams a column; fine-tuning (rows.py) reads the rows whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from ..errors import ConfigError, DataError

MARKERS = ("state.json", "dataset_info.json", "dataset_dict.json")


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` is what `save_to_disk` wrote (a Dataset or a DatasetDict)."""
    return any((folder / name).is_file() for name in MARKERS)


def arrow_files(folder: Path, what: str) -> tuple[str, ...]:
    """The folder's .arrow files in the dataset's row order (state.json's `_data_files`)."""
    source = str(folder)
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits") or []
        first = splits[0] if splits else "train"
        raise DataError(f"{what}={source!r} holds the splits {', '.join(splits)}; point it at "
                        f"one of them, e.g. {os.path.join(source, first)}")
    state = folder / "state.json"
    names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]] \
        if state.is_file() else sorted(p.name for p in folder.glob("*.arrow"))
    files = [folder / name for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"{what}={source!r} is a datasets.save_to_disk folder without its data "
                        f"file{'s' if len(missing) != 1 else ''} "
                        f"{', '.join(missing) or '(no .arrow file)'}; save it again")
    return tuple(os.path.abspath(f) for f in files)


def _ipc():
    try:
        import pyarrow as pa
    except ImportError:
        raise ConfigError("a datasets.save_to_disk folder is read with pyarrow; "
                          "pip install 'paratrain[parquet]'") from None
    return pa


def column_batches(path: str, column: str, what: str,
                   only: Optional[int] = None) -> Iterator[List[Any]]:
    """The values of one column of one .arrow stream file, one record batch at a time (memory
    mapped: only the batch being converted is in RAM); `only`: just that batch."""
    pa = _ipc()
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_stream(source)
        if column not in reader.schema.names:
            raise DataError(f"{what}: {path} has no column {column!r} (columns: "
                            f"{', '.join(reader.schema.names)}); set data.text_field to the "
                            "column that holds the text")
        index = reader.schema.get_field_index(column)
        for i, batch in enumerate(reader):
            if only is None or i == only:
                yield batch.column(index).to_pylist()
            if i == only:
                return


def batch_count(path: str) -> int:
    """Record batches in one .arrow stream file (reads only the batches' headers' worth)."""
    pa = _ipc()
    with pa.memory_map(path) as source:
        return sum(1 for _ in pa.ipc.open_stream(source))


def read_saved_rows(folder: Path, what: str) -> List[Dict[str, Any]]:
    """Every row of a save_to_disk folder as a dict (fine-tuning sets: read whole)."""
    pa = _ipc()
    rows: List[Dict[str, Any]] = []
    for path in arrow_files(folder, what):
        with pa.memory_map(path) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows
