"""Tensor parallelism against the layouts it must equal: losses, final weights, state per rank
and the time per step, on CPU processes (gloo).

    python benchmarks/tensor_parallel.py [--steps 16] [key=value ...]

Runs, in a scratch directory, the same `paratrain train` (tiny Llama on the standard library's
email package, seq 32, global batch 8, fp32) as one process, TP=2 on 2 processes, DDP on 4, and
FSDP x TP (2 x 2) on 4, then prints a markdown table: the largest loss and final-weight
difference against the reference of the same world (one process for TP=2, DDP for FSDP x TP),
parameter + gradient + AdamW bytes of rank 0, and the median step time and CPU time per step of
rank 0 after 5 warm-up steps. Extra key=value overrides go to every run (e.g. model.arch=gpt).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

LAYOUTS = {  # name: (overrides, the run it must equal)
    "one process": (["trainer.devices=cpu:1"], None),
    "tp2 on 2 processes": (["trainer.devices=cpu:2", "trainer.tensor_parallel=2"],
                           "one process"),
    "ddp on 4": (["trainer.devices=cpu:4", "trainer.batch_size=2", "trainer.strategy=ddp"],
                 None),
    "fsdp x tp (2 x 2) on 4": (["trainer.devices=cpu:4", "trainer.batch_size=2",
                                "trainer.strategy=fsdp", "trainer.tensor_parallel=2"],
                               "ddp on 4"),
}


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(run / "model" / "model.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    work = Path(tempfile.mkdtemp(prefix="tensor-parallel-"))
    base = ["train", "model.preset=tiny", f"data.source={corpus}", "data.vocab_size=384",
            "data.seq_length=32", f"data.cache_dir={work / 'cache'}", "trainer.batch_size=4",
            "trainer.global_batch_size=8", f"trainer.max_steps={a.steps}",
            "trainer.log_every=1", "trainer.eval_every=100000", "trainer.eval_samples=16",
            "trainer.progress_bar=false", "optim.warmup_steps=2", "log.report=false",
            "log.tensorboard=false", *a.overrides]
    runs = {}
    for i, (name, (layout, _)) in enumerate(LAYOUTS.items()):
        subprocess.run([sys.executable, "-m", "paratrain"] + base + layout + [f"run.name=r{i}"],
                       cwd=work, check=True, capture_output=True)
        runs[name] = work / "runs" / f"r{i}"
    print("| layout | max loss diff | max weight diff | state bytes, rank 0 | s/step | "
          "CPU s/step |")
    print("|---|---|---|---|---|---|")
    for name, (_, ref) in LAYOUTS.items():
        run = runs[name]
        summary = json.loads((run / "summary.json").read_text())
        mem = summary["memory"][0]
        state = mem["params_bytes"] + mem["grads_bytes"] + mem["optimizer_bytes"]
        loss_diff = weight_diff = "-"
        if ref is not None:
            mine = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").open()]
            theirs = [json.loads(x)["loss"] for x in (runs[ref] / "metrics.jsonl").open()]
            loss_diff = f"{max(abs(x - y) for x, y in zip(mine, theirs)):.1e}"
            w, v = _weights(run), _weights(runs[ref])
            weight_diff = f"{max((w[k] - v[k]).abs().max().item() for k in v):.1e}"
        step = statistics.median(summary["step_times_s"][5:])
        cpu = statistics.median(summary["step_cpu_s"][5:])
        print(f"| {name} | {loss_diff} | {weight_diff} | {state:,} | {step:.3f} | {cpu:.3f} |")


if __name__ == "__main__":
    main()
