"""report.png: the curves of a run on one page, for people who would rather look than read JSONL.

Four panels from what the run dir already holds: train and validation loss (metrics.jsonl),
tokens/s, learning rate, and memory per rank (summary.json, written when the run ends; a
running run shows 'running' there). Drawn from files only, so `paratrain report RUN_DIR` redraws
it for any run, finished or still going, without importing torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from ..errors import ParatrainError
from ..fileio import atomic_write_path

REPORT = "report.png"
PNG_KEY = "paratrain"  # report.png's text chunk: JSON of the validation points it draws
# summary.json memory keys -> bar labels, in the order a reader adds them up
MEMORY_BARS = (("params_bytes", "params"), ("grads_bytes", "grads"),
               ("optimizer_bytes", "optimizer"), ("activation_bytes", "activations"),
               ("peak_bytes", "peak"))


def read_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl, skipping a half-written last line of a running run."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_summary(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where `key` holds a number (metrics.jsonl writes NaN/inf as null)."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(run_dir: str | os.PathLike, out: Optional[str | os.PathLike] = None) -> Path:
    """Draw <run_dir>/report.png (or `out`) and return its path. Atomic: temp file, rename."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ParatrainError(f"run dir {str(run_dir)!r} does not exist; pass a run dir such as "
                             "runs/<run.name>")
    if not (run_dir / "metrics.jsonl").is_file():
        raise ParatrainError(f"{str(run_dir)!r} holds no metrics.jsonl: not a run dir, or a "
                             "run that has not logged its first step yet")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display, no GUI toolkit
        import matplotlib.pyplot as plt
    except ImportError:
        raise ParatrainError("drawing report.png needs matplotlib; pip install "
                             "'paratrain[report]' (or pip install matplotlib)") from None

    rows = read_records(run_dir)
    summary = read_summary(run_dir)
    validation = validation_points(rows, summary)
    # Fixed margins: a layout engine (constrained) costs more than drawing the page (0.5 s of
    # a run's last second), and this page's panels never change shape.
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.91, wspace=0.2, hspace=0.3)
    try:
        fig.suptitle(_title(run_dir, rows, summary), fontsize=12)
        _loss_panel(axes[0, 0], rows, validation, final=summary is not None
                    and isinstance(summary.get("val_loss"), (int, float)))
        _line_panel(axes[0, 1], rows, "tokens_per_s", "throughput", "tokens / s", "tab:green")
        _line_panel(axes[1, 0], rows, "lr", "learning rate", "learning rate", "tab:purple")
        _memory_panel(axes[1, 1], summary)
        target = Path(out) if out is not None else run_dir / REPORT
        # the validation points drawn, also as a PNG text chunk (`PNG_KEY`): checkable
        meta = {PNG_KEY: json.dumps({"validation": validation})}
        with atomic_write_path(target) as tmp:
            fig.savefig(tmp, format="png", dpi=100, metadata=meta)
    finally:
        plt.close(fig)
    return target


def _title(run_dir: Path, rows: list[dict], summary: Optional[dict]) -> str:
    if summary is None:
        last = rows[-1]["step"] if rows else 0
        return f"{run_dir.name}: running (step {last})"
    parts = [f"{run_dir.name}: {summary.get('steps')} steps",
             f"{summary.get('world_size')} worker(s), {summary.get('strategy')}, "
             f"{summary.get('precision')}"]
    if summary.get("final_loss") is not None:
        parts.append(f"final loss {summary['final_loss']:.3f}")
    if summary.get("val_loss") is not None:
        parts.append(f"val loss {summary['val_loss']:.3f}")
    return " | ".join(parts)


def validation_points(rows: list[dict], summary: Optional[dict]) -> list[list[float]]:
    """[step, validation loss] as the loss panel draws them: each evaluation during the run
    (metrics.jsonl), then the final one (summary.json) at the last step."""
    steps, values = _series(rows, "val_loss")
    points = [[s, v] for s, v in zip(steps, values)]
    final = (summary or {}).get("val_loss")
    if isinstance(final, (int, float)):
        last = summary.get("steps") or (rows[-1]["step"] if rows else 0)  # type: ignore
        points.append([last, final])
    return points


def _loss_panel(ax, rows: list[dict], validation: list[list[float]], final: bool) -> None:
    steps, loss = _series(rows, "loss")
    ax.plot(steps, loss, color="tab:blue", label="train loss")
    vsteps = [p[0] for p in validation]
    if vsteps:
        ax.plot(vsteps, [p[1] for p in validation], "o-", color="tab:orange",
                label="validation loss")
    if final:  # the final validation loss: a point of its own, with its value
        s, v = validation[-1]
        ax.plot([s], [v], "*", color="tab:red", markersize=14, zorder=3,
                label=f"final validation loss {v:.3f}")
        ax.annotate(f"{v:.3f}", (s, v), textcoords="offset points", xytext=(-10, -4),
                    ha="right", va="top", color="tab:red")
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats / token)")
    ax.grid(alpha=0.3)
    if steps or vsteps:
        ax.legend()
    else:
        _note(ax, "no loss logged yet")


def _line_panel(ax, rows: list[dict], key: str, title: str, ylabel: str, color: str) -> None:
    steps, values = _series(rows, key)
    ax.plot(steps, values, color=color, label=ylabel)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    if not steps:
        _note(ax, f"no {title} logged yet")


def _memory_panel(ax, summary: Optional[dict]) -> None:
    """Grouped bars: one group per rank, one bar per kind of memory, in MiB."""
    ax.set(title="memory per rank", ylabel="MiB")
    memory = (summary or {}).get("memory") or []
    if not memory:
        ax.set_xticks([])
        _note(ax, "running: memory per rank appears when the run ends" if summary is None
              else "no memory figures in summary.json")
        return
    width = 0.8 / len(MEMORY_BARS)
    heights = []
    for i, (key, label) in enumerate(MEMORY_BARS):
        xs = [r + (i - (len(MEMORY_BARS) - 1) / 2) * width for r in range(len(memory))]
        mib = [(m.get(key) or 0) / 2**20 for m in memory]
        heights += [h for h in mib if h > 0]
        if key == "peak_bytes" and all(str(m.get("device", "")).startswith("cpu")
                                       for m in memory):
            label = "peak (process RSS)"
        bars = ax.bar(xs, mib, width, label=label)
        if len(memory) <= 4:  # room for the figures themselves
            ax.bar_label(bars, fmt="%.3g", fontsize="x-small", padding=1)
    # On a CPU, peak is the process's resident set (interpreter and libraries included), which
    # dwarfs a small model's state: a log scale keeps every bar visible.
    if heights and max(heights) / min(heights) > 50:
        ax.set_yscale("log")
        ax.set_ylabel("MiB (log scale)")
    ax.set_xticks(range(len(memory)),
                  [f"rank {m['rank']}\n{m.get('device', '')}" for m in memory])
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncols=len(MEMORY_BARS) if len(memory) > 2 else 1)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
