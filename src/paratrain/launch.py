"""From `trainer.devices` and `distributed.*` to running workers.

Three ways a process can find itself training:
- no launcher around, one device: train in this process;
- no launcher around, several devices: start one worker per device with torch's elastic agent
  (`elastic_launch`, the engine behind torchrun) and wait for them;
- started by torchrun / the elastic agent / Slurm: this process *is* one rank; read who we are
  from the environment once, here, into a DistEnv, and launch nothing.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed

from . import errors
from .dist import DistEnv
from .errors import ConfigError, TrainingError


# ---- devices --------------------------------------------------------------------------------
def parse_devices(spec: Any, *, gpus_visible: Optional[int] = None,
                  cores: Optional[int] = None) -> List[torch.device]:
    """`auto`, `cpu`, `cpu:N`, `cuda`, `cuda:0,1`, `0,1`, `[0, 1]` or an int N -> devices.

    Counts are parameters so that tests can ask "what would this mean on a 4-GPU box".
    """
    ngpu = torch.cuda.device_count() if gpus_visible is None else gpus_visible
    ncpu = cpu_count() if cores is None else cores
    key = "trainer.devices"
    if isinstance(spec, bool):
        raise ConfigError(f"{key}={spec!r} is not a device list; use auto, cpu:N or [0, 1]")
    if isinstance(spec, int):
        if spec < 1:
            raise ConfigError(f"{key}={spec} asks for no device; use 1 or more")
        return _gpus(list(range(spec)), ngpu, spec) if ngpu else _cpus(spec)
    if isinstance(spec, (list, tuple)) or hasattr(spec, "__iter__") and not isinstance(spec, str):
        items = list(spec)
        if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
            raise ConfigError(f"{key}={items!r} must be a non-empty list of GPU indices such as "
                              "[0, 1]")
        return _gpus(items, ngpu, items)
    s = str(spec).strip().lower()
    if s == "auto":
        return [torch.device("cuda", i) for i in range(ngpu)] if ngpu else _cpus(min(2, ncpu))
    if s == "cpu":
        return _cpus(1)
    m = re.fullmatch(r"cpu:(-?\d+)", s)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ConfigError(f"{key}={spec!r} asks for {n} CPU workers; use cpu:1 or more "
                              "(for example cpu:2)")
        return _cpus(n)
    if s in ("cuda", "gpu"):
        if not ngpu:
            raise ConfigError(f"{key}={spec!r} but no CUDA GPU is visible; use "
                              "trainer.devices=cpu:2 or auto")
        return [torch.device("cuda", i) for i in range(ngpu)]
    m = re.fullmatch(r"(?:cuda:|gpu:)?(\d+(?:\s*,\s*\d+)*)", s)
    if m:
        return _gpus([int(x) for x in m.group(1).split(",")], ngpu, spec)
    raise ConfigError(f"{key}={spec!r} is not understood; use auto, cpu:N, cuda, cuda:0,1 "
                      "or a list of GPU indices like [0, 1]")


def _cpus(n: int) -> List[torch.device]:
    return [torch.device("cpu")] * n


def _gpus(indices: Sequence[int], ngpu: int, spec: Any) -> List[torch.device]:
    if len(set(indices)) != len(indices):
        raise ConfigError(f"trainer.devices={spec!r} lists a GPU twice; list each index once")
    for i in indices:
        if i < 0 or i >= ngpu:
            have = (f"this machine has {ngpu} visible GPU(s): 0..{ngpu - 1}" if ngpu
                    else "no CUDA GPU is visible here; use trainer.devices=cpu:2 or auto")
            raise ConfigError(f"trainer.devices={spec!r}: GPU {i} does not exist ({have})")
    return [torch.device("cuda", i) for i in indices]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_backend(device: torch.device, requested: str = "auto") -> str:
    if requested != "auto":
        if requested == "nccl" and device.type != "cuda":
            raise ConfigError("distributed.backend=nccl needs CUDA devices; use gloo or auto")
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


# ---- who am I: environments set up by a launcher ---------------------------------------------
@dataclass(frozen=True)
class LauncherEnv:
    """What an outside launcher told this process (read once from the environment)."""
    kind: str  # "torchelastic" | "slurm"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str = "127.0.0.1"  # where rank 0's store listens
    master_port: int = 0
    job_id: str = "local"  # run id and restart attempt: the same on every rank of one attempt

    @property
    def init_method(self) -> str:
        """The elastic agent hands its store to the workers through env://; under Slurm nobody
        sets MASTER_ADDR, so rank 0 hosts the store at the address derived from the node list."""
        if self.kind == "torchelastic":
            return "env://"
        return f"tcp://{self.master_addr}:{self.master_port}"


def detect_launcher(environ: Mapping[str, str] = os.environ) -> Optional[LauncherEnv]:
    """torchrun / elastic agent first (it sets everything), then Slurm's srun."""
    e = environ
    if all(k in e for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        world = int(e["WORLD_SIZE"])
        local_world = int(e.get("LOCAL_WORLD_SIZE", world))
        job = f"{e.get('TORCHELASTIC_RUN_ID', 'torchrun')}/{e.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        return LauncherEnv("torchelastic", int(e["RANK"]), int(e["LOCAL_RANK"]), world,
                           local_world, int(e.get("GROUP_RANK", int(e["RANK"]) // local_world)),
                           max(1, world // max(1, local_world)), e["MASTER_ADDR"],
                           int(e["MASTER_PORT"]), job)
    if "SLURM_PROCID" in e and "SLURM_NTASKS" in e \
            and e.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        world = int(e["SLURM_NTASKS"])
        nnodes = int(e.get("SLURM_NNODES", "1"))
        addr, port = slurm_master(e)
        return LauncherEnv("slurm", int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", "0")),
                           world, int(str(e.get("SLURM_NTASKS_PER_NODE", world // nnodes))
                                      .split("(")[0]),
                           int(e.get("SLURM_NODEID", "0")), nnodes, addr, port,
                           f"slurm-{e.get('SLURM_JOB_ID', '0')}.{e.get('SLURM_STEP_ID', '0')}")
    return None


def slurm_master(environ: Mapping[str, str]) -> tuple[str, int]:
    """Slurm does not say where rank 0 listens: first host of the node list, a port from the job
    id (the same on every node, distinct between concurrent jobs)."""
    addr = environ.get("MASTER_ADDR") or _first_slurm_host(environ.get("SLURM_NODELIST", ""))
    port = int(environ.get("MASTER_PORT") or 10000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000)
    return addr or "127.0.0.1", port


def _first_slurm_host(nodelist: str) -> str:
    # "node[003-005,007],gpu01" -> "node003"
    m = re.match(r"([^,\[]+)(?:\[([0-9]+))?", nodelist.strip())
    return (m.group(1) + (m.group(2) or "")) if m else ""


def worker_dist_env(launcher: LauncherEnv, devices_spec: Any, backend: str, timeout_s: float,
                    devices: Optional[Sequence[Any]] = None) -> DistEnv:
    """The DistEnv of one rank; its device follows its local rank. `devices` is the list the
    launching process already resolved (our own agent), else `devices_spec` is parsed here."""
    if devices is not None:
        device = torch.device(devices[launcher.local_rank])
    elif torch.cuda.is_available() and str(devices_spec).lower() not in ("cpu",) \
            and not str(devices_spec).lower().startswith("cpu:"):
        gpus = parse_devices(devices_spec) if str(devices_spec) != "auto" else \
            [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if launcher.local_rank >= len(gpus):
            raise ConfigError(f"local rank {launcher.local_rank} has no device: "
                              f"trainer.devices={devices_spec!r} lists {len(gpus)}; start as "
                              "many processes per node as devices")
        device = gpus[launcher.local_rank]
    else:
        device = torch.device("cpu")
    return DistEnv(rank=launcher.rank, local_rank=launcher.local_rank,
                   world_size=launcher.world_size, local_world_size=launcher.local_world_size,
                   node_rank=launcher.node_rank, nnodes=launcher.nnodes, device=device,
                   backend=default_backend(device, backend), timeout_s=timeout_s,
                   master_addr=launcher.master_addr, master_port=launcher.master_port,
                   init_method=launcher.init_method, job_id=launcher.job_id)


# ---- nodes meet before any worker starts ------------------------------------------------------
def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


_NODES = "paratrain/nodes"
# Keys that may differ between nodes: where each node keeps its files, and which of its devices.
_PER_NODE_KEYS = ("run.", "data.cache_dir", "trainer.devices", "trainer.progress_bar",
                  "trainer.verbose", "distributed.node_rank", "distributed.master_addr")


@dataclass
class NodeGroup:
    """This node's seat in a job of `nnodes` nodes, once every node has checked in.

    Node 0 hosts a TCPStore at master_addr:master_port; the elastic agent's rendezvous opens
    its store on the same port in the same process (`multi_tenant`), so both share one server.
    The check-in catches what the agent would only time out on: a node_rank given twice, nodes
    that disagree on nnodes, devices per node or the config, a node that never comes.
    """
    store: Any
    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    nproc: int
    run_id: str
    timeout_s: float
    rdzv: str = "static"

    def first_then_others(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run `fn` on node 0, then on the other nodes: a cache in a shared directory is built
        once and reused by the others; a node with its own directory builds its own copy."""
        key = f"{_NODES}/{self.run_id}/done/{what}"
        if self.node_rank == 0:
            try:
                out = fn()
            except BaseException as e:
                msg = str(e) if isinstance(e, errors.ParatrainError) else type(e).__name__
                self.store.set(key, "error: " + (msg or "see node 0's log"))
                raise
            self.store.set(key, "ok")
            return out
        try:
            self.store.wait([key], _dt.timedelta(days=1))  # node 0 may take long to build
            status = self.store.get(key).decode()
        except Exception:  # the store went away: node 0 stopped
            raise TrainingError(f"node 0 stopped while preparing {what}; see its log") from None
        if status != "ok":
            raise TrainingError(f"node 0 failed while preparing {what}: {status[7:]}")
        return fn()

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], *,
               max_restarts: int = 0) -> dict[int, Any]:
        """Start `nproc` workers here with the elastic agent; {global rank: return value} of this
        node's workers. A stall verdict published by a worker wins over the agent's report."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        # The agent logs every state change at INFO/WARNING; our own log says what matters.
        # A failed worker prints its own traceback, and we raise one line for the job.
        for name in ("torch.distributed.elastic", "torch.multiprocessing"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        if self.rdzv == "c10d":  # ranks by arrival; node 0 hosts the store
            rdzv_conf: dict[str, Any] = {"join_timeout": int(self.timeout_s),
                                         "last_call_timeout": 1, "is_host": self.node_rank == 0}
        else:
            rdzv_conf = {"rank": self.node_rank, "timeout": int(self.timeout_s)}
        config = LaunchConfig(
            min_nodes=self.nnodes, max_nodes=self.nnodes, nproc_per_node=self.nproc,
            run_id=self.run_id, rdzv_endpoint=f"{self.master_addr}:{self.master_port}",
            rdzv_backend=self.rdzv, rdzv_configs=rdzv_conf, max_restarts=max_restarts,
            monitor_interval=0.1, start_method="spawn", shutdown_timeout=5)
        reaper = _Reaper(self.store, self.run_id, self.node_rank)
        reaper.start()
        try:
            return elastic_launch(config, entrypoint)(*args)
        except ChildFailedError as e:
            verdict = reaper.verdict() or {}
            raise (TrainingError(verdict["message"]) if "message" in verdict
                   else failure_to_error(e)) from None
        finally:
            reaper.stop()

    def close(self) -> None:
        self.store = None  # node 0: the server closes when the last reference goes

    def __enter__(self) -> "NodeGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def join_nodes(master_addr: str, master_port: int, nnodes: int, node_rank: int, nproc: int,
               timeout_s: float, config: Optional[Mapping[str, Any]] = None,
               rdzv: str = "static") -> NodeGroup:
    """Meet the other nodes (or just open the store, for one node); raise one clear line when
    they cannot form one job. Bounded by `timeout_s`."""
    if nnodes == 1 and not master_port:
        master_port = free_port(master_addr if _is_local(master_addr) else "127.0.0.1")
    _resolve(master_addr)
    is_host = node_rank == 0
    if is_host:
        _check_port_free(master_port)
    try:
        store = torch.distributed.TCPStore(
            master_addr, master_port, None, is_host, _dt.timedelta(seconds=timeout_s),
            wait_for_workers=False, multi_tenant=True)
    except Exception as e:
        if is_host:
            raise ConfigError(f"cannot listen on distributed.master_port={master_port}: "
                              f"{_first_line(e)}") from None
        raise TrainingError(
            f"rendezvous timed out after {timeout_s:.0f} s: node {node_rank} could not reach node "
            f"0 at {master_addr}:{master_port}, so 1 of {nnodes} nodes (this one) joined; start "
            "node 0 (distributed.node_rank=0) with the same master_addr and master_port, or check "
            "the address and firewall") from None
    flat = _flatten(config or {})
    me = {"host": socket.gethostname(), "nnodes": nnodes, "nproc": nproc,
          "config": {k: v for k, v in flat.items() if not k.startswith(_PER_NODE_KEYS)},
          "run_id": f"paratrain-{uuid.uuid4().hex[:8]}" if is_host else None}
    if store.add(f"{_NODES}/claim/{node_rank}", 1) > 1:
        msg = (f"distributed.node_rank={node_rank} is used by two nodes; give every node its own "
               f"node_rank in 0..{nnodes - 1}")
        store.set(f"{_NODES}/abort", msg)
        raise ConfigError(msg)
    store.set(f"{_NODES}/info/{node_rank}", json.dumps(me))
    infos: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if store.check([f"{_NODES}/abort"]):
                raise ConfigError(store.get(f"{_NODES}/abort").decode())
            for r in range(nnodes):
                if r not in infos and store.check([f"{_NODES}/info/{r}"]):
                    infos[r] = json.loads(store.get(f"{_NODES}/info/{r}"))
                    if r != node_rank and (is_host or r == 0):
                        _compare(node_rank, me, r, infos[r])
            if len(infos) == nnodes:
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(nnodes) if r not in infos]
                raise TrainingError(
                    f"rendezvous timed out after {timeout_s:.0f} s: {len(infos)} of {nnodes} "
                    f"nodes joined (missing node_rank {', '.join(map(str, missing))}); start the "
                    "same command on every node, or raise distributed.timeout_s")
            time.sleep(0.1)
    except errors.ParatrainError:
        if is_host:  # keep the store up a moment: the other nodes read why, then give up too
            time.sleep(1.0)
        raise
    except (RuntimeError, OSError):  # the store closed under us: node 0 gave up first
        raise TrainingError("node 0 left during the rendezvous (its error says why); start "
                            "every node with the same settings") from None
    return NodeGroup(store, master_addr, master_port, nnodes, node_rank, nproc,
                     infos[0]["run_id"], timeout_s, rdzv)


def _compare(mine: int, me: dict, other: int, them: dict) -> None:
    """One line for the first way two nodes disagree (each side reports it)."""
    def err(what: str) -> ConfigError:
        return ConfigError(f"node {mine} and node {other} ({them['host']}) disagree: {what}; "
                           "start every node with the same settings")
    if me["nnodes"] != them["nnodes"]:
        raise err(f"distributed.nnodes={me['nnodes']} here, {them['nnodes']} there")
    if me["nproc"] != them["nproc"]:
        raise err(f"{me['nproc']} device(s) in trainer.devices here, {them['nproc']} there")
    keys = sorted(k for k in set(me["config"]) | set(them["config"])
                  if me["config"].get(k) != them["config"].get(k))
    if keys:
        k = keys[0]
        raise err(f"{k}={me['config'].get(k)!r} here, {them['config'].get(k)!r} there")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resolve(addr: str) -> None:
    try:
        socket.getaddrinfo(addr, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"distributed.master_addr={addr!r} does not resolve ({e.args[-1]}); "
                          "use node 0's IP address or a hostname every node can resolve") from None


def _is_local(addr: str) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _check_port_free(port: int) -> None:
    """A port held by another process: say so now, not as an agent timeout later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise ConfigError(f"distributed.master_port={port} is already in use on this machine "
                              "(another job or process listens there); choose a free port") \
                from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class _Reaper:
    """In the launching process: when a worker has published a stall verdict, kill this node's
    stalled workers (a SIGSTOPped process ignores the agent's SIGTERM for 30 s, and a node whose
    only worker is frozen would otherwise wait forever)."""

    def __init__(self, store: Any, run_id: str, node_rank: int, grace_s: float = 3.0):
        self.store = store.clone() if hasattr(store, "clone") else store
        self.prefix, self.node_rank, self.grace_s = f"paratrain/{run_id}/", node_rank, grace_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratrain-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def verdict(self) -> Optional[dict]:
        try:
            keys = [k for k in (f"{self.prefix}{a}/verdict" for a in range(8))
                    if self.store.check([k])]
            return json.loads(self.store.get(keys[-1])) if keys else None
        except Exception:  # the store is gone: node 0 has left
            return None

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            v = self.verdict()
            if not v:
                continue
            if self._stop.wait(self.grace_s):
                return
            for s in v.get("stalled", []):
                if s.get("node_rank") == self.node_rank and s.get("pid"):
                    try:
                        os.kill(int(s["pid"]), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            return


def launch_workers(entrypoint: Callable[..., Any], args: Sequence[Any], *, nproc: int,
                   master_addr: str, master_port: int, nnodes: int = 1, node_rank: int = 0,
                   max_restarts: int = 0, timeout_s: float = 300.0, rdzv: str = "static",
                   run_id: Optional[str] = None) -> dict[int, Any]:
    """Start `nproc` workers on this node and wait; return {global rank: value} of this node's
    workers. The same call on N nodes (each with its node_rank) forms one job."""
    with join_nodes(master_addr, master_port, nnodes, node_rank, nproc, timeout_s,
                    rdzv=rdzv) as nodes:
        if run_id:
            nodes.run_id = run_id
        return nodes.launch(entrypoint, args, max_restarts=max_restarts)


def failure_to_error(e: Any) -> errors.ParatrainError:
    """The first failed rank's exception, re-raised in the parent with its type when it is ours
    (a user error found inside a worker still ends as one line and exit code 2)."""
    rank, failure = min(e.failures.items()) if e.failures else (-1, None)
    if failure is None:
        return TrainingError(str(e))
    text = ""
    msg = failure.message
    if isinstance(msg, dict):
        text = str(msg.get("message", ""))
    elif msg:
        text = str(msg)
    if not text and failure.error_file and os.path.exists(failure.error_file):
        try:
            with open(failure.error_file) as f:
                text = str(json.load(f).get("message", {}).get("message", ""))
        except (OSError, ValueError):
            pass
    first = text.strip().splitlines()[0] if text.strip() else ""
    if first.startswith("To enable traceback"):  # died before our entrypoint ran: no error file
        return TrainingError(
            f"worker rank {rank} failed with exit code {failure.exitcode} before training "
            "started; its error is printed above (a script that calls Trainer.fit() must do so "
            "under `if __name__ == '__main__':`, since workers re-import it)")
    m = re.match(r"(?:[\w.]+\.)?(\w+Error): (.*)", first)
    if m and isinstance(getattr(errors, m.group(1), None), type) \
            and issubclass(getattr(errors, m.group(1)), errors.ParatrainError):
        return getattr(errors, m.group(1))(m.group(2))
    cause = first or (f"signal {failure.signal_name()}" if failure.signal_name() != "<N/A>"
                      else f"exit code {failure.exitcode}")
    return TrainingError(f"worker rank {rank} failed: {cause}")
