"""What the per-step stop-signal check costs: one all-reduce of one float64 (MAX) over the ranks,
as TrainLoop does at every optimizer step boundary (preemption.py).

    python benchmarks/stop_check.py [--world 2] [--iters 2000]

Starts `world` gloo processes on 127.0.0.1 (one thread each) and prints the median and 90th
percentile time of the all-reduce, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, iters: int, out: "mp.SimpleQueue") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.zeros(1, dtype=torch.float64)
    times = []
    for i in range(iters + 100):
        t0 = time.perf_counter()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i >= 100:  # warm-up left out
            times.append(time.perf_counter() - t0)
    if rank == 0:
        times.sort()
        out.put((statistics.median(times), times[int(0.9 * len(times))]))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    from paratrain.launch.environment import free_port
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_rank, args=(a.world, free_port(), a.iters, out), nprocs=a.world,
                       start_method="spawn")
    median, p90 = out.get()
    print(f"stop check (all-reduce MAX of 1 float64, {a.world} gloo ranks): median "
          f"{median * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us; 1-min load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
