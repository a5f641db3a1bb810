"""Several nodes preparing one token cache in a folder they all see (data.cache_dir on a shared
filesystem): the nodes split its chunks, and node 0 publishes the index.

Whether the folder is shared is decided once, before any preparation: node 0 writes a marker
file in data.cache_dir (`mark_or_look`), every other node looks for it, and the launcher
gathers the answers: shared only if every node saw it. Then, in the temp folder of the cache's
fingerprint, named after the job so every node finds the same one:
  node 0   counts the corpus, trains the tokenizer, writes `plan.npz` (the fragments, the split,
           how the corpus was chunked);
  node r   waits for the plan, encodes the chunks k with k % nnodes == r into their shards, and
           delivers each chunk's token counts (`counts-00003.npy`);
  node 0   encodes its own chunks, waits for every chunk's counts (bounded: a missing one names
           its node), writes the offsets and meta.json and renames the folder into place.
Without a shared folder each node prepares its own copy, as one node does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from ..errors import DataError
from ..fileio import atomic_write_json, atomic_write_path

PLAN_FILE = "plan.npz"


@dataclass(frozen=True)
class NodeShare:
    """This node's part in preparing a cache: what the launcher found out, passed down."""
    node_rank: int
    nnodes: int
    job_id: str  # the same on every node of the job: names the shared temp folder
    shared: bool  # every node sees node 0's marker in data.cache_dir
    timeout_s: float = 3600.0  # how long a node waits for another's part
    poll_s: float = 0.2

    @property
    def splits(self) -> bool:
        return self.shared and self.nnodes > 1

    def owner(self, chunk: int) -> int:
        return chunk % self.nnodes

    def mine(self, chunk: int) -> bool:
        return self.owner(chunk) == self.node_rank

    def line(self, cache_root: str | Path) -> str:
        """What the log says about it (node 0's view)."""
        if self.splits:
            return (f"data: prepared by {self.nnodes} nodes in a shared cache {cache_root} "
                    "(each encodes its part of the chunks; node 0 publishes the index)")
        return (f"data: each node prepares its own copy: data.cache_dir={cache_root} is not "
                "shared (node 0's marker file is not seen by every node)")


def marker_path(cache_root: str | Path, job_id: str) -> Path:
    return Path(cache_root) / "data" / ".nodes" / f"{job_id}.json"


def mark_or_look(cache_root: str | Path, node_rank: int, job_id: str) -> bool:
    """Node 0 writes its marker (True); another node says whether it sees it."""
    marker = marker_path(cache_root, job_id)
    if node_rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(marker, {"job": job_id})
        return True
    return marker.is_file()


def forget_marker(cache_root: str | Path, job_id: str) -> None:
    marker_path(cache_root, job_id).unlink(missing_ok=True)


def temp_dir(final: Path, share: NodeShare) -> Path:
    return final.parent / f"{final.name}.tmp-{share.job_id}"


# ---- what node 0 tells the others ----------------------------------------------------------
def write_plan(out: Path, sizes: np.ndarray, ends: np.ndarray, per_chunk: List[int],
               is_val: np.ndarray, chunking: int, budget: Optional[int],
               tokenizer_file: str) -> None:
    """Written last of node 0's first passes: the other nodes start encoding when it appears."""
    with atomic_write_path(out / PLAN_FILE) as tmp, open(tmp, "wb") as f:
        np.savez(f, sizes=sizes, ends=ends, per_chunk=np.asarray(per_chunk, np.int64),
                 is_val=is_val, chunking=chunking, budget=-1 if budget is None else budget,
                 tokenizer_file=np.frombuffer(tokenizer_file.encode(), np.uint8))


def wait_for_plan(out: Path, final: Path, share: NodeShare) -> Optional[dict]:
    """Node 0's plan; None: the cache is published already (no chunk was left for this node)."""
    _wait(lambda: (out / PLAN_FILE).is_file() or (final / "meta.json").is_file(), share,
          f"node 0 did not plan the shared data cache {out}", _node0_gone(out, final))
    if not (out / PLAN_FILE).is_file():
        return None
    with np.load(out / PLAN_FILE, allow_pickle=False) as z:
        plan = {k: z[k] for k in z.files}
    budget = int(plan["budget"])
    return {"sizes": plan["sizes"], "ends": plan["ends"],
            "per_chunk": [int(n) for n in plan["per_chunk"]], "is_val": plan["is_val"],
            "chunking": int(plan["chunking"]), "budget": None if budget < 0 else budget,
            "tokenizer_file": plan["tokenizer_file"].tobytes().decode()}


# ---- each node's part -----------------------------------------------------------------------
def counts_name(chunk: int) -> str:
    return f"counts-{chunk:05d}.npy"


def deliver(out: Path, chunk: int, counts: np.ndarray) -> None:
    """A chunk's fragment token counts, written after its shards: the chunk is done."""
    with atomic_write_path(out / counts_name(chunk)) as tmp, open(tmp, "wb") as f:
        np.save(f, counts)


def collect(out: Path, tokens: List[np.ndarray], share: NodeShare) -> List[np.ndarray]:
    """Node 0: every chunk's counts, the other nodes' read from the files they deliver."""
    missing = [k for k in range(len(tokens)) if not share.mine(k)]

    def arrived() -> bool:
        for r in range(1, share.nnodes):
            report = out / f"failed-{r}.json"
            if report.is_file():
                error = json.loads(report.read_text())["error"]
                raise DataError(f"node {r} failed preparing its part of the shared data cache: "
                                f"{error}")
        while missing and (out / counts_name(missing[0])).is_file():
            k = missing.pop(0)
            tokens[k] = np.load(out / counts_name(k), allow_pickle=False)
        return not missing

    _wait(arrived, share, lambda: f"node {share.owner(missing[0])} did not deliver its part "
                                  f"of the shared data cache (chunk {missing[0]}, in {out})")
    return tokens


def wait_published(final: Path, share: NodeShare) -> None:
    _wait(lambda: (final / "meta.json").is_file(), share,
          f"node 0 did not publish the shared data cache {final}",
          _node0_gone(temp_dir(final, share), final))


def failed(out: Path, share: NodeShare, error: BaseException) -> None:
    """A node's part failed: node 0 stops waiting for it and says why."""
    atomic_write_json(out / f"failed-{share.node_rank}.json", {"error": str(error)})


def _node0_gone(out: Path, final: Path) -> Callable[[], bool]:
    """Node 0 removes the temp folder when it fails (and renames it when done): a folder that
    was there and is gone, with nothing published, means node 0 stopped."""
    seen = [False]

    def gone() -> bool:
        if out.exists():
            seen[0] = True
            return False
        return seen[0] and not (final / "meta.json").is_file()
    return gone


def _wait(done, share: NodeShare, what, stopped=None) -> None:
    deadline = time.monotonic() + share.timeout_s
    while not done():
        if stopped is not None and stopped():
            raise DataError("node 0 stopped preparing the shared data cache (its temp folder "
                            "is gone, nothing was published); see node 0's log")
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise DataError(f"{text} within {share.timeout_s:.0f} s; see that node's log (it "
                            "failed or is slow), or set data.cache_dir to a folder of each "
                            "node's own")
        time.sleep(share.poll_s)
