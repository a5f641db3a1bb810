"""How long a lost node costs an elastic job: 3 "nodes" x 1 CPU worker on 127.0.0.1 with
distributed.nnodes=2:3, node 2's process tree SIGKILLed after a committed snapshot; prints the
seconds from the kill to the survivors' resume line and to their first new step.

    python benchmarks/elastic_recovery.py [key=value ...]
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path


def main() -> None:
    from paratrain.launch.environment import free_port
    corpus = Path(sysconfig.get_paths()["stdlib"]) / "email"
    work = Path(tempfile.mkdtemp(prefix="elastic-"))
    port = free_port()
    args = ["train", "model.preset=tiny", f"data.source={corpus}", "data.vocab_size=384",
            "data.seq_length=32", f"data.cache_dir={work / 'cache'}", "trainer.batch_size=4",
            "trainer.global_batch_size=24", "trainer.max_steps=200", "trainer.log_every=1",
            "trainer.eval_every=100000", "trainer.eval_samples=8", "trainer.progress_bar=false",
            "trainer.devices=cpu:1", "checkpoint.every_steps=10", "distributed.nnodes=2:3",
            "distributed.master_addr=127.0.0.1", f"distributed.master_port={port}",
            "distributed.timeout_s=30", "log.report=false", "log.tensorboard=false",
            "run.name=el",
            *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "paratrain", *args,
                               f"distributed.node_rank={r}"], cwd=work, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for r in range(3)]
    lines: list[tuple[float, str]] = []

    def read(p: subprocess.Popen) -> None:
        for line in p.stderr:
            lines.append((time.monotonic(), line.rstrip()))
    for p in procs:
        threading.Thread(target=read, args=(p,), daemon=True).start()
    run = work / "runs" / "el"
    ck, metrics = run / "checkpoints", run / "metrics.jsonl"

    def logged() -> int:
        try:
            return len(metrics.read_text().splitlines())
        except OSError:
            return 0
    while not (any((s / "committed.json").is_file() for s in ck.glob("step-*"))
               and logged() >= 15):
        time.sleep(0.05)
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    os.killpg(procs[2].pid, signal.SIGKILL)
    t_kill = time.monotonic()
    for p in procs[:2]:
        p.wait(timeout=600)
    resumed = next(t for t, x in lines if t > t_kill and "world size 3 -> 2" in x)
    print(f"killed node 2 after step {last}; resume line after {resumed - t_kill:.1f} s; "
          f"job finished {time.monotonic() - t_kill:.1f} s after the kill "
          f"(exit codes {[p.returncode for p in procs[:2]]}); 1-min load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
