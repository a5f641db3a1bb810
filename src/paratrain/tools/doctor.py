"""`paratrain doctor`: what a user checks first when a job hangs or crawls, in one command.

It prints versions, visible devices, the backends this torch has and the environment variables
that steer them; checks that the master address resolves and its port is free (node 0) or
reachable (other nodes); then runs a short all-reduce over the local devices (gloo on CPU, nccl on
GPUs), across nodes with --nnodes/--node-rank/--master-addr, and reports bandwidth the way
nccl-tests does: algbw = bytes / time, busbw = algbw * 2(n-1)/n, the figure to compare with the
link speed whatever the number of ranks. Then the same devices exchange tensors point to point,
as pipeline stages do (each rank sends to the next and receives from the one before, then back):
a transport can pass an all-reduce and still hang on send/recv. When nccl fails or times out
(--timeout-s) where gloo works, the classic cause is peer-to-peer transport (P2P over
PCIe/NVLink misbehaving, e.g. under some VMs or IOMMU settings), so it says so and runs nccl
again with NCCL_P2P_DISABLE=1.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
from typing import Any, Optional, Sequence

import torch

from ..errors import ParatrainError
from ..launch import environment, nodes

ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "TORCH_DISTRIBUTED", "TORCH_NCCL", "TORCHELASTIC_",
                "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "SLURM_JOB_ID", "SLURM_NODELIST",
                "SLURM_NTASKS", "SLURM_PROCID")
ALL_REDUCE, SEND_RECV = "all-reduce", "send/recv"  # the doctor's two timed tables


def run(ns: argparse.Namespace) -> int:
    """Print the report; 0 when every check passed, 1 when one failed."""
    ok = True
    section("versions")
    item("python", f"{platform.python_version()} ({sys.executable})")
    item("torch", torch.__version__)
    item("CUDA (torch built with)", torch.version.cuda or "none (CPU build)")
    item("NCCL", _nccl_version())
    section("devices")
    item("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(not set: all)"))
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    item("GPUs visible", str(n))
    for i in range(n):
        item(f"  cuda:{i}", torch.cuda.get_device_name(i))
    item("CPU cores usable", str(environment.cpu_count()))
    section("backends")
    d = torch.distributed
    for name, avail in (("gloo", d.is_gloo_available()), ("nccl", d.is_nccl_available()),
                        ("mpi", d.is_mpi_available())):
        item(name, "available" if avail else "not available")
    section("environment")
    shown = sorted(k for k in os.environ if k.startswith(ENV_PREFIXES))
    for k in shown:
        item(k, os.environ[k])
    if not shown:
        item("(none set)", "NCCL_*, GLOO_SOCKET_IFNAME, MASTER_ADDR/PORT, ...")
    section("master")
    ok &= check_master(ns.master_addr, ns.master_port, ns.node_rank, ns.nnodes)

    devices = environment.parse_devices(ns.devices)
    backend = environment.default_backend(devices[0], ns.backend)
    world = len(devices) * ns.nnodes
    section(f"all-reduce: {world} rank(s), {backend}")
    if world < 2:
        print("  one device and one node: nothing to all-reduce (try --devices cpu:2)")
        return 0 if ok else 1
    sizes = _sizes(int(ns.max_mb * 2**20))
    tables = _with_nccl_fallback(ns, devices, backend, sizes)
    if tables is None:
        return 1
    print(format_table(tables[ALL_REDUCE], world))
    section(f"point-to-point (pipeline stages): {world} rank(s), {backend}")
    print(format_p2p_table(tables[SEND_RECV], world))
    return 0 if ok else 1


def _with_nccl_fallback(ns: argparse.Namespace, devices: Sequence[torch.device], backend: str,
                        sizes: list[int]) -> Optional[dict[str, list[dict]]]:
    """`collectives_check`'s tables; when it fails (or outlives --timeout-s) on nccl, gloo on
    the same devices tells the network from NCCL, and nccl runs again with NCCL_P2P_DISABLE=1.
    None: failed, and the report says what to try next."""
    try:
        return collectives_check(ns, devices, backend, sizes)
    except ParatrainError as e:
        print(f"  FAILED: {e}")
        if backend != "nccl":
            return None
    print("  trying gloo on the same devices ...")
    try:
        collectives_check(ns, devices, "gloo", sizes[:3])
    except ParatrainError as e2:
        print(f"  gloo FAILED too: {e2}\n  the problem is the network or the rendezvous, "
              "not NCCL: check master address, port and firewall")
        return None
    print("  nccl fails where gloo works: the usual cause is NCCL's peer-to-peer transport."
          "\n  suggestion: export NCCL_P2P_DISABLE=1 (re-running nccl with it now)")
    os.environ["NCCL_P2P_DISABLE"] = "1"  # the workers inherit it
    try:
        tables = collectives_check(ns, devices, "nccl", sizes)
    except ParatrainError as e3:
        print(f"  nccl with NCCL_P2P_DISABLE=1 FAILED as well: {e3}\n  next: run with "
              "NCCL_DEBUG=INFO and look for the transport it picks")
        return None
    print("  nccl works with NCCL_P2P_DISABLE=1: set it for training")
    return tables


# ---- checks ------------------------------------------------------------------------------------
def check_master(addr: str, port: int, node_rank: int, nnodes: int) -> bool:
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
        item("address", f"{addr} resolves to {', '.join(sorted({i[4][0] for i in infos}))}")
    except (socket.gaierror, UnicodeError) as e:
        item("address", f"FAILED: {addr!r} does not resolve ({e.args[-1]})")
        return False
    if not port:
        item("port", "0: a free port is picked (one node only)" if nnodes == 1 else
             "FAILED: set --master-port (the same on every node)")
        return nnodes == 1
    if node_rank == 0:
        try:
            nodes.check_port_free(port)
            item("port", f"{port} is free on this machine (node 0 will listen there)")
        except ParatrainError as e:
            item("port", f"FAILED: {e}")
            return False
        return True
    try:
        with socket.create_connection((addr, port), timeout=3):
            item("port", f"{addr}:{port} is reachable (node 0 is listening)")
    except OSError as e:
        item("port", f"{addr}:{port} not reachable yet ({e.strerror or e}); fine if node 0 "
                     "has not started")
    return True


def collectives_check(ns: argparse.Namespace, devices: Sequence[torch.device], backend: str,
                      sizes: Sequence[int]) -> dict[str, list[dict]]:
    """In worker processes over the local devices (and nodes): all-reduces, then what a
    pipeline does between its stages, every rank sending to the next one and receiving from
    the one before (activations), then the other way round (their gradients). The rows of each
    table. A transport that hangs fails after --timeout-s (the process group's timeout)."""
    with nodes.join_nodes(ns.master_addr, ns.master_port, ns.nnodes, ns.node_rank,
                           len(devices), ns.timeout_s,
                           config={"doctor": {"backend": backend, "sizes": list(sizes)}}) as g:
        out = g.launch(doctor_worker, ([str(x) for x in devices], backend, list(sizes),
                                       ns.timeout_s))
    return out[min(out)]


def doctor_worker(devices: list[str], backend: str, sizes: list[int], timeout_s: float
                  ) -> dict[str, list[dict]]:
    """One rank: time float32 sum all-reduces, then point-to-point exchanges in a ring, both
    ways; each row is the slowest rank's mean time."""
    from torch.distributed.elastic.multiprocessing.errors import record
    return record(_timed_rows)(devices, backend, sizes, timeout_s)


def _timed_rows(devices: list[str], backend: str, sizes: list[int], timeout_s: float
                ) -> dict[str, list[dict]]:
    import torch.distributed as dist
    launcher = environment.detect_launcher()
    assert launcher is not None, "runs under the elastic agent"
    env = environment.worker_dist_env(launcher, "auto", backend, timeout_s, devices=devices)
    if env.device.type == "cpu":
        torch.set_num_threads(max(1, environment.cpu_count() // env.local_world_size))
    env.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    tables: dict[str, list[dict]] = {ALL_REDUCE: [], SEND_RECV: []}
    try:
        for op, nbytes in ((op, n) for op in tables for n in sizes):
            x = torch.ones(nbytes // 4, dtype=torch.float32, device=env.device)
            y = torch.empty_like(x)  # what the neighbour sends
            iters = max(3, min(50, int(2**24 // max(nbytes, 1))))
            for _ in range(2):  # warm-up: connections, buffers
                _once(op, x, y, nxt, prev)
            _sync(env.device)
            t0 = time.perf_counter()
            for _ in range(iters):
                _once(op, x, y, nxt, prev)
            _sync(env.device)
            dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                              device=env.collective_device)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            tables[op].append({"bytes": nbytes, "count": nbytes // 4, "time_s": float(dt)})
        return tables
    finally:
        env.teardown()


def _once(op: str, x: torch.Tensor, y: torch.Tensor, nxt: int, prev: int) -> None:
    """One all-reduce of x; or x sent to the next rank while y is received from the one before
    (a stage's activations), then the other way round (their gradients)."""
    import torch.distributed as dist
    if op == ALL_REDUCE:
        dist.all_reduce(x)
        return
    for to, frm in ((nxt, prev), (prev, nxt)):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to),
                                            dist.P2POp(dist.irecv, y, frm)]):
            work.wait()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_table(rows: list[dict], world: int) -> str:
    """nccl-tests' columns: size, count, type, redop, time, algbw, busbw (GB/s = 1e9 B/s)."""
    factor = 2 * (world - 1) / world
    lines = [f"  {'size(B)':>12} {'count':>12} {'type':>6} {'redop':>6} {'time(us)':>10} "
             f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"]
    busbws = []
    for r in rows:
        algbw = r["bytes"] / r["time_s"] / 1e9
        busbws.append(algbw * factor)
        lines.append(f"  {r['bytes']:>12} {r['count']:>12} {'float':>6} {'sum':>6} "
                     f"{r['time_s'] * 1e6:>10.1f} {algbw:>12.3f} {algbw * factor:>12.3f}")
    lines.append(f"  # avg bus bandwidth: {sum(busbws) / len(busbws):.3f} GB/s; "
                 f"peak {max(busbws):.3f} GB/s at {rows[busbws.index(max(busbws))]['bytes']} B "
                 f"(busbw = algbw x 2(n-1)/n, n={world})")
    return "\n".join(lines)


def format_p2p_table(rows: list[dict], world: int) -> str:
    """Per exchange (one send and one receive per rank each way): time, and the bandwidth of one
    link in one direction (bytes x 2 / time: a rank sends the tensor twice)."""
    lines = [f"  {'size(B)':>12} {'time(us)':>10} {'link(GB/s)':>11}"]
    for r in rows:
        lines.append(f"  {r['bytes']:>12} {r['time_s'] * 1e6:>10.1f} "
                     f"{2 * r['bytes'] / r['time_s'] / 1e9:>11.3f}")
    peak = max(rows, key=lambda r: r["bytes"] / r["time_s"])
    lines.append(f"  # send/recv between neighbours of a ring of {world}: peak "
                 f"{2 * peak['bytes'] / peak['time_s'] / 1e9:.3f} GB/s per link and direction "
                 f"at {peak['bytes']} B")
    return "\n".join(lines)


def _sizes(max_bytes: int) -> list[int]:
    """4 KiB, 16 KiB, ... up to max_bytes: small sizes show latency, large ones bandwidth."""
    out, b = [], 4096
    while b <= max_bytes:
        out.append(b)
        b *= 4
    return out or [4096]


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "n/a (no CUDA)"
    try:
        v: Any = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # a CUDA build without NCCL
        return f"unavailable ({e})"


def section(title: str) -> None:
    print(f"\n== {title}")


def item(key: str, value: Optional[str]) -> None:
    print(f"  {key + ':':<26} {value}")
