"""Two "nodes" on one machine against one node with the same two workers: steps/s of each.

    python benchmarks/two_nodes_one_host.py [--steps 200 --repeats 2] [key=value ...]

Runs, in a scratch directory, `paratrain train` once with trainer.devices=cpu:2 (one node) and
twice at the same time with trainer.devices=cpu:1 distributed.nnodes=2 on 127.0.0.1 (node_rank 0
and 1), same tiny Llama, data and world size, and prints the median steps/s after 10 warm-up
steps (summary.json's step_times_s) and their ratio. Extra key=value overrides go to every run
(e.g. data.seq_length=256 trainer.batch_size=8).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rate(run_dir: Path) -> float:
    times = json.loads((run_dir / "summary.json").read_text())["step_times_s"][10:]
    return 1.0 / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    work = Path(tempfile.mkdtemp(prefix="two-nodes-"))
    base = ["train", "model.preset=tiny", f"data.source={corpus}", "data.vocab_size=384",
            "data.seq_length=32", f"data.cache_dir={work / 'cache'}", "trainer.batch_size=4",
            f"trainer.max_steps={a.steps}", "trainer.log_every=10", "trainer.eval_every=100000",
            "trainer.eval_samples=8", "trainer.progress_bar=false", "run.overwrite=true",
            "log.report=false", "log.tensorboard=false", *a.overrides]
    cmd = [sys.executable, "-m", "paratrain"]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a user runs it
    for _ in range(a.repeats):
        subprocess.run(cmd + base + ["trainer.devices=cpu:2", "run.name=one"], cwd=work, env=env,
                       check=True, capture_output=True)
        port = _port()
        two = base + ["trainer.devices=cpu:1", "distributed.nnodes=2", "run.name=two",
                      f"distributed.master_port={port}"]
        procs = [subprocess.Popen(cmd + two + [f"distributed.node_rank={r}"], cwd=work, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        for pr in procs:
            err = pr.communicate(timeout=900)[1]
            if pr.returncode:
                sys.exit(f"a node failed:\n{err[-3000:]}")
        one, two_nodes = _rate(work / "runs" / "one"), _rate(work / "runs" / "two")
        print(f"one node cpu:2 {one:.1f} steps/s, two nodes x cpu:1 {two_nodes:.1f} steps/s, "
              f"ratio {two_nodes / one:.2f}, 1-min load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
