"""The tests' waits end on a stall, not on a wall time (tests/_progress.py): a process that works
longer than the stall bound is waited for, one that sleeps (as a hung collective does) is
ended after the bound. test_ddp.py failed at load 35 on a fixed 120 + 60 s join."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests._progress import Stalled, cpu_s, session_pids, wait_while_progressing

pytestmark = pytest.mark.timeout(120)

_BUSY = "import time\nt = time.time()\nwhile time.time() < t + 5: pass\n"


def _wait(proc: subprocess.Popen, stall_s: float, min_cpu_s: float) -> float:
    return wait_while_progressing(lambda s: _ended(proc, s), lambda: [proc.pid],
                                  stall_s=stall_s, min_cpu_s=min_cpu_s)


def _ended(proc: subprocess.Popen, poll_s: float) -> bool:
    try:
        proc.wait(timeout=poll_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_working_process_is_waited_for_past_the_stall_bound():
    proc = subprocess.Popen([sys.executable, "-c", _BUSY])
    assert _wait(proc, stall_s=2, min_cpu_s=0.01) >= 5  # 5 s of work, never 2 s without
    assert proc.returncode == 0


def test_a_sleeping_process_is_a_stall():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        with pytest.raises(Stalled, match="no progress for"):
            _wait(proc, stall_s=2, min_cpu_s=0.5)
        assert time.monotonic() - t0 < 30
        assert session_pids(proc.pid) == [proc.pid]  # its session: itself alone
        assert cpu_s([proc.pid]) < 0.5
    finally:
        proc.kill()
        proc.wait()


def test_workers_in_sessions_of_their_own_count_as_the_jobs_progress():
    """paratrain's workers lead sessions of their own (launch/worker.py): an idle launcher whose
    worker works is not a stall."""
    worker = "import os, time\nos.setsid()\nt = time.time()\nwhile time.time() < t + 5: pass\n"
    launcher = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {worker!r}])\n"
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    waited = wait_while_progressing(lambda s: _ended(proc, s), lambda: session_pids(proc.pid),
                                    stall_s=2, min_cpu_s=0.01)
    assert waited >= 5 and proc.returncode == 0
