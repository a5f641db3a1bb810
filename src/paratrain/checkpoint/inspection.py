"""What `paratrain checkpoint inspect` and `paratrain checkpoint verify` show: one snapshot
described (tensors, who wrote it, whether its files are verified), the snapshots of a run listed,
and every file of every snapshot checked against its recorded size and checksum."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..redact import redact_url
from . import integrity
from .store import Store, is_url, split


def describe(path: str) -> dict:
    """What `paratrain checkpoint inspect` prints for one snapshot folder: its files are read
    once to verify them; DCP's index (a pickle) is read only from a committed, complete
    snapshot."""
    store, step = split(path)
    if step is None:
        raise CheckpointError(f"{redact_url(path)!r} is not a snapshot folder (step-NNNNNNN)")
    url = store.url(step)
    if not store.fs.exists(store.path_of(url)):
        raise CheckpointError(f"snapshot {redact_url(url)!r} does not exist")
    marker = store.marker(url)
    good, found = store.verify(url)
    sums = integrity.recorded(marker or {})
    out: dict = {"path": redact_url(url), "step": step, "committed": marker is not None,
                 "usable": good, "problem": None if good else found,
                 "verified": good and sums is not None, "verification": found,
                 "files": store.file_sizes(url)}
    if marker:
        out.update({k: marker.get(k) for k in ("world_size", "strategy", "precision", "epoch",
                                               "global_batch", "total_steps", "created")})
    if good:
        meta = _reader(url).read_metadata()  # (.metadata: verified just now)
        tensors = []
        for fqn, md in sorted(meta.state_dict_metadata.items()):
            if hasattr(md, "size"):  # a tensor; otherwise a small value (BytesStorageMetadata)
                dtype = md.properties.dtype
                numel = int(torch.Size(md.size).numel())
                tensors.append({"name": fqn, "shape": list(md.size), "dtype": str(dtype),
                                "bytes": numel * torch.empty((), dtype=dtype).element_size()})
        out["tensors"] = tensors
    return out


def _reader(url: str) -> Any:
    if is_url(url):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        return FsspecReader(url)
    from torch.distributed.checkpoint import FileSystemReader
    return FileSystemReader(url)


def _stores(path: str) -> tuple[Store, list]:
    """The snapshot folders under a checkpoints folder or a run dir (its checkpoints/)."""
    for root in (str(path).rstrip("/"), str(path).rstrip("/") + "/checkpoints"):
        store = Store(root)
        snaps = store.snapshots()
        if snaps:
            return store, snaps
    raise CheckpointError(f"{redact_url(path)!r} holds no snapshot folders (step-NNNNNNN)")


def listing(path: str) -> list[dict]:
    """Every snapshot folder under a checkpoints folder or a run dir, oldest first (sizes and
    the small files checked; `verify` reads the shards too)."""
    store, snaps = _stores(path)
    return [{"path": redact_url(s.url), "step": s.step, "committed": s.committed,
             "problem": store.problem(s.url),
             "checksums": integrity.recorded(store.marker(s.url) or {}) is not None,
             "bytes": sum(store.file_sizes(s.url).values())} for s in snaps]


def format_description(d: dict) -> str:
    state = "committed" if d["committed"] else "NOT committed"
    lines = [f"snapshot {d['path']}",
             f"  step {d['step']}, {state}" + ("" if d["usable"] else f", unusable: {d['problem']}")]
    if d["usable"]:
        lines.append(f"  {'verified' if d['verified'] else 'NOT verified'}: {d['verification']}")
    if d.get("world_size") is not None:
        lines.append(f"  saved by {d['world_size']} worker(s), strategy {d.get('strategy')}, "
                     f"precision {d.get('precision')}, global batch {d.get('global_batch')}, "
                     f"created {d.get('created')}")
    lines.append(f"  files: {len(d['files'])}, {sum(d['files'].values()):,} bytes")
    tensors = d.get("tensors")
    if tensors:
        total = sum(t["bytes"] for t in tensors)
        lines.append(f"  tensors: {len(tensors)}, {total:,} bytes")
        width = max(len(t["name"]) for t in tensors)
        for t in tensors:
            shape = "x".join(str(n) for n in t["shape"]) or "scalar"
            lines.append(f"    {t['name']:<{width}}  {shape:>12}  {t['dtype']:<14} "
                         f"{t['bytes']:>12,}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    path: str
    step: int
    good: bool
    found: str

    def line(self) -> str:
        return f"{self.path}  step {self.step}  {'ok' if self.good else 'BAD'}: {self.found}"


def set_aside(path: str) -> list[str]:
    """The damaged snapshots a resume moved aside (step-N.corrupt) under a checkpoints folder
    or a run dir, and how to clear each: one line each."""
    if split(path)[1] is not None:
        return []
    found = [u for root in (str(path).rstrip("/"), str(path).rstrip("/") + "/checkpoints")
             for u in Store(root).set_aside_folders()]
    return [f"{redact_url(u)}  set aside: a damaged snapshot a resume moved out of the way "
            f"(paratrain never reads it); look into it, then delete it to clear it: "
            f"{'rm -r ' + u if not is_url(u) else 'remove the folder with your storage tool'}"
            for u in found]


def verify(path: str) -> list[Verdict]:
    """`paratrain checkpoint verify PATH`: one snapshot folder, or every snapshot folder under a
    checkpoints folder or a run dir; each file's size and checksum, and the commit marker."""
    store, step = split(path)
    if step is not None:
        if not store.fs.exists(store.path_of(store.url(step))):
            raise CheckpointError(f"snapshot {redact_url(store.url(step))!r} does not exist")
        steps = [step]
    else:
        store, snaps = _stores(path)
        steps = [s.step for s in snaps]
    return [Verdict(redact_url(store.url(s)), s, *store.verify(store.url(s))) for s in steps]
