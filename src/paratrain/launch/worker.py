"""A worker process's life under the elastic agent, apart from its training: the session it runs
in, and how it leaves.

torch's agent starts the workers of a function (what `fit()` hands it) with multiprocessing, in
the launcher's session; torchrun starts a script's workers each in a session of its own. On a
desktop kernel with scheduler autogroups (Linux's default), every session is one group that gets
an equal share of the CPU, so on a busy machine torchrun's two workers get two shares where ours
shared one (measured: 39-42% of the CPU against 55-97%). `own_session` gives each worker its own,
and ties it to the launcher's life instead, so that killing the launcher (a timeout's SIGKILL to
its process group) still ends the workers; stop signals reach them through the launcher
(preemption.ForwardToWorkers), as under torchrun.

A worker that has returned its result is done: every file is written and closed by then (the
run's own `finally` blocks), and the agent's wrapper has put the value in its queue and waited
until the launcher read it. What would still follow is the interpreter's teardown, freeing every
module of torch (and transformers): half a second or more on an idle machine, many on a busy one,
while the launcher waits for the process to end before it prints the result. The command itself
leaves the same way once it has printed the result (`cli.run`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent thread ends


def own_session() -> None:
    """Move this worker into a session (and process group) of its own, ended with SIGKILL if the
    launcher dies. A worker the launcher spawned has the kernel tie it (PR_SET_PDEATHSIG); one
    forked by the launcher's forkserver (launch/forkserver.py) is the server's child, not the
    launcher's, so a thread waits on the launcher's end of multiprocessing's pipe instead. Where
    neither can be had (not Linux), the worker stays where it is: a worker that outlived its
    launcher would train on alone."""
    parent = multiprocessing.parent_process()
    if not sys.platform.startswith("linux") or parent is None:
        return
    if os.getppid() == parent.pid:
        if not _die_with_parent():
            return
        if os.getppid() != parent.pid:  # the launcher died before the tie was made
            os._exit(1)
    else:
        threading.Thread(target=_die_with_launcher, args=(parent.sentinel,), daemon=True,
                         name="paratrain-launcher-watch").start()
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass


def _die_with_parent() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die_with_launcher(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # readable: the launcher is gone
    os.kill(os.getpid(), signal.SIGKILL)


def exit_after_result() -> None:
    """Once this worker's function has returned (successfully), end the process as soon as the
    interpreter starts to exit, skipping its teardown. Registered last, so it runs first of the
    exit hooks, after the agent's wrapper has handed the value over."""
    atexit.register(exit_now, 0)


def exit_now(code: int) -> None:
    """End this process with `code` now: log handlers and the standard streams flushed, the
    interpreter's teardown skipped (see the module docstring)."""
    logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe nobody reads any more
            pass
    os._exit(code)
