"""What checksumming every snapshot file costs (checkpoint/integrity.py): DCP's own file writer
against paratrain's checksumming one, on the default job's model and its AdamW state.

    python benchmarks/snapshot_checksum.py [--preset small] [--world 2] [--repeats 9]

Starts `world` gloo processes on 127.0.0.1 (one thread each, as the default job's CPU workers
run); each holds the model and optimizer state (replicated, as under DDP: DCP writes each tensor
once, split between the ranks' shards). Per repeat, the two writers alternate (which goes first
alternates too), each into a fresh folder under --dir (default: a temporary folder on the local
disk):

- sync: `dcp.save` from start to every rank done (what a synchronous snapshot waits for);
- async blocking: `dcp.async_save` until it returns (the part of an asynchronous snapshot the
  training loop waits for: staging the state into CPU memory);
- async total: until its files are written.

Prints the medians, the difference in percent, and the hash throughput of the candidates on one
64 MiB buffer (why CRC-32).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def _state(preset: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from paratrain.config import ModelConfig
    from paratrain.models import build_model
    from paratrain.config.presets import resolve_model_config
    torch.manual_seed(0)
    model = build_model(resolve_model_config(ModelConfig(preset=preset), vocab_size=4096,
                                             seq_length=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 4096, (2, 64))).float().mean().backward()
    opt.step()  # AdamW's state exists, as in a snapshot after step 1
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _rank(rank: int, world: int, port: int, a: argparse.Namespace, out: "mp.SimpleQueue") -> None:
    from paratrain.checkpoint import integrity
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    state = _state(a.preset)
    hashing = [0.0]  # seconds this rank spent inside zlib.crc32 (time.thread_time: its CPU)

    class TimedZlib:
        @staticmethod
        def crc32(data, value=0):
            t = time.thread_time()
            out = zlib.crc32(data, value)
            hashing[0] += time.thread_time() - t
            return out
    integrity.zlib = TimedZlib
    writers = {"plain": dcp.FileSystemWriter, "crc32": integrity.writer}
    times: dict[str, dict[str, list[float]]] = {
        w: {"sync": [], "block": [], "async": [], "cpu": [], "hash-sync": [], "hash-async": []}
        for w in writers}
    for r in range(a.repeats + 1):  # the first round warms up, left out
        order = list(writers) if r % 2 == 0 else list(reversed(writers))
        for name in order:
            for mode in ("sync", "async"):
                folder = os.path.join(a.dir, f"{name}-{mode}-{r}")
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                if mode == "sync":
                    dcp.save(state, storage_writer=writers[name](folder))
                    cpu = time.thread_time() - c0
                else:
                    f = dcp.async_save(state, storage_writer=writers[name](folder))
                    t_block = time.perf_counter() - t0
                    f.result()
                dist.barrier()
                total = time.perf_counter() - t0
                if r:
                    times[name][mode].append(total)
                    if mode == "sync":
                        times[name]["cpu"].append(cpu)
                    if mode == "async":
                        times[name]["block"].append(t_block)
                    if name == "crc32":
                        times[name][f"hash-{mode}"].append(hashing[0])
                hashing[0] = 0.0
                if rank == 0:
                    size = sum(e.stat().st_size for e in os.scandir(folder))
                    shutil.rmtree(folder)
    if rank == 0:
        out.put((size, {w: {k: (statistics.median(v), min(v)) for k, v in m.items() if v}
                        for w, m in times.items()}))
    dist.barrier()
    dist.destroy_process_group()


def _throughput() -> list[tuple[str, float]]:
    buf = memoryview(os.urandom(64 << 20))
    fns = {"zlib.crc32": lambda: zlib.crc32(buf), "sha1": lambda: hashlib.sha1(buf).digest(),
           "sha256": lambda: hashlib.sha256(buf).digest(), "md5": lambda: hashlib.md5(buf).digest(),
           "blake2b": lambda: hashlib.blake2b(buf).digest()}
    out = []
    for name, fn in fns.items():
        best = min(_timed(fn) for _ in range(3))
        out.append((name, len(buf) / best / 1e9))
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where the snapshots go (default: a temp folder)")
    a = p.parse_args()
    a.dir = a.dir or tempfile.mkdtemp(prefix="snapshot-checksum-")
    from paratrain.launch.environment import free_port
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(a.world, free_port(), a, out), nprocs=a.world,
                       start_method="spawn")
    size, t = out.get()
    print(f"{a.preset} preset, {a.world} ranks, one snapshot {size / 1e6:.0f} MB "
          f"(model + AdamW state), {a.repeats} repeats, load "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| | DCP's writer (s): median, best | checksumming writer (s): median, best | "
          "difference: median, best |")
    print("|---|---|---|---|")
    for key, label in (("sync", "sync `dcp.save`"), ("cpu", "sync `dcp.save`, CPU time of the saving thread"),
                       ("block", "async: blocking part"), ("async", "async: until written")):
        (plain, plain_best), (crc, crc_best) = t["plain"][key], t["crc32"][key]
        print(f"| {label} | {plain:.3f}, {plain_best:.3f} | {crc:.3f}, {crc_best:.3f} | "
              f"{(crc - plain) / plain:+.1%}, {(crc_best - plain_best) / plain_best:+.1%} |")
    hash_sync, hash_async = t["crc32"]["hash-sync"][0], t["crc32"]["hash-async"][0]
    print(f"\nCPU time inside the checksum per rank and snapshot (median): {hash_sync:.3f} s "
          f"(sync), {hash_async:.3f} s (async, in the background thread): "
          f"{hash_sync / t['plain']['sync'][1]:.1%} of DCP's best sync save, "
          f"{hash_sync / t['plain']['sync'][0]:.1%} of its median")
    print("\n| hash | GB/s (one 64 MiB buffer) |\n|---|---|")
    for name, gbps in _throughput():
        print(f"| {name} | {gbps:.2f} |")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
