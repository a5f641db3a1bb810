"""Packed vs padded fine-tuning: one epoch of input->output pairs with realistic lengths on 2 CPU
workers, the tiny Hugging Face Llama (hidden 64, 2 layers, 2,048 positions), wall time and the
held-out loss of each.

    python benchmarks/packing.py [--out /tmp/packing-bench] [--examples 1000] [--rounds 2]

The data is built from local text: the standard library's source files, tokenized into one
stream; example lengths are drawn log-normal (median 300 tokens, sigma 0.9, cut to 24..2,048),
each example the next that many tokens of the stream (the first tenth, at least 8 tokens, its
input, the rest its output). The machine may be shared: the runs are interleaved (padded,
packed, padded, packed, ...) and the load average is printed before and after each, so the
ratio compares like with like. Padded: 10 examples per device (20 a step, 50 steps); packed: 2
rows of 2,048 tokens per device (5 examples a row on average, so about 20 a step, 50 steps): the
same examples per step and the same learning rate, one epoch each; the held-out loss is the
final validation loss on the same 100 held-out pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dpo import make_model  # the benchmarks' local base model (this folder)

COMMON = ["model.arch=hf", "data.format=pairs", "data.max_length=2048", "trainer.devices=cpu:2",
          "trainer.max_steps=null", "trainer.epochs=1", "trainer.eval_every=100000",
          "trainer.log_every=10", "trainer.progress_bar=false", "optim.lr=3e-3",
          "optim.warmup_steps=5", "trainer.seed=0"]
VARIANTS = {"padded": ["data.pack=false", "trainer.batch_size=10"],
            "packed": ["data.pack=true", "trainer.batch_size=2"]}


def stdlib_text(limit: int = 6_000_000) -> str:
    import sysconfig
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for f in sorted(root.glob("*.py")):
        text = f.read_text(errors="ignore")
        parts.append(text)
        size += len(text)
        if size > limit:
            break
    return "\n".join(parts)


def make_pairs(model: Path, text: str, n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """n pairs with log-normal lengths (median 300 tokens, a tail cut at 2,048)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model)
    stream = tok(text[: 4_000_000])["input_ids"]
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 0.9, n).astype(int), 24, 2040)
    rows, at = [], int(rng.integers(0, 1000))
    for n_tok in lengths:
        piece = stream[at:at + n_tok]
        at = (at + n_tok) % max(1, len(stream) - 2100)
        cut = max(8, n_tok // 10)
        rows.append({"input": tok.decode(piece[:cut]), "output": tok.decode(piece[cut:])})
    return rows, lengths


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def run(name: str, out: Path, model: Path, round_: int) -> dict:
    run_dir = out / "runs" / f"{name}-{round_}"
    args = [sys.executable, "-m", "paratrain", "train", *COMMON, *VARIANTS[name],
            f"model.path={model}", f"data.source={out / 'train.jsonl'}",
            f"data.val_source={out / 'val.jsonl'}", f"data.cache_dir={out / 'cache'}",
            f"run.dir={run_dir}"]
    before = load()
    t0 = time.perf_counter()
    r = subprocess.run(args, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    said = [x for x in r.stderr.splitlines() if "data.pack:" in x or "padding:" in x]
    return {"variant": name, "round": round_, "command_s": round(wall, 1),
            "train_s": round(s["train_s"], 1), "steps": s["steps"], "val_loss": s["val_loss"],
            "padding_share": s["padding_share"], "load_before": before, "load_after": load(),
            "said": said}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/packing-bench")
    p.add_argument("--examples", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = stdlib_text()
    model = make_model(out / "tiny-llama", [text[i:i + 10000] for i in range(0, len(text), 10000)],
                       vocab=1024, hidden=64, intermediate=128, layers=2, kv_heads=2,
                       positions=2048)
    train, lengths = make_pairs(model, text, args.examples, seed=0)
    val, _ = make_pairs(model, text[len(text) // 2:], 100, seed=1)
    for name, rows in (("train", train), ("val", val)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(train)} training pairs: {int(lengths.sum()):,} tokens, median "
          f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, longest "
          f"{int(lengths.max())}; {os.cpu_count()} cores, load {load()}", flush=True)
    results = []
    for k in range(args.rounds):
        for name in VARIANTS:
            results.append(run(name, out, model, k))
            print(json.dumps(results[-1]), flush=True)
    med = {n: statistics.median(r["train_s"] for r in results if r["variant"] == n)
           for n in VARIANTS}
    loss = {n: statistics.median(r["val_loss"] for r in results if r["variant"] == n)
            for n in VARIANTS}
    print(json.dumps({"train_s_median": med, "ratio_packed_to_padded":
                      round(med["packed"] / med["padded"], 3), "val_loss_median": loss,
                      "val_loss_gap": round(abs(loss["packed"] - loss["padded"]) /
                                            loss["padded"], 4)}))
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
