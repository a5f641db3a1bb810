"""Atomic writes: every file and folder a run leaves is written to a temporary name next to its
place, flushed to disk and renamed, so a reader (or a crash) sees the old version or the new one,
never half of one. The one home for this; every writer in paratrain goes through it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def umask() -> int:
    """The process umask (reading it means setting it: put it straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Temp file (a name unique to this process) in the same directory, fsync, rename."""
    with atomic_write_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: Path, obj: Any, *, sort_keys: bool = False) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys,
                                       default=_jsonable) + "\n")


@contextlib.contextmanager
def atomic_write_path(path: Path) -> Iterator[Path]:
    """For writers that want a file name (matplotlib, safetensors): they write the yielded temp
    path; on success it is fsynced and renamed onto `path`, on failure it vanishes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix,
                               dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(out_dir: Path) -> Iterator[Path]:
    """Fill a temporary folder next to `out_dir`; on success it replaces `out_dir` by renames,
    on failure it vanishes. A reader sees the old folder or the new one, never half of one."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~umask())  # mkdtemp makes 0700; a model is for sharing
        yield tmp
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished folder onto `dst` by renames (the old one aside first, then dropped)."""
    dst = Path(dst)
    old = dst.with_name(f".{dst.name}.old.{os.getpid()}")
    if dst.exists():
        dst.rename(old)
    Path(src).rename(dst)
    shutil.rmtree(old, ignore_errors=True)


def _jsonable(x: Any) -> Any:
    """Paths and one-element tensors, which summaries carry, as JSON values."""
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "numel") and hasattr(x, "tolist"):  # a tensor, without importing torch
        return x.item() if x.numel() == 1 else x.tolist()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
