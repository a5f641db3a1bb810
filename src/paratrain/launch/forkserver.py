"""Workers forked from a server that has already imported what they need, not spawned cold.

A spawned worker is a fresh interpreter: before anything else it imports torch, paratrain and,
for a Hugging Face model, transformers — 2-5 s per worker that came after the launcher's own
imports and data preparation (benchmarks/startup.py). multiprocessing's forkserver does those
imports once, in a process `start` opens at the very beginning of a command, while the launcher
imports torch and prepares the data on another core; the elastic agent then forks every worker
(and a restart's workers) from it with all of that loaded.

A forked worker has the server's environment — the launcher's as it was when the server started
— plus the agent's rank variables. `worker_start` says whether that still holds at launch time:
variables the launcher added since are handed to the workers, which set them on arrival
(`with_environ`); if a variable the server started with has changed or gone (a notebook that
edits os.environ between two fits), the imported modules may have read the old value, so that
launch spawns its workers cold as before. Torch-free: the CLI opens the server before it imports
torch.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..config.model_folder import model_config
from ..errors import ConfigError

# The environment this process's server started with; None: no server started here. One per
# process, as multiprocessing's forkserver (which it describes) is one per process.
_server_environ: Optional[dict[str, str]] = None


@dataclass(frozen=True)
class WorkerStart:
    """How one launch starts its workers."""
    method: str  # multiprocessing's start method: "forkserver" or "spawn"
    environ: Mapping[str, str] = field(default_factory=dict)  # set in each worker on arrival


SPAWN = WorkerStart("spawn")
# The signals that reach every process of a job (Ctrl-C, Slurm's SIGTERM, a requeue's SIGUSR1):
# the server ignores them, since a server that died could not tell the agent how its workers
# ended (multiprocessing would report exit code 255 for workers that are still training).
_JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGQUIT)
# trainer.devices naming one device (gpu:N counts GPUs, as cpu:N counts workers; cuda:N names GPU N)
_ONE_DEVICE = re.compile(r"cpu(:1)?|gpu:1|(cuda:)?\d+")


def start(cfg: Any) -> None:
    """Open the server now, importing what a worker of `cfg` needs (`worker_modules`), once per
    process: later calls keep the first server, whose imports a fresh one would only repeat."""
    global _server_environ
    handlers = {sig: signal.getsignal(sig) for sig in _JOB_SIGNALS}
    if _server_environ is not None or None in handlers.values() \
            or threading.current_thread() is not threading.main_thread():
        return  # (signal handlers set outside Python, or not ours to set: workers are spawned)
    multiprocessing.get_context("forkserver").set_forkserver_preload(worker_modules(cfg))
    _server_environ = dict(os.environ)
    for sig in _JOB_SIGNALS:  # ignored from its first instruction on (exec keeps SIG_IGN)
        signal.signal(sig, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()  # starts it; it imports in the background
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def start_for(cfg: Any) -> None:
    """The command's first act (before torch loads), where it will likely start workers here:
    a config that cannot be read is left to the Trainer to report, as without the server."""
    try:
        if may_start_workers(cfg):
            start(cfg)
    except ConfigError:
        pass


def may_start_workers(cfg: Any) -> bool:
    """A guess without torch: workers start here unless a launcher (torchrun, srun) made this
    process one rank, or the run has one device on one node. A wrong guess costs only speed."""
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        return False
    devices, d = cfg.trainer.devices, cfg.distributed
    if isinstance(devices, int):  # N devices
        one = devices == 1
    elif hasattr(devices, "__iter__") and not isinstance(devices, str):  # GPU indices
        one = len(list(devices)) == 1
    else:
        one = bool(_ONE_DEVICE.fullmatch(str(devices).strip().lower()))
    return not (one or cfg.trainer.strategy == "dp") or d.max_nodes > 1


def stop() -> None:
    """End this process's server at once: the CLI's last act, when nothing more will be launched.
    Left to notice the command's exit, the server would first free every module of torch and
    transformers (a second on an idle machine) while holding the command's output pipes open."""
    global _server_environ
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if _server_environ is None or pid is None:
        return
    _server_environ = None
    try:
        os.kill(pid, signal.SIGKILL)  # idle: every worker it forked has ended
    except ProcessLookupError:
        pass


def worker_start() -> WorkerStart:
    """Fork from this process's server where a forked worker would be what a spawned one is."""
    if _server_environ is None:
        return SPAWN
    now = os.environ
    if any(now.get(key) != value for key, value in _server_environ.items()):
        return SPAWN
    return WorkerStart("forkserver", {k: v for k, v in now.items() if k not in _server_environ})


def with_environ(environ: Mapping[str, str], entrypoint: Callable[..., Any], *args: Any) -> Any:
    """A worker's first act: the job's signals back to Python's defaults (a forked worker
    inherits the server's ignoring them) and the launcher's later variables (the agent's rank
    variables win)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in _JOB_SIGNALS[1:]:
        signal.signal(sig, signal.SIG_DFL)
    for key, value in environ.items():
        os.environ.setdefault(key, value)
    return entrypoint(*args)


# What every worker imports on its way to its first step whatever it trains, beside the
# trainer: torch's optimizer imports torch._dynamo when it takes its first parameters, the
# snapshotter torch.distributed.checkpoint and fsspec, the model files safetensors (~0.8 s of
# CPU that each worker paid again when the server left them out).
EVERY_WORKER = ("torch._dynamo", "torch.distributed.checkpoint", "fsspec", "safetensors.torch")


def worker_modules(cfg: Any) -> list[str]:
    """What a worker of this config imports before its first step. A name that does not import
    is skipped by the server (its worker then fails as a spawned one would)."""
    spec = cfg.task_spec
    modules = ["paratrain.trainer", *EVERY_WORKER, spec.task.split(":")[0],
               f"paratrain.models.{cfg.model.arch}"]  # (models/ imports its arch when built)
    if spec.pretrained:
        kind = str(model_config(cfg.model.path).get("model_type", "")).replace("-", "_")
        modules += ["transformers", "transformers.modeling_utils"]
        if re.fullmatch(r"[a-z0-9_]+", kind):
            modules.append(f"transformers.models.{kind}.modeling_{kind}")
        if cfg.model.lora.r:
            modules.append("peft")
    return modules
