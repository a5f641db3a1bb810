"""How long the training loop waits per snapshot, synchronous vs asynchronous (DCP async_save),
as a fraction of one step. Writes a markdown table to stdout; the figures go into
docs/benchmarks.md (## Snapshots).

    python benchmarks/snapshot_stall.py [--preset small] [--devices cpu:2] [--steps 16]

Each configuration is one `paratrain train` run with a snapshot every `--every` steps; the stall
is the time `Snapshotter.save` blocks the loop (summary.json: snapshots.mean_stall_s), the step
time the median of the steps without a snapshot (summary.json: step_times_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def run(cwd: Path, name: str, common: list[str], extra: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "paratrain", "train", f"run.name={name}", *common, *extra]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads((cwd / "runs" / name / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--devices", default="cpu:2")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--checkpoint-dir", default=None, help="default: inside the run dir (local)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="snapshot-stall-"))
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    common = [f"model.preset={a.preset}", f"data.source={corpus}", "data.vocab_size=4096",
              f"data.seq_length={a.seq}", f"data.cache_dir={work / 'cache'}",
              f"trainer.devices={a.devices}", f"trainer.batch_size={a.batch}",
              f"trainer.max_steps={a.steps}", "trainer.eval_samples=8",
              "trainer.progress_bar=false", "trainer.log_every=1000", "trainer.eval_every=1000"]
    rows = []
    for mode in ("sync", "async"):
        extra = [f"checkpoint.every_steps={a.every}", f"checkpoint.async_save={mode == 'async'}"]
        if a.checkpoint_dir:
            extra.append(f"checkpoint.dir={a.checkpoint_dir}/{mode}")
        s = run(work, mode, common, extra)
        snap_steps = {i for i in range(a.every, a.steps, a.every)}  # 1-based steps that saved
        plain = [t for i, t in enumerate(s["step_times_s"], start=1)
                 if i not in snap_steps and i > 2]  # skip warm-up
        step = statistics.median(plain)
        stall = s["snapshots"]["mean_stall_s"]
        rows.append((mode, s["snapshots"]["count"], stall, step, stall / step, s["params"]))
    snap = next((work / "runs" / "sync" / "checkpoints").glob("step-*"), None)
    size = sum(p.stat().st_size for p in snap.iterdir()) if snap else 0
    print(f"{a.preset} preset ({rows[0][5] / 1e6:.1f}M parameters), {a.devices}, DDP, fp32, "
          f"seq {a.seq}, batch {a.batch}/device; snapshot {size / 1e6:.0f} MB "
          f"(model + AdamW state), every {a.every} steps\n")
    print("| mode | snapshots | stall per snapshot (s) | step time (s) | stall / step |")
    print("|---|---|---|---|---|")
    for mode, n, stall, step, frac, _ in rows:
        print(f"| {mode} | {n} | {stall:.3f} | {step:.3f} | {frac:.1%} |")


if __name__ == "__main__":
    main()
