"""Snapshots on storage: `step-NNNNNNN/` folders of torch.distributed.checkpoint (DCP) files and a
commit marker, under a local path or any fsspec URL (`s3://bucket/prefix`, `gs://...`).

One snapshot:
    step-0000120/
      __0_0.distcp, __1_0.distcp ...  each rank's shard of model + optimizer, written by that rank
      .metadata                       DCP's index, written by rank 0 once every rank has written
      tokenizer.json                  so that `paratrain checkpoint export` gives a usable model
                                      (a pretrained tokenizer: all its files)
      committed.json                  the commit marker, written last (see below)

Why a marker rather than a rename: object stores cannot rename a folder atomically, and one rule
for every filesystem is easier to trust. Rank 0 writes the marker after DCP has finished on every
rank (DCP's finish step, which writes `.metadata`, gathers every rank's write result first),
and only once every file a rank wrote is there with the size it wrote. A folder without a
readable marker is not a snapshot: readers skip it. The marker holds the size and the checksum
(integrity.py: computed while each file was written) of every other file, so a truncated or
altered file is caught before it is used, and the small trainer state (step, sampler position,
scheduler, RNG of every rank, resolved config) as JSON, so that our own state never goes
through pickle.

This module knows the layout and the storage, and is what `paratrain checkpoint inspect|export`
use; snapshotter.py saves and restores a training run through it.
"""

from __future__ import annotations

import functools
import io
import json
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from ..config.tree import TrainConfig
from ..data.tokenizer import TOKENIZER_FILE, TOKENIZER_FILES, tokenizer_files
from ..errors import CheckpointError
from ..fileio import atomic_write_text
from ..redact import redact_url
from . import integrity

MARKER = "committed.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d{7,})")
SET_ASIDE = ".corrupt"  # step-N.corrupt: a damaged snapshot moved out of the way, never read
_SET_ASIDE_DIR = re.compile(r"step-\d{7,}\.corrupt(-\d+)?")


def step_dir(step: int) -> str:
    return f"step-{step:07d}"


def root_of(cfg: TrainConfig) -> str:
    """`checkpoint.dir`, or `<run.dir>/checkpoints`."""
    return cfg.checkpoint.dir or str(cfg.run_dir / "checkpoints")


def is_url(path: str) -> bool:
    return "://" in str(path)


@dataclass(frozen=True)
class Snapshot:
    url: str  # the folder, as DCP's checkpoint_id
    step: int
    committed: bool


class Store:
    """The folder that holds the snapshots of one run, through fsspec (a local path too)."""

    def __init__(self, root: str):
        from fsspec.core import url_to_fs
        self.root = str(root).rstrip("/") or "/"
        try:
            self.fs, self.path = url_to_fs(self.root)
        except (ImportError, ValueError) as e:  # e.g. s3:// without s3fs installed
            raise CheckpointError(f"checkpoint.dir={redact_url(self.root)!r} cannot be opened: "
                                  f"{e}; for s3:// install paratrain[s3]") from None
        protocol = self.fs.protocol
        self.local = "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))

    def url(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    def path_of(self, url: str) -> str:
        """`url` as this store's filesystem names it (no protocol)."""
        return self.fs._strip_protocol(url)

    def get_file(self, url: str, name: str, dest: Path) -> bool:
        """Copy file `name` of snapshot `url` to a local path; False when it has none."""
        try:
            self.fs.get_file(f"{self.path_of(url)}/{name}", str(dest))
            return True
        except FileNotFoundError:
            return False

    # ---- reading -------------------------------------------------------------------------
    def snapshots(self) -> list[Snapshot]:
        """Every `step-N` folder, oldest first, committed or not."""
        self.fs.invalidate_cache(self.path)
        try:
            entries = self.fs.ls(self.path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_DIR.fullmatch(name)
            if m and e.get("type") == "directory":
                url = f"{self.root}/{name}"
                out.append(Snapshot(url, int(m.group(1)),
                                    self.fs.exists(f"{self.path_of(url)}/{MARKER}")))
        return sorted(out, key=lambda s: s.step)

    def marker(self, url: str) -> Optional[dict]:
        """The commit marker's content, or None when the snapshot is not committed."""
        try:
            d = json.loads(self.fs.cat_file(f"{self.path_of(url)}/{MARKER}"))
        except (FileNotFoundError, ValueError):
            return None
        return d if isinstance(d, dict) and d.get("format") == FORMAT_VERSION else None

    def file_sizes(self, url: str) -> dict[str, int]:
        base = self.path_of(url).rstrip("/") + "/"
        self.fs.invalidate_cache(self.path_of(url))
        found = self.fs.find(self.path_of(url), detail=True)
        return {k[len(base):]: int(v["size"]) for k, v in found.items()
                if k.startswith(base) and not k.endswith(MARKER)}

    def problem(self, url: str) -> Optional[str]:
        """Why this snapshot cannot be used (None: it is committed and complete). Sizes of every
        file, checksums of the small ones (`.metadata`, tokenizer); the shards' checksums are
        checked at resume by the ranks (snapshotter.py), or by `verify`."""
        marker = self.marker(url)
        if marker is None:
            return "it is not committed (no readable commit marker)"
        have = self.file_sizes(url)
        for name, size in marker.get("files", {}).items():
            if name not in have:
                return f"{name} is missing"
            if have[name] != size:
                return f"{name} has {have[name]} bytes, {size} were written"
        if ".metadata" not in marker.get("files", {}):
            return "it has no DCP .metadata"
        small = {n: c for n, c in (integrity.recorded(marker) or {}).items()
                 if not n.endswith(".distcp")}
        return self.mismatch(url, small)

    def verify(self, url: str) -> tuple[bool, str]:
        """(good, what was found): the marker, every file's size and every checksum, each file
        read once (what `paratrain checkpoint verify` does)."""
        why = self.problem(url)
        if why:
            return False, why
        sums = integrity.recorded(self.marker(url) or {})
        if sums is None:
            return True, ("sizes match; no checksums (written before paratrain recorded them): "
                          "its contents cannot be verified")
        why = self.mismatch(url, sums)
        return (False, why) if why else \
            (True, f"all {len(sums)} files match their {integrity.ALGORITHM} checksums")

    def mismatch(self, url: str, sums: dict[str, str]) -> Optional[str]:
        """The first of these files whose bytes differ from its recorded checksum (None: all
        match)."""
        for name, want in sorted(sums.items()):
            try:
                integrity.check_file(self.fs, f"{self.path_of(url)}/{name}", name, want)
            except integrity.ChecksumMismatch as e:
                return str(e)
        return None

    def usable(self, warn: Callable[[str], None] = warnings.warn
               ) -> Iterator[tuple[Snapshot, dict]]:
        """Committed, complete snapshots, newest first; a committed one that is damaged is
        reported through `warn`, naming it, why it was skipped and what is used instead."""
        skipped: list[tuple[Snapshot, str]] = []

        def report(then: str) -> None:
            for snap, why in skipped:
                warn(f"skipping snapshot {redact_url(snap.url)}: {why}; {then}")
            skipped.clear()
        for snap in reversed(self.snapshots()):
            if not snap.committed:
                continue  # being written, or its writer died: not a snapshot (yet)
            why = self.problem(snap.url)
            if why:
                skipped.append((snap, why))
                continue
            report(f"falling back to {redact_url(snap.url)}")
            yield snap, self.marker(snap.url)  # type: ignore[misc]
        report("no older snapshot to fall back to")

    # ---- writing (global rank 0 only) ----------------------------------------------------
    def commit(self, url: str, marker: dict, written: dict[str, integrity.Written],
               tokenizer_path: Optional[Path] = None) -> None:
        """Write the commit marker, last; before it, nothing in `url` counts. `written`: every
        file DCP's writers wrote (integrity.writer), each of which must be here with the size
        it was written with: a node-local checkpoint.dir shows rank 0 only its own node's."""
        p = self.path_of(url)
        files = dict(written)
        if tokenizer_path is not None and Path(tokenizer_path).is_file():
            for name, f in tokenizer_files(tokenizer_path).items():
                data = Path(f).read_bytes()
                self.fs.pipe_file(f"{p}/{name}", data)
                files[name] = integrity.Written(len(data), integrity.checksum_of(data), 0)
        have = self.file_sizes(url)
        for name, w in sorted(files.items()):
            if name not in have:
                raise CheckpointError(
                    f"{name}, written by rank {w.rank}, is not visible from rank 0 under "
                    f"{redact_url(url)}: checkpoint.dir must be storage that every node sees (a "
                    "shared filesystem, or s3://...); a node-local folder holds only that "
                    "node's shards")
            if have[name] != w.size:
                raise CheckpointError(f"{name} under {redact_url(url)} has {have[name]} bytes, "
                                      f"{w.size} were written")
        marker = {"format": FORMAT_VERSION, **marker,
                  "files": {n: w.size for n, w in sorted(files.items())},
                  "checksums": {"algorithm": integrity.ALGORITHM,
                                "files": {n: w.checksum for n, w in sorted(files.items())}}}
        data = json.dumps(marker, indent=1)
        if self.local:
            atomic_write_text(Path(p) / MARKER, data)
        else:  # one PUT: an object appears whole or not at all
            self.fs.pipe_file(f"{p}/{MARKER}", data.encode())

    def set_aside(self, url: str) -> str:
        """Move a damaged snapshot out of the way (step-N.corrupt: never read again) instead of
        deleting it, since a transient read error must not cost a good snapshot. Returns where."""
        dest, n = url + SET_ASIDE, 1
        while self.fs.exists(self.path_of(dest)):
            n += 1
            dest = f"{url}{SET_ASIDE}-{n}"
        src, dst = self.path_of(url).rstrip("/"), self.path_of(dest)
        if self.local:  # one rename
            self.fs.mv(src, dst, recursive=True)
        else:  # an object store has no folders to rename: each object copied, then removed
            self.fs.invalidate_cache(src)
            for f in self.fs.find(src):
                self.fs.copy(f, dst + f[len(src):])
            self.fs.rm(src, recursive=True)
        self.fs.invalidate_cache(self.path)
        return dest

    def set_aside_folders(self) -> list[str]:
        """The snapshots `set_aside` moved out of the way, as urls."""
        try:
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.path, detail=False)]
        except FileNotFoundError:
            return []
        return [f"{self.root}/{n}" for n in sorted(names) if _SET_ASIDE_DIR.fullmatch(n)]

    def remove(self, url: str) -> None:
        try:
            self.fs.rm(self.path_of(url), recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.path)

    def prune(self, keep_last: int) -> list[str]:
        """Delete all but the newest `keep_last` committed snapshots, and unfinished folders
        older than the newest committed one. Called only right after a commit."""
        snaps = self.snapshots()
        committed = [s for s in snaps if s.committed]
        if not committed:
            return []
        keep = {s.url for s in committed[-keep_last:]}
        newest = committed[-1].step
        gone = [s.url for s in snaps if s.url not in keep and s.step < newest]
        for url in gone:
            self.remove(url)
        return gone


# ---- loading without unpickling ----------------------------------------------------------------
@functools.cache
def _safe_load_planner() -> type:
    """`SafeLoadPlanner`, made on first use: importing DCP takes a second or more, and a launcher
    or a run that never loads a snapshot need not pay it."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's default planner reads non-tensor values (optimizer hyper-parameters) with
        `torch.load(weights_only=False)`, i.e. arbitrary unpickling. Ours allows only what
        torch's weights-only unpickler allows: numbers, strings, tuples, tensors."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def __getattr__(name: str) -> Any:  # `store.SafeLoadPlanner`, made when first asked for
    if name == "SafeLoadPlanner":
        return _safe_load_planner()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def split(path: str) -> tuple[Store, Optional[int]]:
    """A snapshot folder -> (its store, its step); any other folder -> (a store there, None)."""
    path = str(path).rstrip("/")
    parent, _, name = path.rpartition("/")
    m = _STEP_DIR.fullmatch(name)
    if m:
        return Store(parent or "/"), int(m.group(1))
    return Store(path), None


def load_model_weights(path: str, template: dict[str, torch.Tensor], verified: bool = False
                       ) -> dict[str, torch.Tensor]:
    """Fill a plain model's state dict from a committed snapshot, in this one process (DCP
    reshards whatever world size wrote it). Every file is verified first, unless the caller has
    (`verified`: `verify_snapshot` just now)."""
    import torch.distributed.checkpoint as dcp
    store, step = split(path)
    if step is None:
        raise CheckpointError(f"{redact_url(path)!r} is not a snapshot folder (step-NNNNNNN)")
    if not verified:
        verify_snapshot(store.url(step))
    state = {"model": template}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.load(state, checkpoint_id=store.url(step), planner=_safe_load_planner()(),
                 no_dist=True)
    return state["model"]


def verify_snapshot(url: str) -> None:
    """Every file of the snapshot at `url` against its recorded size and checksum, before any
    is used; one CheckpointError line naming the first that differs."""
    store, _ = split(url)
    good, why = store.verify(url)
    if not good:
        raise CheckpointError(f"snapshot {redact_url(url)!r} cannot be used: {why}")


def resolve(path: str) -> str:
    """A snapshot folder as given, or the newest usable snapshot under a checkpoints folder or
    a run dir (its checkpoints/)."""
    store, step = split(path)
    if step is not None:
        return store.url(step)
    for root in (str(path).rstrip("/"), str(path).rstrip("/") + "/checkpoints"):
        found = next(Store(root).usable(), None)
        if found is not None:
            return found[0].url
    raise CheckpointError(f"{redact_url(path)!r} holds no committed snapshot (a step-NNNNNNN folder "
                          f"with {MARKER}); pass a snapshot folder, a checkpoints folder or a "
                          "run dir")


def export_snapshot(path: str, out: str | Path, *, overwrite: bool = False) -> Path:
    """The model weights of a sharded snapshot as one file. OUT ending in .safetensors: that file
    alone; otherwise a model folder (weights, config.json, tokenizer.json) that `paratrain
    generate` and `load_model` read. An OUT already there is replaced only with `overwrite`."""
    from safetensors.torch import save_file

    from ..models import ModelArgs, build_model
    from ..models.files import drop_tied, save_model
    from ..parallel import precision
    from .export_target import check_out, export_target
    out = Path(out)
    as_file = out.suffix == ".safetensors"
    url = resolve(path)
    store, _ = split(url)
    local = Path(store.path_of(url)) if store.local else None
    check_out(out, overwrite=overwrite, file=as_file, source=local)
    marker = store.marker(url)
    if marker is None:
        raise CheckpointError(f"snapshot {redact_url(url)!r} is not committed; nothing to export")
    args = ModelArgs.from_dict(marker["model"])
    model = precision.prepare_model(build_model(args), marker.get("precision") or "fp32")
    weights = load_model_weights(url, model.state_dict())
    with export_target(out, overwrite=overwrite, file=as_file, source=local) as target:
        if as_file:
            tensors = {k: v.contiguous() for k, v in weights.items()}
            save_file(drop_tied(tensors) if args.tie_embeddings else tensors, str(target),
                      metadata={"format": "pt", "producer": "paratrain",
                                "step": str(marker["step"])})
        else:
            with tempfile.TemporaryDirectory() as tmp:
                found = {name for name in TOKENIZER_FILES
                         if store.get_file(url, name, Path(tmp) / name)}
                save_model(target, weights, args.to_dict(),
                           Path(tmp) / TOKENIZER_FILE if TOKENIZER_FILE in found else None)
    return out
