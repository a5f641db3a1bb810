"""Ctrl-C as a user presses it: SIGINT to the whole process group of a 2-worker run. One line says
where it stopped and what the same command does next; exit code 130; no traceback; the same
command then resumes from the snapshot the line named."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.conftest import finish, run_cli, start_cli, tiny_overrides
from tests.distributed._snapshot_helpers import (
    committed_steps,
    steps_logged,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)


def _args(corpus_dir, cache_dir, name, **extra):
    return ["train"] + tiny_overrides(corpus_dir, cache_dir, **{
        "trainer.devices": "cpu:2", "trainer.max_steps": 120, "run.name": name, **extra})


def _interrupt(proc, run_dir, ck_dir=None):
    wait_for(lambda: steps_logged(run_dir) >= 25 and (ck_dir is None or committed_steps(ck_dir)),
             proc, timeout=150, what="25 logged steps")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    t0 = time.monotonic()
    r = finish(proc, timeout=60)
    return r, time.monotonic() - t0


def _the_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [x for x in stderr.splitlines() if not x.startswith("[paratrain] ") and x.strip()]
    assert len(lines) == 1, stderr  # one line, no torch warnings or worker noise
    assert lines[0].startswith("paratrain: interrupted after step "), stderr
    return lines[0]


@pytest.mark.slow
def test_ctrl_c_says_where_it_stopped_and_the_same_command_resumes(tmp_path, corpus_dir,
                                                                   cache_dir):
    args = _args(corpus_dir, cache_dir, "ctrlc", **{"checkpoint.every_steps": 10})
    run_dir, ck = tmp_path / "runs" / "ctrlc", tmp_path / "runs" / "ctrlc" / "checkpoints"
    r, took = _interrupt(start_cli(args, cwd=tmp_path), run_dir, ck)
    assert r.returncode == 130, r.stderr[-3000:]
    assert took < 30, took
    line = _the_line(r.stderr)
    m = re.search(r"after step (\d+) of 120; last committed snapshot: \S+step-(\d+); run the "
                  r"same command to resume from it", line)
    assert m, line
    snap = int(m.group(1))  # one step named: the one the snapshot holds
    assert int(m.group(2)) == snap
    # every rank finished its step, then the stop's own snapshot was committed (not the last
    # periodic one)
    assert snap == max(committed_steps(ck)) and snap >= 25

    again = run_cli(args, cwd=tmp_path, timeout=180)  # the very same command
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {snap} " in again.stderr, again.stderr[-3000:]
    # the token cache is reused by the launching process and, quietly, by the workers
    assert again.stderr.count("data: reusing") == 1, again.stderr[-3000:]


def test_ctrl_c_without_periodic_snapshots_still_commits_one(tmp_path, corpus_dir, cache_dir):
    proc = start_cli(_args(corpus_dir, cache_dir, "nosnap"), cwd=tmp_path)
    r, _ = _interrupt(proc, tmp_path / "runs" / "nosnap")
    assert r.returncode == 130, r.stderr[-3000:]
    line = _the_line(r.stderr)
    assert "last committed snapshot" in line and "run the same command to resume" in line, line


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(tmp_path, corpus_dir, cache_dir):
    proc = start_cli(_args(corpus_dir, cache_dir, "twice"), cwd=tmp_path)
    wait_for(lambda: steps_logged(tmp_path / "runs" / "twice") >= 25, proc, timeout=150,
             what="25 logged steps")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1.05)  # a copy of the first within a second counts as the same Ctrl-C
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    r = finish(proc, timeout=30)
    assert time.monotonic() - t0 < 10
    assert r.returncode in (130, -signal.SIGINT), r.stderr[-3000:]  # -2: killed by the second
    assert "Traceback" not in r.stderr, r.stderr
