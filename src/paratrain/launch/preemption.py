"""Stop signals: every rank finishes the optimizer step in flight, a snapshot is committed, and
the job leaves with exit code 128 + the signal number; the same command then resumes.

SIGTERM is what spot instances, Kubernetes and Slurm at the time limit send, SIGUSR1 is Slurm's
warning (`#SBATCH --signal=USR1@90`), SIGINT is Ctrl-C. A signal may reach one rank, every rank
(a terminal and Slurm signal every process), or only the launcher, whose elastic agent passes it
on. A rank only notes it here; the loop agrees on it at a step boundary (one small all-reduce
on host memory, started at one boundary and read at the next, so it runs during a step:
runtime/host_group.py), so every rank stops after the same step, the one in flight or the one
after it, and writes the same snapshot.

Copies of one signal arrive within moments of each other (the terminal's and the agent's, or
Slurm's and the agent's): they count once. One that comes `FANOUT_S` or more after the first is
a second request and ends the process at once. The previous committed snapshot survives that:
a snapshot counts only once its marker is written, last.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Any, Optional, TypeVar

from .. import errors

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
FANOUT_S = 1.0


_H = TypeVar("_H", bound="_StopHandlers")


class _StopHandlers:
    """The stop signals' handlers of one process, for as long as it needs them: installed from
    the main thread only (Python allows no other), put back by `restore`. `signum` is the first
    signal that came (0 while none did), `_first_at` when."""

    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def install(self: _H) -> _H:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)
        self._previous = {}

    def _is_repeat(self, now: float) -> bool:
        """A second request: another signal, FANOUT_S or more after the first."""
        return bool(self.signum) and now - self._first_at >= FANOUT_S

    def _on_signal(self, signum: int, frame: Any) -> None:
        raise NotImplementedError


class StopSignals(_StopHandlers):
    """In a rank: notes the first stop signal (the loop acts on it between steps); a second
    one, later, raises `errors.Interrupted` at once."""

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
        elif self._is_repeat(now):
            raise errors.Interrupted(signum)


class ForwardToWorkers(_StopHandlers):
    """In a process that launched workers with the elastic agent: the first stop signal goes on
    to them, and the agent keeps waiting while they finish their step, commit a snapshot and
    return (so their results come back as for a finished run). A second signal, or workers that
    have not returned `grace_s` after the first, raise the agent's own SignalException: it then
    stops them at once. (The agent itself must not handle these signals: it would stop the
    workers before they return; see `AGENT_SIGNALS`.)"""

    def __init__(self, grace_s: float):
        super().__init__()
        self.grace_s = grace_s
        self._timer: Optional[threading.Timer] = None

    def restore(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        super().restore()

    def _on_signal(self, signum: int, frame: Any) -> None:
        import multiprocessing
        import os

        from torch.distributed.elastic.multiprocessing import SignalException
        now = time.monotonic()
        workers = multiprocessing.active_children()
        if not self.signum and workers:
            self.signum, self._first_at = signum, now
            for p in workers:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass
            self._timer = threading.Timer(self.grace_s, os.kill, (os.getpid(), signum))
            self._timer.daemon = True
            self._timer.start()
        elif not self.signum or self._is_repeat(now):  # no workers yet, or a second request
            sig = signal.Signals(signum)
            raise SignalException(f"process {os.getpid()} got {sig.name}", sigval=sig)


class _Noted(_StopHandlers):
    """Notes that a stop signal came, and nothing more."""

    def __init__(self) -> None:
        super().__init__()
        self.came = threading.Event()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.came.set()


def await_stop_signal(timeout_s: float) -> bool:
    """Whether a stop signal reaches this process within `timeout_s` (the handlers are put
    back after). A rank that stopped only because another rank was signalled waits here for
    its own: in an elastic job that is how its agent says the stop was a membership change."""
    noted = _Noted().install()
    try:
        deadline = time.monotonic() + timeout_s
        while not noted.came.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)  # a signal cuts the sleep short; its handler runs here
        return noted.came.is_set()
    finally:
        noted.restore()


# The signals torch's agent may keep handling itself (its default adds SIGTERM and SIGINT,
# which ForwardToWorkers takes instead): LaunchConfig.signals_to_handle.
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def requeue_slurm_job(job_id: str) -> str:
    """`scontrol requeue JOB`: Slurm puts the job back in the queue; its next start runs the same
    command, which resumes. Returns one line for the log (what happened, or why not)."""
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not requeue Slurm job {job_id}: {e}"
    if r.returncode != 0:
        why = (r.stderr or r.stdout).strip().splitlines()
        return f"could not requeue Slurm job {job_id}: {why[0] if why else r.returncode}"
    return f"requeued Slurm job {job_id} (scontrol requeue): its next start resumes"


def stop_line(signum: int, step: Optional[int]) -> str:
    """What a rank logs once the job has agreed to stop."""
    where = f"after step {step}" if step else "before the first step"
    return f"{signal_name(signum)} received: stopping {where}"
