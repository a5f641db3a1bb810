"""Stalled ranks: name them, show where everyone was, and end the job instead of hanging.

A collective that times out says only "timed out"; it cannot say *who* did not come. So every
rank runs a small thread that, once a second, publishes a heartbeat (a counter and where its loop
is: step, micro-step, phase) to the job's key-value store and reads everyone else's. From those:

- a rank whose heartbeat stopped changing is stopped or frozen (SIGSTOP, a hung driver, swap);
- a rank that is alive but *behind* the others (still loading data while they wait in backward)
  is stuck (a deadlock, a data loader that never returns).

When the job stalls (a collective times out on this rank, or nobody has moved for
`distributed.timeout_s`), the first rank to notice publishes a verdict naming the stalled ranks
and the step; every live rank then writes its Python stack (faulthandler, all threads) to
`<run dir>/stacks/rank-N.txt`; the job ends with that verdict as its error. A rank whose training
thread is still stuck some seconds later exits by itself, so the job ends within timeout_s + 30 s.

Clocks are never compared across machines: each observer notes, on its own monotonic clock, when
it last saw another rank's heartbeat change.
"""

from __future__ import annotations

import datetime as _dt
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from ..dist import DistEnv
from ..errors import ParatrainError, TrainingError

# Within one step, the order in which a rank passes these; "behind" compares (step, micro, phase).
PHASES = ("setup", "data", "rollout", "forward", "backward", "optimizer", "eval")


class Progress:
    """Where this rank's loop is. The training thread assigns one tuple (atomic under the GIL);
    the watchdog thread reads it: nothing per step costs more than that."""
    __slots__ = ("position",)

    def __init__(self) -> None:
        self.position: tuple[int, int, str] = (0, 0, "setup")

    def at(self, step: int, phase: str, micro: int = 0) -> None:
        self.position = (step, micro, phase)


def _order(pos: tuple) -> tuple[int, int, int]:
    step, micro, phase = pos
    return step, micro, PHASES.index(phase) if phase in PHASES else 0


def _where(pos: tuple) -> str:
    step, micro, phase = pos
    return f"step {step} ({phase}{f', micro-step {micro + 1}' if micro else ''})"


class Watchdog:
    """One per rank; `start()` gives an inert one for single-process runs."""

    def __init__(self, env: DistEnv, run_dir: Path, timeout_s: float, store: Any = None,
                 beat_s: float = 1.0, grace_s: float = 10.0):
        self.env, self.run_dir, self.timeout_s = env, Path(run_dir), timeout_s
        self.beat_s, self.grace_s = beat_s, grace_s
        self.progress = Progress()
        self._store = store
        self._lock = threading.Lock()  # one store client, two threads
        self._seen: dict[int, dict] = {}  # rank -> {raw, alive_at, moved_at, pos, pid, host, node}
        self._stop = threading.Event()
        self._verdict: Optional[dict] = None
        self.roles: dict[int, str] = {}  # said beside a rank number (a pipeline's stage)
        self._dumped = False
        self._thread = threading.Thread(target=self._run, name="paratrain-watchdog", daemon=True)

    @classmethod
    def start(cls, env: DistEnv, run_dir: Path, timeout_s: Optional[float] = None) -> "Watchdog":
        timeout_s = env.timeout_s if timeout_s is None else timeout_s
        if not env.distributed or not env.master_port:
            return cls(env, run_dir, timeout_s)  # inert
        import torch.distributed as dist
        base = dist.TCPStore(env.master_addr, env.master_port, None, False,
                             _dt.timedelta(seconds=max(10.0, min(timeout_s, 60.0))),
                             wait_for_workers=False)
        wd = cls(env, run_dir, timeout_s, dist.PrefixStore(f"paratrain/{env.job_id}", base),
                 beat_s=max(1.0, env.world_size / 64))
        wd._beat(0)
        wd._thread.start()
        return wd

    def watch(self, progress: Progress, roles: Optional[dict[int, str]] = None) -> None:
        """Follow the training loop's own Progress from now on; `roles`: what each rank runs
        where its number alone does not say (parallelism.roles: a pipeline's stages)."""
        self.progress = progress
        self.roles = dict(roles or {})

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.beat_s + 1)

    # ---- the training thread, on an exception ------------------------------------------------
    def explain(self, exc: BaseException) -> Optional[TrainingError]:
        """A collective timed out here: publish who stalled (or adopt a verdict already out),
        write this rank's stack, give the others a moment to write theirs; the error to raise."""
        if self._store is None or not _is_timeout(exc) and self._verdict is None:
            return None
        with self._lock:
            self._observe()
            verdict = self._verdict or self._read_verdict()
            if verdict is None:
                verdict = self._diagnose(dead_after=max(3 * self.beat_s, self.timeout_s / 2),
                                         collective=True)
                verdict = self._publish(verdict)
        self._dump(verdict, exc)
        self._await_acks(verdict)
        self._kill_frozen_here(verdict)
        return TrainingError(verdict["message"])

    # ---- the watchdog thread -----------------------------------------------------------------
    def _run(self) -> None:
        beat, stuck_since = 0, None
        while not self._stop.wait(self.beat_s):
            beat += 1
            try:
                with self._lock:
                    self._beat(beat)
                    self._observe()
                    verdict = self._verdict or self._read_verdict()
                    if verdict is None and self._stalled():
                        found = self._diagnose(dead_after=self.timeout_s, collective=False)
                        if found["stalled"]:
                            verdict = self._publish(found)
            except Exception:  # the store went away (node 0 ended): the collectives time out
                continue
            if verdict is None:
                continue
            self._dump(verdict)
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since > self.grace_s:  # training thread did not end
                self._exit(verdict)

    def _beat(self, beat: int) -> None:
        step, micro, phase = self.progress.position
        self._store.set(f"hb/{self.env.rank}", json.dumps(
            [beat, step, micro, phase, os.getpid(), socket.gethostname(), self.env.node_rank]))

    def _observe(self) -> None:
        keys = [f"hb/{r}" for r in range(self.env.world_size)]
        if not self._store.check(keys):
            return  # not every rank has started its watchdog yet
        now = time.monotonic()
        for r, raw in enumerate(self._store.multi_get(keys)):
            beat, step, micro, phase, pid, host, node = json.loads(raw)
            pos = (step, micro, phase)
            s = self._seen.get(r)
            if s is None:
                self._seen[r] = dict(raw=raw, alive_at=now, moved_at=now, pos=pos, pid=pid,
                                     host=host, node=node)
                continue
            if raw != s["raw"]:
                s.update(raw=raw, alive_at=now)
            if pos != s["pos"]:
                s.update(pos=pos, moved_at=now)

    def _stalled(self) -> bool:
        """Armed once this rank's loop runs: nobody has moved for timeout_s."""
        if self.progress.position[2] == "setup" or len(self._seen) < self.env.world_size:
            return False
        last_move = max(s["moved_at"] for s in self._seen.values())
        return time.monotonic() - last_move > self.timeout_s + self.beat_s

    def _diagnose(self, dead_after: float, collective: bool) -> dict:
        now = time.monotonic()
        seen = self._seen
        frozen = sorted(r for r, s in seen.items() if now - s["alive_at"] > dead_after)
        alive = [r for r in seen if r not in frozen]
        behind: list[int] = []
        if not frozen and alive:
            front = max(_order(seen[r]["pos"]) for r in alive)
            behind = sorted(r for r in alive if _order(seen[r]["pos"]) < front)
        stalled = frozen or behind
        waited = f"waited {self.timeout_s:.0f} s (distributed.timeout_s={self.timeout_s:g})"
        stacks = f"stacks of the live ranks: {self.run_dir / 'stacks'}"
        if stalled:
            who = f"rank{'s' if len(stalled) > 1 else ''} " + ", ".join(
                f"{r} ({self.roles[r]})" if r in self.roles else str(r) for r in stalled)
            others = [r for r in alive if r not in stalled]
            # The step the job is stuck at: where the ranks that wait are (a frozen rank's last
            # heartbeat may be older than its last step).
            step = max([seen[r]["pos"][0] for r in others] + [seen[r]["pos"][0] for r in stalled])
            last = ", ".join(f"rank {r} last seen at {_where(seen[r]['pos'])}" for r in stalled)
            if frozen:
                why = (f"no heartbeat for {now - max(seen[r]['alive_at'] for r in frozen):.0f} s,"
                       f" the process is stopped or frozen ({last})")
            else:
                why = f"alive but not moving: a deadlock, or data loading that never returns ({last})"
            waiting = (f"ranks {', '.join(map(str, others))}" if len(others) > 1 else
                       f"rank {others[0]}" if others else "the others")
            message = f"{who} stalled at step {step}: {why}; {waiting} {waited}; {stacks}"
        else:
            where = ", ".join(f"rank {r} at {_where(s['pos'])}" for r, s in sorted(seen.items()))
            message = (f"a collective timed out on rank {self.env.rank} and every rank is alive "
                       f"({where or 'no heartbeats yet'}): a deadlock or ranks calling different "
                       f"collectives; {waited}; {stacks}")
        return {"message": message, "by": self.env.rank,
                "stalled": [{"rank": r, "pid": seen[r]["pid"], "host": seen[r]["host"],
                             "node_rank": seen[r]["node"], "frozen": r in frozen}
                            for r in stalled],
                "alive": alive if alive else list(range(self.env.world_size))}

    def _publish(self, verdict: dict) -> dict:
        """First verdict wins: every rank ends with the same message."""
        if self._store.add("verdict_claim", 1) == 1:
            self._store.set("verdict", json.dumps(verdict))
        else:
            self._store.wait(["verdict"], _dt.timedelta(seconds=10))
            verdict = json.loads(self._store.get("verdict"))
        self._verdict = verdict
        return verdict

    def _read_verdict(self) -> Optional[dict]:
        if self._store.check(["verdict"]):
            self._verdict = json.loads(self._store.get("verdict"))
        return self._verdict

    # ---- reporting ---------------------------------------------------------------------------
    def _dump(self, verdict: dict, exc: Optional[BaseException] = None) -> None:
        """This rank's stack, all threads, into the run dir; once."""
        if self._dumped:
            return
        self._dumped = True
        env = self.env
        path = self.run_dir / "stacks" / f"rank-{env.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"rank {env.rank} (node {env.node_rank}, local rank {env.local_rank}, "
                        f"pid {os.getpid()}, {socket.gethostname()}) at "
                        f"{_where(self.progress.position)}\nverdict: {verdict['message']}\n\n")
                if exc is not None:
                    f.write("exception in the training thread:\n")
                    f.writelines(traceback.format_exception(exc))
                    f.write("\n")
                f.write("all threads (most recent call first):\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError:
            pass
        try:
            with self._lock:
                self._store.add("acks", 1)
        except Exception:
            pass

    def _await_acks(self, verdict: dict, limit_s: float = 5.0) -> None:
        """Let the other live ranks write their stacks before this one ends the job."""
        want = len(verdict.get("alive", ()))
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            try:
                with self._lock:
                    if self._store.add("acks", 0) >= want:
                        return
            except Exception:
                return
            time.sleep(0.1)

    def _kill_frozen_here(self, verdict: dict) -> None:
        """A stopped process ignores SIGTERM: the agent would wait 30 s before SIGKILL."""
        host = socket.gethostname()
        for s in verdict.get("stalled", []):
            if s.get("frozen") and s.get("host") == host and s.get("pid") != os.getpid():
                try:
                    os.kill(int(s["pid"]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _exit(self, verdict: dict) -> None:
        """The training thread is stuck outside any collective: end this process, leaving the
        verdict where the elastic agent looks for a worker's error."""
        err = TrainingError(verdict["message"])
        print(f"[paratrain] rank {self.env.rank}: {err}", file=sys.stderr, flush=True)
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            ErrorHandler().record_exception(err)
        except Exception:
            pass
        self._kill_frozen_here(verdict)
        os._exit(1)


def _is_timeout(exc: BaseException) -> bool:
    """A collective or store operation that gave up waiting (gloo/NCCL/c10d raise RuntimeError
    subclasses); our own errors already say what is wrong."""
    if isinstance(exc, ParatrainError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text
