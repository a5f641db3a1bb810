"""Nodes meet before any worker starts, then each starts its workers with torch's elastic agent.

Node 0 hosts a TCPStore at master_addr:master_port; the agent's rendezvous opens its store on the
same port in the same process (`multi_tenant`), so both share one server. The check-in catches
what the agent would only time out on: a node_rank given twice, nodes that disagree on nnodes,
devices per node or the config, a node that never comes; and it tells each node how many ranks
share its host, so ranks on one machine split its cores instead of each taking all of them.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed

from .. import errors
from ..data.node_share import NodeShare, forget_marker, mark_or_look
from ..errors import ConfigError, TrainingError
from ..formatting import first_line, flatten
from . import forkserver
from .environment import failure_to_error, free_port
from .preemption import AGENT_SIGNALS, ForwardToWorkers

# The signals whose handlers the agent or ForwardToWorkers replace while workers run.
_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

# ---- nodes meet before any worker starts ------------------------------------------------------
_NODES = "paratrain/nodes"
# Keys that may differ between nodes: where each node keeps its files, and which of its devices.
_PER_NODE_KEYS = ("run.", "data.cache_dir", "trainer.devices", "trainer.progress_bar",
                  "trainer.verbose", "distributed.node_rank", "distributed.master_addr")


@dataclass
class NodeGroup:
    """This node's seat in a job of `nnodes` nodes, once every node has checked in."""
    store: Any
    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    nproc: int
    run_id: str
    timeout_s: float
    rdzv: str = "static"
    ranks_on_host: int = 1  # this job's processes on this machine (all nodes that share it)
    min_nodes: Optional[int] = None  # elastic (nnodes=MIN:MAX): the job runs on MIN..nnodes

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

    def gathered(self, what: str, value: Any) -> list:
        """Every node's `value` (JSON), in node order, on every node: what each node found out
        (whether it sees node 0's files), for one decision the same everywhere."""
        prefix = f"{_NODES}/{self.run_id}/gathered/{what}/"
        self.store.set(prefix + str(self.node_rank), json.dumps(value))
        keys = [prefix + str(r) for r in range(self.nnodes)]
        try:
            self.store.wait(keys, _dt.timedelta(seconds=self.timeout_s))
            return [json.loads(self.store.get(k)) for k in keys]
        except Exception:  # a node stopped, or the store went away
            raise TrainingError(f"a node did not say {what} within {self.timeout_s:.0f} s; "
                                "see the other nodes' logs") from None

    def data_share(self, cache_dir: str) -> NodeShare:
        """Whether every node sees `cache_dir` (node 0's marker file in it), decided once for
        the job: then the nodes split the preparation of a token cache there."""
        seen = self.first_then_others("data-marker", lambda: mark_or_look(
            cache_dir, self.node_rank, self.run_id))
        views = self.gathered("data-marker", seen)
        if self.node_rank == 0:
            forget_marker(cache_dir, self.run_id)  # every node has looked for it
        return NodeShare(self.node_rank, self.nnodes, self.run_id, shared=all(views))

    def decided_by_node0(self, what: str, fn: Callable[[], Any]) -> Any:
        """`fn()` on node 0, its result on every node: one decision for the whole job (the
        memory plan's pick: device capacities differ a little between nodes). Pickled through
        this job's own store, between our own processes."""
        key = f"{_NODES}/{self.run_id}/decided/{what}"
        if self.node_rank == 0:
            value = fn()
            self.store.set(key, pickle.dumps(value))
            return value
        try:
            self.store.wait([key], _dt.timedelta(days=1))
            return pickle.loads(self.store.get(key))
        except Exception:  # the store went away: node 0 stopped
            raise TrainingError(f"node 0 stopped while deciding {what}; see its log") from None

    def launch(self, entrypoint: Callable[..., Any], args: Sequence[Any], *,
               max_restarts: int = 0, grace_s: float = 300.0) -> dict[int, Any]:
        """Start `nproc` workers here with the elastic agent; {global rank: return value} of this
        node's workers. A stall verdict published by a worker wins over the agent's report.

        A stop signal to this process (SIGINT, SIGTERM, SIGUSR1) goes on to the workers, which
        finish their step, commit a snapshot and return; after `grace_s`, or a second signal,
        the agent stops them at once (preemption.ForwardToWorkers)."""
        from torch.distributed.elastic.multiprocessing import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        # The agent logs every state change at INFO/WARNING; our own log says what matters.
        # A failed worker prints its own traceback, and we raise one line for the job.
        # (torch gives each of its modules' loggers a level of its own: set them one by one.)
        for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
            if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
                logging.getLogger(name).setLevel(logging.CRITICAL)
        if self.rdzv == "c10d":  # ranks by arrival; node 0 hosts the store
            rdzv_conf: dict[str, Any] = {"join_timeout": int(self.timeout_s),
                                         "last_call_timeout": 1, "is_host": self.node_rank == 0}
        else:
            rdzv_conf = {"rank": self.node_rank, "timeout": int(self.timeout_s)}
        reaper = _Reaper(self.store, self.run_id, self.node_rank)
        reaper.start()
        # The agent turns SIGINT/SIGTERM into SignalException (its handlers stay installed,
        # so ours come back afterwards; only the main thread may set them).
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in _AGENT_SIGNALS} if main else {}
        stops = ForwardToWorkers(grace_s).install()
        # Elastic: the workers get a store of their own each round (torch's rendezvous reads
        # this at every round): an agent that joins a later round would wait in vain for the
        # shared store's address, which the first round's rank 0 does not publish again.
        agent_env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if self.min_nodes else {}
        before = {k: os.environ.get(k) for k in agent_env}
        os.environ.update(agent_env)
        start = forkserver.worker_start()  # (after agent_env: spawned workers inherit it too)
        config = LaunchConfig(
            min_nodes=self.min_nodes or self.nnodes, max_nodes=self.nnodes,
            nproc_per_node=self.nproc,
            run_id=self.run_id, rdzv_endpoint=f"{self.master_addr}:{self.master_port}",
            rdzv_backend=self.rdzv, rdzv_configs=rdzv_conf, max_restarts=max_restarts,
            monitor_interval=0.1, start_method=start.method,
            signals_to_handle=AGENT_SIGNALS,  # the stop signals are ours: ForwardToWorkers
            **_shutdown_grace(LaunchConfig))
        try:
            return elastic_launch(config, forkserver.with_environ)(start.environ, entrypoint,
                                                                   *args)
        except ChildFailedError as e:
            verdict = reaper.verdict() or {}
            raise (TrainingError(verdict["message"]) if "message" in verdict
                   else failure_to_error(e)) from None
        except SignalException as e:  # a second stop signal, or the grace ran out: the agent
            _restore(handlers)  # has stopped the workers; a third signal is KeyboardInterrupt
            for p in multiprocessing.active_children():
                p.kill()
            raise errors.Interrupted(int(e.sigval)) from None
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            stops.restore()
            reaper.stop()
            _restore(handlers)

    def close(self) -> None:
        self.store = None  # node 0: the server closes when the last reference goes

    def __enter__(self) -> "NodeGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _restore(handlers: Mapping[int, Any]) -> None:
    for sig, handler in handlers.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(sig, handler)


def join_nodes(master_addr: str, master_port: int, nnodes: int, node_rank: int, nproc: int,
               timeout_s: float, config: Optional[Mapping[str, Any]] = None,
               rdzv: str = "static", min_nodes: Optional[int] = None) -> NodeGroup:
    """Meet the other nodes (or just open the store, for one node); raise one clear line when
    they cannot form one job. Bounded by `timeout_s`. Elastic (`min_nodes` < `nnodes`): nodes
    come and go, so a node only checks in with node 0 (the store's host, which must stay) and
    compares settings with it; torch's c10d rendezvous then forms each round."""
    elastic = min_nodes is not None and min_nodes < nnodes
    if nnodes == 1 and not master_port:
        master_port = free_port(master_addr if _is_local(master_addr) else "127.0.0.1")
    _resolve(master_addr)
    is_host = node_rank == 0
    if is_host:
        check_port_free(master_port)
    try:
        store = torch.distributed.TCPStore(
            master_addr, master_port, None, is_host, _dt.timedelta(seconds=timeout_s),
            wait_for_workers=False, multi_tenant=True)
    except Exception as e:
        if is_host:
            raise ConfigError(f"cannot listen on distributed.master_port={master_port}: "
                              f"{first_line(e)}") from None
        raise TrainingError(
            f"rendezvous timed out after {timeout_s:.0f} s: node {node_rank} could not reach node "
            f"0 at {master_addr}:{master_port}, so 1 of {nnodes} nodes (this one) joined; start "
            "node 0 (distributed.node_rank=0) with the same master_addr and master_port, or check "
            "the address and firewall") from None
    flat = flatten(config or {})
    me = {"host": socket.gethostname(), "nnodes": nnodes, "nproc": nproc,
          "config": {k: v for k, v in flat.items() if not k.startswith(_PER_NODE_KEYS)},
          "run_id": f"paratrain-{uuid.uuid4().hex[:8]}" if is_host else None}
    if not elastic and store.add(f"{_NODES}/claim/{node_rank}", 1) > 1:
        msg = (f"distributed.node_rank={node_rank} is used by two nodes; give every node its own "
               f"node_rank in 0..{nnodes - 1}")
        store.set(f"{_NODES}/abort", msg)
        raise ConfigError(msg)
    store.set(f"{_NODES}/info/{node_rank}", json.dumps(me))
    infos: dict[int, dict] = {}
    needed = sorted({node_rank, 0}) if elastic else list(range(nnodes))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if store.check([f"{_NODES}/abort"]):
                raise ConfigError(store.get(f"{_NODES}/abort").decode())
            for r in needed:
                if r not in infos and store.check([f"{_NODES}/info/{r}"]):
                    infos[r] = json.loads(store.get(f"{_NODES}/info/{r}"))
                    if r != node_rank and (is_host or r == 0):
                        _compare(node_rank, me, r, infos[r])
            if len(infos) == len(needed):
                break
            if time.monotonic() > deadline:
                missing = [r for r in needed if r not in infos]
                raise TrainingError(
                    f"rendezvous timed out after {timeout_s:.0f} s: {len(infos)} of {len(needed)} "
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
    ranks_on_host = sum(i["nproc"] for i in infos.values() if i["host"] == me["host"])
    return NodeGroup(store, master_addr, master_port, nnodes, node_rank, nproc,
                     infos[0]["run_id"], timeout_s, "c10d" if elastic else rdzv, ranks_on_host,
                     min_nodes if elastic else None)


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


def check_port_free(port: int) -> None:
    """A port held by another process: say so now, not as an agent timeout later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise ConfigError(f"distributed.master_port={port} is already in use on this machine "
                              "(another job or process listens there); choose a free port") \
                from None


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


def _shutdown_grace(launch_config: type) -> dict:
    """5 s for the agent to wait for workers it stops before killing them. Only a newer torch's
    LaunchConfig takes it (`shutdown_timeout`: 2.13 has it); torch 2.11's agent waits a fixed
    30 s."""
    names = {f.name for f in fields(launch_config)}
    return {"shutdown_timeout": 5} if "shutdown_timeout" in names else {}
