"""Count the host syncs of every training step of a real run on CUDA, rank by rank.

Run under torchrun (`torchrun --nproc_per_node=N -m tests.gpu._sync_count OUT_PREFIX
key=value ...` from the repository root): each rank runs `Trainer(cfg).fit()` as a user's
torchrun script does, with torch.cuda.set_sync_debug_mode("warn"), which warns at every
synchronizing CUDA call (`.item()`, a device-to-host copy, a stream sync). The warnings between
the start of step k and the start of step k + 1 are step k's: its micro-steps, its optimizer
step and whatever the loop does after it (the log line, the bar, the next step's stop check).
Each rank writes OUT_PREFIX-rank-N.json: {"steps": {step: [the first lines of each sync's
stack, ...]}, "log_steps": [...]}."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

from paratrain import TrainConfig, Trainer
from paratrain.runtime import loop as loop_module


def _where() -> str:
    """The innermost paratrain / model frames of the sync: what made it."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if "paratrain" in f.filename or "torch/nn" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                       for f in reversed(frames[-4:]))


def main(argv: list[str]) -> None:
    out_prefix, overrides = argv[0], argv[1:]
    cfg = TrainConfig.from_yaml(None, overrides)
    syncs: list[str] = []  # one entry per synchronizing call, in order
    starts: list[tuple[int, int]] = []  # (step about to run, syncs so far)
    original = loop_module.TrainLoop._step

    def counted_step(self, batches, out):
        starts.append((self.state.step + 1, len(syncs)))
        return original(self, batches, out)

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):
            syncs.append(_where())

    loop_module.TrainLoop._step = counted_step
    warnings.showwarning = note
    warnings.simplefilter("always")
    on_gpu = torch.cuda.is_available()  # (on a CPU the plumbing runs, and counts nothing)
    if on_gpu:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        Trainer(cfg).fit()
    finally:
        if on_gpu:
            torch.cuda.set_sync_debug_mode("default")
    ends = [n for _, n in starts[1:]] + [len(syncs)]
    steps = {step: syncs[begin:end] for (step, begin), end in zip(starts, ends)}
    tr = cfg.trainer
    total = max(steps)
    log_steps = [s for s in steps if s % tr.log_every == 0 or s % tr.eval_every == 0
                 or s == total]
    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out_prefix}-rank-{rank}.json", "w") as f:
        json.dump({"steps": steps, "log_steps": log_steps}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
