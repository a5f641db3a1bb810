"""DPO with `dpo.precompute_reference=true`: the reference model's log-probabilities of every pair,
computed once before training and cached with the data, so that no reference model is held (or
run) while the policy trains.

The cache is keyed by what the numbers depend on: the reference model's files (config.json and
weights, by their bytes; the seed for a folder without weights), the encoded pairs and the
format's version. The first process to prepare the run computes it (node 0's calling process
before any worker starts, so the workers only read it) in float32 on its device, one batch of
trainer.batch_size pairs at a time, and writes it atomically; a run with the same model and data
reads it back (a .npy file, loaded without pickle).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...fileio import atomic_write_path

CACHE_VERSION = 1
_CHUNK = 1 << 20


def attach_reference(task: Any, env: Any, log: Callable[[str], None]) -> None:
    """Add the column "reference" (N, 2: chosen, rejected) to the task's datasets."""
    cfg = task.cfg
    folder = Path(str(cfg.dpo.reference or cfg.model.path)).expanduser()
    model_key = _model_key(folder, cfg.trainer.seed)
    model = None
    for ds in (task.train_ds, task.val_ds):
        if ds is None:
            continue
        path = cfg.cache_dir / "dpo-reference" / f"{_pairs_key(ds, model_key)}.npy"
        if path.is_file():
            ds.add("reference", np.load(path, allow_pickle=False))
            log(f"reference log-probs of {len(ds)} pairs read from {path}")
            continue
        if model is None:
            model = task.build_reference(str(folder)).to(env.device).eval()
        t0 = time.perf_counter()
        values = _logps(task, model, ds, cfg.trainer.batch_size, env.device)  # (N, 2)
        with atomic_write_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, values, allow_pickle=False)
        ds.add("reference", values)
        log(f"reference log-probs of {len(ds)} pairs computed in "
            f"{time.perf_counter() - t0:.1f} s and cached in {path}")


@torch.no_grad()
def _logps(task: Any, model: torch.nn.Module, ds: Any, batch_size: int,
           device: torch.device) -> np.ndarray:
    from ..base import sequence_logps, to_device
    out = []
    for start in range(0, len(ds), batch_size):
        batch = task.collate([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
        logps = sequence_logps(model, to_device(batch, device), contextlib.nullcontext())
        B = logps.shape[0] // 2  # (2B,): chosen rows, then rejected
        out.append(torch.stack([logps[:B], logps[B:]], dim=1).double().cpu().numpy())  # (B, 2)
    return np.concatenate(out)  # (N, 2)


def _model_key(folder: Path, seed: int) -> str:
    """The model's files by their bytes (the seed too when there are no weights)."""
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    files = sorted(p for p in folder.iterdir() if p.name == "config.json"
                   or p.name.endswith((".safetensors", ".safetensors.index.json")))
    for p in files:
        h.update(p.name.encode())
        with open(p, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    if not any(p.name.endswith(".safetensors") for p in files):
        h.update(json.dumps({"seed": seed}).encode())
    return h.hexdigest()


def _pairs_key(ds: Any, model_key: str) -> str:
    """The model's key and every encoded token of the pairs."""
    h = hashlib.sha256(model_key.encode())
    for name in sorted(ds.sequences):
        column = ds.sequences[name]
        h.update(name.encode() + column.tokens.tobytes() + column.offsets.tobytes())
    h.update(ds.numbers["prompt_len"].tobytes())
    return h.hexdigest()[:24]
