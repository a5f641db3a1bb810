"""DistEnv: who this process is in the job, passed explicitly everywhere.

One frozen value instead of `dist.get_rank()` sprinkled through the code: functions that need the
rank say so in their signature, and a single-process run is just `DistEnv.single(device)`.
Reductions here are the only collectives the training loop calls directly.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Sequence

import torch
import torch.distributed as dist


def restart_attempt(environ: Mapping[str, str] = os.environ) -> int:
    """How many times the elastic agent has restarted this worker group (read once, where a
    worker's DistEnv is built)."""
    return int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0  # global rank
    local_rank: int = 0  # rank on this node
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    nnodes: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"  # meaningful only when world_size > 1
    timeout_s: float = 300.0
    # Where the job's key-value store listens (rank 0's host) and how to join the group:
    # "env://" under the elastic agent/torchrun, "tcp://addr:port" under Slurm (no agent).
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    init_method: str = "env://"
    job_id: str = "local"  # the same on every rank of one attempt; namespaces store keys
    attempt: int = 0  # the elastic agent's restart count: 0 first, 1 after one restart, ...

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "DistEnv":
        return cls(device=torch.device(device))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_master(self) -> bool:
        """Global rank 0: the only process that writes run outputs."""
        return self.rank == 0

    @property
    def is_local_master(self) -> bool:
        return self.local_rank == 0

    # ---- process group -------------------------------------------------------------------
    def init(self) -> None:
        """Join the process group. The launcher (elastic agent, torchrun) has put the rendezvous
        address in the environment that `env://` reads; the rank and size come from us."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if not self.distributed or dist.is_initialized():
            return
        kwargs: dict[str, Any] = {}
        if self.backend == "nccl":
            kwargs["device_id"] = self.device  # binds NCCL to the device up front
        timeout = _dt.timedelta(seconds=self.timeout_s)
        # A restarted group meets in the store the agent kept from the attempt before; keys left
        # there by that attempt make gloo connect to dead peers (or hang). Each job and attempt
        # gets a key prefix of its own (see shared/notes/torch-distributed-on-cpu.md).
        store, _, _ = next(dist.rendezvous(self.init_method, self.rank, self.world_size,
                                           timeout=timeout))
        dist.init_process_group(backend=self.backend, rank=self.rank, world_size=self.world_size,
                                store=dist.PrefixStore(self.store_prefix, store),
                                timeout=timeout, **kwargs)

    @property
    def store_prefix(self) -> str:
        """This group's keys in the agent's store. The world size is part of it: an elastic
        agent that restarts its workers because a node joined keeps its restart count."""
        return f"{self.job_id}/attempt_{self.attempt}/world_{self.world_size}"

    def teardown(self, barrier: bool = True) -> None:
        """Leave the group cleanly. Callers drop their references to wrapped models first:
        a DDP module still alive at destroy_process_group intermittently aborts the process.
        After a failure, `barrier=False`: a peer that stalled would hold us another timeout."""
        gc.collect()
        if self.distributed and dist.is_initialized():
            try:
                if barrier:
                    dist.barrier()
            finally:
                dist.destroy_process_group()

    # ---- collectives ---------------------------------------------------------------------
    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Sum float64 values over ranks (one collective for a handful of scalars)."""
        t = torch.as_tensor(values, dtype=torch.float64).flatten()
        if self.distributed:
            t = t.to(self.collective_device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.cpu()

    def max_over_ranks(self, value: float) -> float:
        """The largest of every rank's `value` (a flag that one rank raised, seen by all)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def weighted_mean(self, total: float, count: float) -> float:
        """Sum of per-token values and token count over all ranks -> the token-weighted mean."""
        s, n = self.all_reduce_sum([total, count]).tolist()
        return s / n if n > 0 else float("nan")

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every rank's small picklable object (ranks are our own processes), on every rank."""
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    @property
    def collective_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")
