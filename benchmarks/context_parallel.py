"""Context parallelism's memory: activations per worker at CP=1, 2, 4 on one long sequence, and
what `paratrain plan` predicted for each, on CPU processes (gloo).

    python benchmarks/context_parallel.py [--seq 8192] [--steps 2] [key=value ...]

Runs, in a scratch directory, `paratrain train` (the small Llama preset on the standard library's
email package, one sequence of --seq tokens per step, fp32) on 1, 2 and 4 processes with
trainer.context_parallel equal to the processes, and `paratrain plan --json` for the same layout
(plan.nodes=1, plan.devices_per_node=C). Prints a markdown table: the bytes autograd saved for
backward in rank 0's first micro-step (summary.json's activation_bytes, the meter the loop uses),
its ratio to CP=1, the plan's activations for the asked row and their error against the
measurement, rank 0's peak resident memory (the whole process: Python and torch included) and
the final loss (the same at every C, to fp32 rounding). Extra key=value overrides go to every
run and plan (e.g. model.arch=gpt).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

DEGREES = (1, 2, 4)


def _run(args: list[str], cwd: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "paratrain", *args], cwd=cwd, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    return r.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    work = Path(tempfile.mkdtemp(prefix="context-parallel-"))
    base = ["model.preset=small", f"data.source={corpus}", "data.vocab_size=512",
            f"data.seq_length={a.seq}", f"data.cache_dir={work / 'cache'}",
            "trainer.batch_size=1", "trainer.global_batch_size=1", *a.overrides]
    rows = []
    for cp in DEGREES:
        layout = [f"trainer.devices=cpu:{cp}", f"trainer.context_parallel={cp}"]
        _run(["train", *base, *layout, f"trainer.max_steps={a.steps}", "trainer.log_every=1",
              "trainer.eval_every=100000", "trainer.eval_samples=1", "trainer.progress_bar=false",
              "log.report=false", "log.tensorboard=false", f"run.name=cp{cp}"], work)
        summary = json.loads((work / "runs" / f"cp{cp}" / "summary.json").read_text())
        plan = json.loads(_run(["plan", "--json", *base, *layout, "plan.nodes=1",
                                f"plan.devices_per_node={cp}", "plan.device_memory_gb=64"],
                               work))
        [asked] = [r for r in plan["rows"] if r["asked"]]
        rank0 = summary["memory"][0]
        rows.append((cp, rank0["activation_bytes"], asked["activation_bytes"],
                     rank0["peak_bytes"], summary["final_loss"]))
    one = rows[0][1]
    print("| CP | activations, rank 0 (measured) | vs CP=1 | plan's activations | plan's error "
          "| peak RSS, rank 0 | final loss |")
    print("|---|---|---|---|---|---|---|")
    for cp, measured, planned, peak, loss in rows:
        print(f"| {cp} | {measured:,} | {measured / one:.3f} | {planned:,} | "
              f"{(planned - measured) / measured:+.1%} | {peak / 2 ** 20:,.0f} MiB | {loss:.6f} |")


if __name__ == "__main__":
    main()
