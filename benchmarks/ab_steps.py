"""Two versions of paratrain's loop against each other and the plain DDP loop, in one window.

    python benchmarks/ab_steps.py --before /path/to/old/src [--after src] [--rounds 3] \\
        [--steps 12] [--warmup 3] [--out DIR] [key=value ...]

Each round runs `paratrain train` with the old source tree (PYTHONPATH=--before), the plain loop
(tools/plain_ddp.py, the same engine and layout), and `paratrain train` with the new tree, one
after the other, exactly as `paratrain bench` runs a row (tools/bench.py `run_variant`). A round's
three runs share the machine's load of their minutes, so the ratios are taken within a round
(median step time after warm-up, plain / paratrain: above 1 is faster than plain) and their
median over the rounds is reported, with the 1-minute load average after every run and the CPU
seconds per step (rank 0), which load disturbs far less than wall time. Default job: the
issue-44 setting (Llama `medium`, batch 4 per worker, 2 CPU workers, DDP). Writes DIR/ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ISSUE_44 = ["model.preset=medium", "trainer.batch_size=4", "trainer.devices=cpu:2",
            "trainer.strategy=ddp", "optim.grad_clip=1.0"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--before", required=True, help="the old tree's src/ folder")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parents[1] / "src"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="ab-steps")
    ns = ap.parse_args()
    sys.path.insert(0, ns.after)
    from paratrain.config.tree import TrainConfig
    from paratrain.launch import environment
    from paratrain.tools.bench import Bench, Variant, run_variant

    overrides = ns.overrides or ISSUE_44
    cfg = TrainConfig.from_yaml(None, overrides)
    devices = environment.parse_devices(cfg.trainer.devices)
    out = Path(ns.out)
    b = Bench(None, overrides, cfg, devices, out, ns.steps, ns.warmup, 1, 3600.0)
    rows = {"before": Variant("before", len(devices)), "plain": Variant("plain", len(devices),
                                                                         plain=True),
            "after": Variant("after", len(devices))}
    trees = {"before": ns.before, "plain": ns.after, "after": ns.after}
    rounds = []
    for i in range(ns.rounds):
        got = {}
        for name, v in rows.items():
            os.environ["PYTHONPATH"] = trees[name]  # the run's tree (its workers inherit it)
            r = run_variant(b, v, i)
            got[name] = {"step_s": statistics.median(r["step_times_s"][ns.warmup:]),
                         "cpu_s": statistics.median((r["step_cpu_s"] or [0])[ns.warmup:]),
                         "load_1min_after": os.getloadavg()[0]}
            print(f"round {i + 1} {name}: {got[name]}", file=sys.stderr, flush=True)
        for name in ("before", "after"):
            got[name]["vs_plain"] = got["plain"]["step_s"] / got[name]["step_s"]
        rounds.append(got)
    summary = {name: {"vs_plain_median": statistics.median(r[name]["vs_plain"] for r in rounds),
                      "step_s_median": statistics.median(r[name]["step_s"] for r in rounds),
                      "cpu_s_median": statistics.median(r[name]["cpu_s"] for r in rounds)}
               for name in ("before", "after")}
    summary["plain"] = {"step_s_median": statistics.median(r["plain"]["step_s"] for r in rounds),
                        "cpu_s_median": statistics.median(r["plain"]["cpu_s"] for r in rounds)}
    report = {"overrides": overrides, "cpu_count": environment.cpu_count(), "rounds": rounds,
              "summary": summary}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
