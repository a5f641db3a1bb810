"""Where every `checkpoint export` writes: the one guard on OUT and the one atomic write of it.

Each export (a pretraining snapshot's model folder or .safetensors file, a run's model as a
Hugging Face folder, a fine-tuning snapshot's from_pretrained folder) writes its files into the
path `export_target` yields, a fresh name inside a temporary folder next to OUT; only when the
export has finished is it renamed onto OUT. So nothing a user has at OUT is touched unless they
asked (`--overwrite`), and an export that fails half-way leaves OUT as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional

from ..errors import ConfigError
from ..fileio import replace_dir, umask
from ..models.files import MODEL_DIR, WEIGHTS


def check_out(out: Path, *, overwrite: bool, file: bool = False,
              source: Optional[Path] = None) -> None:
    """Refuse (one ConfigError line) an OUT the export must not write: a file where a folder
    goes or a folder where a file goes, anything already there unless `overwrite`, and the
    export's own `source` (or a folder holding it)."""
    out = Path(out).expanduser()
    what = "a .safetensors file" if file else "a folder"
    if out.is_dir() if file else (out.exists() and not out.is_dir()):
        raise ConfigError(f"OUT {str(out)!r} is {'a folder' if file else 'a file'}; this export "
                          f"writes {what}: pass a path that is not one")
    if source is not None and out.exists():
        src, dst = Path(source).expanduser().resolve(), out.resolve()
        if src == dst or dst in src.parents:
            raise ConfigError(f"OUT {str(out)!r} holds what is being exported ({source}); "
                              "choose another path for the export")
    there = out.is_file() if file else (out.is_dir() and any(out.iterdir()))
    if there and not overwrite:
        raise ConfigError(f"OUT {str(out)!r} already exists{'' if file else ' and is not empty'}"
                          "; choose another path or pass --overwrite (overwrite=True from "
                          "Python) to replace it")


@contextlib.contextmanager
def export_target(out: Path, *, overwrite: bool, file: bool = False,
                  source: Optional[Path] = None) -> Iterator[Path]:
    """`check_out`, then the path for the export to write (an empty folder, or a file name); on
    success it is renamed onto OUT (a folder replacing the old one only when it passed the
    guard), on failure it vanishes and OUT is untouched."""
    out = Path(out).expanduser()
    check_out(out, overwrite=overwrite, file=file, source=source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export.", dir=out.parent))
    try:
        staging.chmod(0o777 & ~umask())  # mkdtemp makes 0700; a model is for sharing
        written = staging / out.name
        if not file:
            written.mkdir()
        yield written
        if file:
            os.replace(written, out)
        else:
            replace_dir(written, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def finished_model(path: str, *, merge: bool) -> Optional[tuple[Path, int]]:
    """(folder, step) when PATH is a finished run dir (summary.json) with its final model: that
    model is newer than any snapshot (none is taken after the last step), so an export of the
    run is it. A LoRA run: model/ holds the merged weights (`merge`), adapter/ the adapter
    alone; a run without adapter/ has no --merge export (None: the snapshot path refuses it)."""
    from ..tasks.lora import ADAPTER_DIR
    run = Path(path).expanduser()
    try:
        steps = json.loads((run / "summary.json").read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    adapter = run / ADAPTER_DIR
    if merge and not adapter.is_dir():
        return None
    folder = adapter if adapter.is_dir() and not merge else run / MODEL_DIR
    return (folder, int(steps)) if folder.is_dir() else None


def export_copy(folder: Path, out: Path, *, overwrite: bool) -> Path:
    """OUT as a copy of a finished run's model `folder` (for our own models, its weights alone
    when OUT ends in .safetensors). The run's base model (model.path) is never OUT."""
    out = Path(out)
    as_file = out.suffix == ".safetensors"
    hf = "model_type" in _json(folder / "config.json")
    if as_file and (hf or not (folder / WEIGHTS).is_file()):
        raise ConfigError(f"OUT {str(out)!r}: a fine-tuning run exports to a folder "
                          "(from_pretrained reads it); pass a folder path")
    base = (_yaml(folder.parent / "config.yaml").get("model") or {}).get("path")
    if base and out.exists() and out.resolve() == Path(str(base)).expanduser().resolve():
        raise ConfigError(f"OUT {str(out)!r} is the base model's folder (model.path); choose "
                          "another folder")
    with export_target(out, overwrite=overwrite, file=as_file, source=folder) as target:
        if as_file:
            shutil.copyfile(folder / WEIGHTS, target)
        else:
            shutil.copytree(folder, target, dirs_exist_ok=True)
    return out


def _json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def _yaml(path: Path) -> dict:
    import yaml
    try:
        d = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return d if isinstance(d, dict) else {}
