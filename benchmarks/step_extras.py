"""The per-step extras of paratrain's loop, timed one by one on 2 gloo ranks (CPU): `python benchmarks/step_extras.py OUT.json`."""
import json, os, statistics, sys, tempfile, time
import torch
import torch.multiprocessing as mp

def timed(fn, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6, sorted(out)[int(0.9 * n)] * 1e6

def worker(rank, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from paratrain.dist import DistEnv
    from paratrain.runtime.host_group import HostGroup
    from paratrain.records.console import ProgressBar
    from paratrain.records.metrics import MetricsLog, Throughput
    from paratrain.launch.watchdog import Progress
    from paratrain.runtime import loop
    from paratrain.runtime.loop_state import LoopFigures
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, backend="gloo",
                  timeout_s=60)
    env.init()
    res = {}
    res["stop check, blocking all-reduce MAX (before)"] = timed(lambda: env.max_over_ranks(0.0), 300)
    res["log line's all-reduce of 2 floats (log steps only)"] = timed(lambda: env.weighted_mean(1.0, 2.0), 300)
    host = HostGroup(env)
    host.stop_agreed(0)
    def step_then_check():  # 5 ms of 'step' between checks; time only the check
        time.sleep(0.005)
        t0 = time.perf_counter(); host.stop_agreed(0); return time.perf_counter() - t0
    waits = sorted(step_then_check() for _ in range(300))
    res["stop check, started a step earlier (after): wait at the boundary"] = (
        statistics.median(waits) * 1e6, waits[int(0.9 * len(waits))] * 1e6)
    host.drain()
    if rank == 0:
        bar = ProgressBar(env, 10**6, 0, True)
        res["progress bar update(1)"] = timed(lambda: bar.update(1), 2000)
        res["progress bar update with postfix (log steps)"] = timed(
            lambda: bar.update(0, loss="1.234", lr="1.00e-03"), 500)
        bar.close()
        clock, fig = loop._StepClock(time.perf_counter()), LoopFigures()
        res["step clock (perf_counter, time, process_time)"] = timed(lambda: clock.tick(fig), 2000)
        p = Progress()
        res["watchdog position, x4 per step"] = timed(lambda: [p.at(1, "forward") for _ in range(4)], 2000)
        with tempfile.TemporaryDirectory() as d:
            m = MetricsLog(__import__("pathlib").Path(d) / "m.jsonl")
            rec = {"step": 1, "epoch": 0, "loss": 1.2345, "lr": 1e-3, "grad_norm": 0.5,
                   **Throughput().report()}
            res["metrics.jsonl line (log steps)"] = timed(lambda: m.write(rec), 300)
            m.close()
        json.dump(res, open(path, "w"), indent=1)
    env.teardown()

if __name__ == "__main__":
    from paratrain.launch.environment import free_port
    out = sys.argv[1]
    mp.start_processes(worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    for k, (med, p90) in json.load(open(out)).items():
        print(f"{med:9.1f} us median {p90:9.1f} us p90  {k}")
    print("load", os.getloadavg())
