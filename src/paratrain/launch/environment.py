"""From `trainer.devices` and the launcher's environment to who this process is.

Three ways a process can find itself training:
- no launcher around, one device: train in this process;
- no launcher around, several devices: start one worker per device with torch's elastic agent
  (`elastic_launch`, the engine behind torchrun) and wait for them;
- started by torchrun / the elastic agent / Slurm: this process *is* one rank; read who we are
  from the environment once, here, into a DistEnv, and launch nothing.
How nodes meet and start their workers is nodes.py.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

import torch

from .. import errors
from ..dist import DistEnv
from ..errors import ConfigError, TrainingError


# ---- devices --------------------------------------------------------------------------------
def parse_devices(spec: Any, *, gpus_visible: Optional[int] = None,
                  cores: Optional[int] = None) -> List[torch.device]:
    """`auto`, `cpu`, `cpu:N`, `gpu:N` (N GPUs), `cuda`, `cuda:0,1` (GPUs 0 and 1: torch's
    `cuda:N` names GPU N), `0,1`, `[0, 1]` or an int N -> devices.

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
    m = re.fullmatch(r"gpu:(-?\d+)", s)
    if m:  # a count, as cpu:N is; cuda:N (torch's spelling) names GPU N
        return _gpu_count(int(m.group(1)), ngpu, spec)
    m = re.fullmatch(r"(?:cuda:)?(\d+(?:\s*,\s*\d+)*)", s)
    if m:
        return _gpus([int(x) for x in m.group(1).split(",")], ngpu, spec)
    raise ConfigError(f"{key}={spec!r} is not understood; use auto, cpu:N, gpu:N (N GPUs), "
                      "cuda, cuda:0,1 or a list of GPU indices like [0, 1]")


def _gpu_count(n: int, ngpu: int, spec: Any) -> List[torch.device]:
    """`gpu:N`: the first N visible GPUs."""
    if n < 1:
        raise ConfigError(f"trainer.devices={spec!r} asks for {n} GPUs; use gpu:1 or more")
    if n > ngpu:
        have = (f"this machine has {ngpu} visible GPU(s)" if ngpu
                else "no CUDA GPU is visible here; use trainer.devices=cpu:2 or auto")
        raise ConfigError(f"trainer.devices={spec!r} asks for {n} GPUs ({have})")
    return [torch.device("cuda", i) for i in range(n)]


def _cpus(n: int) -> List[torch.device]:
    return [torch.device("cpu")] * n


def _gpus(indices: Sequence[int], ngpu: int, spec: Any) -> List[torch.device]:
    if len(set(indices)) != len(indices):
        raise ConfigError(f"trainer.devices={spec!r} lists a GPU twice; list each index once")
    for i in indices:
        if i < 0 or i >= ngpu:
            have = (f"this machine has {ngpu} visible GPU(s): 0..{ngpu - 1}" if ngpu
                    else "no CUDA GPU is visible here; use trainer.devices=cpu:2 or auto")
            hint = (f"; for {i} GPUs write gpu:{i}" if re.fullmatch(r"cuda:\d+", str(spec))
                    else "")
            raise ConfigError(f"trainer.devices={spec!r}: GPU {i} does not exist ({have}){hint}")
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


def free_port(addr: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


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


def slurm_job_id(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The Slurm job this process runs in (None outside Slurm): what `scontrol requeue` takes."""
    return environ.get("SLURM_JOB_ID") or None


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
