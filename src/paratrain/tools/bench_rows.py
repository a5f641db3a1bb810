"""`paratrain bench`'s rows: a variant's runs turned into one row (medians and spread of the
timed steps, CPU per step, memory per device, MFU on a known GPU), the table printed, and the
chart drawn. Kept apart from the runs themselves (bench.py) because it reads only their results.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

import torch

# Dense bf16 tensor-core peak per GPU (FLOP/s), from the vendors' data sheets; the first name
# found in torch.cuda.get_device_name() wins, so longer names come first.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
              ("L4", 121e12), ("A10", 125e12), ("4090", 165e12), ("3090", 71e12),
              ("V100", 125e12), ("T4", 65e12))



def summarize(v: Any, runs: list[dict], warmup: int, flops_per_token: float,
              peak_flops: Optional[float], on_gpu: bool) -> dict:
    """Median and spread of the post-warm-up step times pooled over repeats, and the rest, of
    the bench.Variant `v` (its label, world size and ideal bubble)."""
    times = sorted(t for r in runs for t in r["step_times_s"][warmup:])
    med = statistics.median(times)
    p10, p90 = _quantile(times, 0.1), _quantile(times, 0.9)
    tokens = runs[0]["tokens_per_step"]
    peaks = [max(r["memory"][i]["peak_bytes"] for r in runs)
             for i in range(len(runs[0]["memory"]))]
    waits = [r["data_wait_s"] / r["train_s"] for r in runs
             if r["data_wait_s"] is not None and r["train_s"]]
    tps = tokens / med
    cpu = [c for r in runs for c in (r.get("step_cpu_s") or [])[warmup:]]
    mfu = None
    if on_gpu and peak_flops:
        mfu = flops_per_token * tps / (v.world * peak_flops)
    return {"label": v.label, "strategy": runs[0]["strategy"], "world_size": v.world,
            "runs": len(runs), "timed_steps": len(times),
            "steps_per_s": 1.0 / med, "tokens_per_s": tps,
            "step_time_median_s": med, "step_time_p10_s": p10, "step_time_p90_s": p90,
            "step_time_spread": (p90 - p10) / med,
            # CPU seconds rank 0's process spent per step (all its threads): the work a loop
            # does, which other jobs on a shared machine disturb far less than the wall time
            "step_cpu_median_s": statistics.median(cpu) if cpu else None,
            "first_step_s": statistics.median(r["step_times_s"][0] for r in runs),
            "data_wait_fraction": statistics.median(waits) if waits else None,
            "peak_bytes_per_device": peaks,
            "memory_imbalance": max(peaks) / max(1, min(peaks)),
            "mfu": mfu, "final_loss": runs[-1]["final_loss"], "ideal_bubble": v.ideal_bubble}


def paired_ratios(rows: dict[str, list[dict]], ref: str, warmup: int) -> dict[str, list[float]]:
    """Each row's speed over the reference's, repeat by repeat: the runs of one repeat ran next
    to each other (A B A B ...), so a pair shares the machine's load of its minutes, which the
    pooled medians of a busy machine do not. A ratio is the reference's median step time over
    the row's (above 1: the row is faster)."""
    base = [statistics.median(r["step_times_s"][warmup:]) for r in rows[ref]]
    return {label: [b / statistics.median(r["step_times_s"][warmup:])
                    for b, r in zip(base, runs)] for label, runs in rows.items()}


def _quantile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    pos = q * (len(sorted_xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def gpu_peak_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((f for key, f in PEAK_FLOPS if key in name), None)


def format_table(rows: list[dict], ref_label: Optional[str]) -> str:
    w = max([10] + [len(r["label"]) for r in rows])
    head = (f"{'row':<{w}} {'world':>5} {'steps/s':>8} {'tokens/s':>9} {'step ms':>8} "
            f"{'spread':>7} {'cpu ms':>7} {'1st step s':>10} {'peak MB/dev':>11} "
            f"{'max/min':>7} {'MFU':>6} {'vs ' + (ref_label or 'plain'):>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        ratio = f"{r['vs_plain']:.3f}" if r.get("vs_plain") is not None else "-"
        cpu = f"{1e3 * r['step_cpu_median_s']:.0f}" if r.get("step_cpu_median_s") else "-"
        lines.append(
            f"{r['label']:<{w}} {r['world_size']:>5} {r['steps_per_s']:>8.3f} "
            f"{r['tokens_per_s']:>9.0f} {1e3 * r['step_time_median_s']:>8.1f} "
            f"{'±' + format(50 * r['step_time_spread'], '.1f') + '%':>7} {cpu:>7} "
            f"{r['first_step_s']:>10.2f} {max(r['peak_bytes_per_device']) / 2**20:>11.0f} "
            f"{r['memory_imbalance']:>7.2f} {mfu:>6} {ratio:>9}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> Optional[str]:
    """A PNG bar chart of tokens/s and peak memory per device; None (and a note) without
    matplotlib, which is an optional dependency (`pip install paratrain[bench]`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'paratrain[bench]'): no PNG written"
    labels = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 0.6 * len(rows) + 1.8))
    bars = ax1.barh(labels, [r["tokens_per_s"] for r in rows], color="tab:blue")
    for bar, r in zip(bars, rows):
        if r.get("vs_plain") is not None:
            ax1.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                     f" {r['vs_plain']:.2f}x", va="center", fontsize=8)
    ax1.set_xlabel("tokens/s (median step, after warm-up)")
    ax1.invert_yaxis()
    ax2.barh(labels, [max(r["peak_bytes_per_device"]) / 2**20 for r in rows], color="tab:orange")
    ax2.set_xlabel("peak memory per device, MB (max over devices)")
    ax2.invert_yaxis()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
