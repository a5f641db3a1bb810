"""Training throughput on one GPU: paratrain against a plain PyTorch loop, same model, same batch,
same process.

For each preset (Llama `large`, ~350M, and `1b`, ~1.1B, at vocabulary 32000) and each mode
(eager, `trainer.compile`), in bf16-mixed on one GPU, it runs paratrain's `Trainer.fit()` and then
the hand-written loop `paratrain bench` compares with (paratrain/tools/plain_ddp.py, one process:
AdamW fused, autocast, the same per-block compile) on the same config. A run's speed is the
median step after the warm-up steps (compilation lands in those). It reports tokens/s, MFU
(model FLOPs per token, models.flops_per_token, x tokens/s over the GPU's dense bf16 peak: 989
TFLOP/s for H100/H200) and peak memory (torch.cuda.max_memory_allocated, reset before each run),
and checks the targets: paratrain >= 0.98x the plain loop's tokens/s in every row, MFU >= 45% for
the 1b preset compiled.

    python benchmarks/gpu_throughput.py --out OUTDIR            # on a GPU: a few minutes
    python benchmarks/gpu_throughput.py --out OUTDIR --smoke    # anywhere: tiny, CPU, 2 steps

Writes OUTDIR/gpu_throughput.json; the runs themselves go to a temporary folder.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from paratrain.fileio import atomic_write_json

PEAK_BF16_FLOPS = 989e12  # H100 / H200 SXM, dense bf16
TARGET_RATIO = 0.98  # paratrain tokens/s over the plain loop's
TARGET_MFU_1B_COMPILED = 0.45

# per preset: the batch (per step: batch_size x seq_length tokens, no accumulation)
SHAPES = {"large": {"trainer.batch_size": 8, "data.seq_length": 2048},
           "1b": {"trainer.batch_size": 8, "data.seq_length": 2048}}
SMOKE_SHAPES = {"tiny": {"trainer.batch_size": 4, "data.seq_length": 64}}


def base_overrides(preset: str, shape: dict, *, smoke: bool, compiled: bool,
                   steps: int, corpus: str, cache: Path) -> list[str]:
    over = {"model.preset": preset, "model.vocab_size": 512 if smoke else 32000,
            "data.source": corpus, "data.vocab_size": 384 if smoke else 4096,
            "data.cache_dir": str(cache), "trainer.devices": "cpu" if smoke else "cuda:0",
            "trainer.precision": "fp32" if smoke else "bf16-mixed",
            "trainer.compile": str(compiled).lower(), "trainer.max_steps": steps,
            "trainer.global_batch_size": "null", "trainer.log_every": 1,
            "trainer.eval_every": steps + 1, "trainer.eval_samples": 1,
            "trainer.progress_bar": "false", "checkpoint.every_steps": 0,
            "checkpoint.resume": "never", **shape}
    return [f"{k}={v}" for k, v in over.items()]


def fresh_device(device: torch.device) -> None:
    """Free what the last run left and start the peak-memory counter again."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_paratrain(overrides: list[str], run_dir: Path, device: torch.device) -> dict:
    from paratrain import TrainConfig, Trainer
    fresh_device(device)
    cfg = TrainConfig.from_yaml(None, overrides + [f"run.dir={run_dir}", "run.overwrite=true"])
    Trainer(cfg).fit()
    s = json.loads((run_dir / "summary.json").read_text())
    return {"step_times_s": s["step_times_s"], "peak_bytes": s["memory"][0]["peak_bytes"],
            "tokens_per_step": s["global_batch_size"] * s["seq_length"]}


def run_plain(overrides: list[str], out: Path, device: torch.device) -> dict:
    from paratrain.tools import plain_ddp
    fresh_device(device)
    plain_ddp.main(overrides + ["--out", str(out)])
    p = json.loads(out.read_text())
    return {"step_times_s": p["step_times_s"], "peak_bytes": p["memory"][0]["peak_bytes"],
            "tokens_per_step": p["global_batch_size"] * p["seq_length"]}


def figures(r: dict, warmup: int, flops_per_token: float, peak_flops: float | None) -> dict:
    med = statistics.median(r["step_times_s"][warmup:])
    tps = r["tokens_per_step"] / med
    return {"tokens_per_s": tps, "step_time_median_s": med,
            "first_step_s": r["step_times_s"][0],
            "mfu": flops_per_token * tps / peak_flops if peak_flops else None,
            "peak_bytes": r["peak_bytes"]}


def model_shape(overrides: list[str]) -> tuple[int, float]:
    """(parameters, training FLOPs per token) of the config's model."""
    from paratrain import TrainConfig
    from paratrain.models import build_model, count_params, flops_per_token, resolve_model_config
    cfg = TrainConfig.from_yaml(None, overrides)
    args = resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size,
                                seq_length=cfg.data.seq_length)
    with torch.device("meta"):
        n = count_params(build_model(args))
    return n, flops_per_token(args, cfg.data.seq_length)


def bench_row(preset: str, shape: dict, compiled: bool, ns: argparse.Namespace, work: Path,
              device: torch.device, peak_flops: float | None) -> dict:
    steps = ns.warmup + ns.steps
    over = base_overrides(preset, shape, smoke=ns.smoke, compiled=compiled, steps=steps,
                          corpus=ns.corpus, cache=work / "cache")
    n_params, fpt = model_shape(over)
    name = f"{preset}-{'compiled' if compiled else 'eager'}"
    if compiled:
        torch._dynamo.reset()  # each preset compiles its own static shapes
    t0 = time.perf_counter()
    ours = figures(run_paratrain(over, work / name, device), ns.warmup, fpt, peak_flops)
    plain = figures(run_plain(over, work / f"{name}-plain.json", device), ns.warmup, fpt,
                    peak_flops)
    row = {"preset": preset, "mode": "compiled" if compiled else "eager", "params": n_params,
           "batch": shape["trainer.batch_size"], "seq_length": shape["data.seq_length"],
           "flops_per_token": fpt, "paratrain": ours, "plain": plain,
           "ratio": ours["tokens_per_s"] / plain["tokens_per_s"],
           "wall_s": time.perf_counter() - t0}
    print(f"[gpu_throughput] {name}: paratrain {ours['tokens_per_s']:.0f} tok/s, plain "
          f"{plain['tokens_per_s']:.0f} tok/s, ratio {row['ratio']:.3f}, MFU "
          f"{_pct(ours['mfu'])}, peak {ours['peak_bytes'] / 2**30:.1f} GiB "
          f"({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return row


def targets(rows: list[dict], smoke: bool) -> dict:
    ratio_ok = all(r["ratio"] >= TARGET_RATIO for r in rows)
    big = [r for r in rows if r["preset"] == "1b" and r["mode"] == "compiled"]
    mfu = big[0]["paratrain"]["mfu"] if big else None
    return {"ratio_min": TARGET_RATIO, "ratio_met": None if smoke else ratio_ok,
            "mfu_1b_compiled_min": TARGET_MFU_1B_COMPILED, "mfu_1b_compiled": mfu,
            "mfu_met": None if mfu is None else mfu >= TARGET_MFU_1B_COMPILED}


def format_table(rows: list[dict]) -> str:
    head = (f"{'preset':<8} {'mode':<9} {'params':>7} {'tok/s':>9} {'plain tok/s':>11} "
            f"{'ratio':>6} {'MFU':>6} {'plain MFU':>9} {'peak GiB':>8} {'plain GiB':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        a, b = r["paratrain"], r["plain"]
        lines.append(f"{r['preset']:<8} {r['mode']:<9} {r['params'] / 1e6:>6.0f}M "
                     f"{a['tokens_per_s']:>9.0f} {b['tokens_per_s']:>11.0f} {r['ratio']:>6.3f} "
                     f"{_pct(a['mfu']):>6} {_pct(b['mfu']):>9} {a['peak_bytes'] / 2**30:>8.2f} "
                     f"{b['peak_bytes'] / 2**30:>9.2f}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gpu_throughput.json")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny preset on the CPU, eager, 2 steps: checks the script runs")
    ap.add_argument("--presets", default=None, help="comma-separated (default: large,1b)")
    ap.add_argument("--modes", default=None, help="eager,compiled (default: both; smoke: eager)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; smoke 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3; smoke 1)")
    ap.add_argument("--corpus", default=None,
                    help="data.source (default: the standard library's top-level modules, "
                         "~4.7 MB of real text; smoke: its email package)")
    ap.add_argument("--work", default=None, help="where the runs go (default: a temp folder)")
    ns = ap.parse_args(argv)
    known = {**SHAPES, **SMOKE_SHAPES}
    shapes = SMOKE_SHAPES if ns.smoke else SHAPES
    if ns.presets:
        unknown = [p for p in ns.presets.split(",") if p not in known]
        if unknown:
            ap.error(f"--presets {','.join(unknown)}: choose from {','.join(known)}")
        shapes = {p: known[p] for p in ns.presets.split(",")}
    modes = (ns.modes or ("eager" if ns.smoke else "eager,compiled")).split(",")
    ns.steps = ns.steps or (1 if ns.smoke else 10)
    ns.warmup = ns.warmup or (1 if ns.smoke else 3)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ns.corpus = ns.corpus or str(stdlib / "email" if ns.smoke else stdlib / "*.py")
    if not ns.smoke and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA GPU visible; use --smoke to check the script on a CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu") if ns.smoke else torch.device("cuda", 0)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor()
    peak = PEAK_BF16_FLOPS if device.type == "cuda" else None
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "peak_flops": peak, "smoke": ns.smoke,
              "steps": ns.steps, "warmup": ns.warmup, "corpus": ns.corpus}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-", dir=ns.work) as tmp:
        for p, shape in shapes.items():
            for mode in modes:
                rows.append(bench_row(p, shape, mode == "compiled", ns, Path(tmp), device, peak))
                # after every row: a run cut short by its time limit keeps the rows it finished
                report.update(rows=rows, targets=targets(rows, ns.smoke),
                              table=format_table(rows))
                atomic_write_json(out / "gpu_throughput.json", report)
    print(report["table"])
    print(f"targets: {json.dumps(report['targets'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
