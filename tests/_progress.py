"""Waits bounded by progress, not by a wall time that assumes an idle machine.

A test that waits for worker processes used to give them a fixed wall time (120 + 60 s): on a
machine at load 35 the same healthy workers took longer and the test failed. Here a wait ends in
failure only when the processes stop working: their CPU time (user + system, read from
/proc/PID/stat, summed over the processes) has not grown by `min_cpu_s` for `stall_s` seconds.
Importing torch, training and writing all burn CPU; a deadlock (a collective that never meets)
or a sleep does not. A slow machine stretches the wait; a hung job still ends it. pytest's
timeout on the test stays as the last resort, far above.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterable

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(stat: str) -> list[str]:
    """The fields after the command name (which may hold spaces and parentheses)."""
    return stat[stat.rindex(")") + 2:].split()


def cpu_s(pids: Iterable[int]) -> float:
    """The CPU seconds these processes have used so far (0 for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            f = _stat_fields(Path(f"/proc/{pid}/stat").read_text())
        except (OSError, ValueError):
            continue
        total += int(f[11]) + int(f[12])  # utime, stime (fields 14 and 15 of stat)
    return total / _TICK


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every live process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                f = _stat_fields((entry / "stat").read_text())
                out[int(entry.name)] = (int(f[1]), int(f[3]))
            except (OSError, ValueError, IndexError):
                continue
    return out


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (a CLI started with start_new_session) and every
    descendant of process `sid` (its workers lead sessions of their own, so that they outlive
    no launcher: launch/worker.py)."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out = {pid for pid, (_, session) in procs.items() if session == sid}
    todo = list(out | ({sid} if sid in procs else set()))
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return sorted(out)


class Stalled(Exception):
    """The processes made no progress for the allowed time."""


def wait_while_progressing(finished: Callable[[float], bool], pids: Callable[[], Iterable[int]],
                           stall_s: float, min_cpu_s: float = 1.0) -> float:
    """Call `finished(poll_s)` (a wait of at most poll_s that says whether the job ended) until
    it is True; raise Stalled once `pids()` have not used `min_cpu_s` more CPU seconds for
    `stall_s` seconds. Returns the wall seconds waited."""
    seen: dict[int, float] = {}  # pid -> its CPU seconds when last seen (the gone ones count)
    t0 = time.monotonic()
    mark, mark_t = 0.0, t0
    while not finished(1.0):
        now = time.monotonic()
        for pid in pids():
            seen[pid] = max(seen.get(pid, 0.0), cpu_s([pid]))
        used = sum(seen.values())
        if used >= mark + min_cpu_s:
            mark, mark_t = used, now
        elif now - mark_t > stall_s:
            raise Stalled(f"no progress for {now - mark_t:.0f} s (CPU time {used:.1f} s, after "
                          f"{now - t0:.0f} s in all)")
    return time.monotonic() - t0


def join_while_progressing(ctx, stall_s: float = 90) -> float:
    """Join torch.multiprocessing's spawned workers (`start_processes(..., join=False)`) while
    they work; kill them and fail once they have made no progress for `stall_s` s. A worker's
    exception is raised as `ctx.join` raises it."""
    import pytest
    try:
        return wait_while_progressing(lambda poll_s: ctx.join(timeout=poll_s), ctx.pids,
                                      stall_s=stall_s)
    except Stalled as e:
        for p in ctx.processes:
            p.kill()
        pytest.fail(f"the workers {ctx.pids()}: {e}")
