"""What a test session builds once, whichever pytest-xdist worker asks first.

The suite runs on several workers (scripts/test.sh: `pytest -n auto --dist loadfile`), each a
process with its own temp dir. The session's inputs (the corpus, the tiny models) and its cached
runs (tests/_runs.py) live in one folder beside those temp dirs instead, built under a file
lock by the first worker that needs them; the others wait for it and read the same files. So a
run is trained once per session however the files are spread over the workers, and its key (its
resolved config, paths included) is the same on every worker. Without xdist the folder is in
the session's own temp dir.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Union

Built = Union[Path, tuple[Path, ...]]


def session_root(tmp_path_factory) -> Path:
    """The session's shared folder: beside the workers' temp dirs (their parent is the
    session's) under xdist, else inside the one temp dir."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    return root


@contextmanager
def held(lock: Path) -> Iterator[None]:
    """An exclusive lock on `lock` (a file): the other workers wait here until it is released
    (pytest's timeout on the waiting test bounds the wait)."""
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Built]) -> Built:
    """`build(folder)` run once per session into a fresh folder (renamed into place whole when it
    returns, so nobody reads half of it); returns what it returned (paths inside the folder),
    at their final place."""
    root = session_root(tmp_path_factory)
    final, record = root / name, root / f"{name}.json"
    with held(root / f"{name}.lock"):
        if not record.exists():
            building = root / f"{name}.building"
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir()
            got = build(building)
            paths = [got] if isinstance(got, Path) else list(got)
            relative = [str(Path(p).relative_to(building)) for p in paths]
            os.rename(building, final)
            record.write_text(json.dumps({"paths": relative, "tuple": not isinstance(got, Path)}))
    saved = json.loads(record.read_text())
    paths = tuple(final / p for p in saved["paths"])
    return paths if saved["tuple"] else paths[0]
