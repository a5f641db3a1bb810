"""What clusters do to jobs, with real processes: the whole job SIGKILLed at random moments
(before its first snapshot, during a snapshot write, later), SIGTERM to the launcher, SIGUSR1 to
one worker, a second signal during the stop, Slurm's requeue. After each, the very same command
completes, and the final run is bit-identical to one that was never stopped.

Random moments come from a seeded generator; the seed is in the test id, so a failure replays."""

from __future__ import annotations

import os
import random
import signal
import stat
import time

import pytest

from tests.conftest import cli_error, finish, run_cli, start_cli
from tests.distributed._snapshot_helpers import (
    args_for,
    assert_bit_identical,
    committed_steps,
    kill_job,
    reference_run,
    steps_logged,
    wait_for,
    worker_pids,
)

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

LONG = {"trainer.max_steps": 40, "checkpoint.every_steps": 8}


def _ref(tmp_path_factory, corpus_dir, cache_dir, **extra):
    return reference_run(tmp_path_factory, corpus_dir, cache_dir, **{**LONG, **extra})


@pytest.mark.parametrize("strategy,seed", [("auto", 11), ("fsdp", 12)])  # auto: ddp here
def test_kill_campaign_the_same_command_always_completes(tmp_path, tmp_path_factory, monkeypatch,
                                                         capsys, corpus_dir, cache_dir, strategy,
                                                         seed):
    """SIGKILL of the whole job: before the first snapshot (the same command then starts over
    from step 0, saying so), at a random moment after the job started (possibly mid-snapshot),
    and after a committed snapshot; then the same command runs to the end."""
    rng = random.Random(seed)
    chosen = {"trainer.strategy": strategy} if strategy != "auto" else {}
    extra = {**LONG, **chosen}
    ref = _ref(tmp_path_factory, corpus_dir, cache_dir, **chosen)
    args = args_for(corpus_dir, cache_dir, "campaign", **extra)
    run_dir, ck = tmp_path / "runs" / "campaign", tmp_path / "runs" / "campaign" / "checkpoints"

    # 1. before the first snapshot: some steps logged, nothing committed
    proc = start_cli(args, tmp_path)
    wait_for(lambda: steps_logged(run_dir) >= rng.randint(1, 5), proc, what="a few steps")
    kill_job(proc)
    if not committed_steps(ck):  # (a fast machine may have committed step 8 already)
        proc = start_cli(args, tmp_path)  # starts over: the old log goes, new lines come
        wait_for(lambda: not (run_dir / "metrics.jsonl").exists(), proc, what="a fresh start")
        wait_for(lambda: steps_logged(run_dir) >= 1, proc, what="the rerun's first step")
        err = kill_job(proc)
        assert "holds an unfinished run with no committed snapshot" in err, err[-2000:]
        assert "starting over from step 0" in err
        assert not committed_steps(ck)

    # 2. at a random moment: anywhere in start-up, a step or a snapshot write
    for _ in range(1):
        proc = start_cli(args, tmp_path)
        time.sleep(rng.uniform(0.5, 6.0))
        if proc.poll() is None:
            kill_job(proc)
        else:
            proc.communicate()

    # 3. after a committed snapshot (if the job is not already finished)
    if not (run_dir / "summary.json").exists():
        proc = start_cli(args, tmp_path)
        wait_for(lambda: committed_steps(ck) or (run_dir / "summary.json").exists(), proc,
                 what="a committed snapshot")
        if proc.poll() is None:
            kill_job(proc)

    r = run_cli(args, cwd=tmp_path, timeout=240)  # the same command, once more
    if (run_dir / "summary.json").exists() and r.returncode == 2:
        pytest.skip("the job finished between two kills (a very fast machine)")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bit_identical(run_dir, ref)  # metrics and sample logs begun anew, not doubled
    monkeypatch.chdir(tmp_path)  # a finished run is still never overwritten (in this process)
    assert "already holds a finished run" in cli_error(capsys, args)


def _stop_and_resume(tmp_path, ref, args, run_dir, send, expect_rc, min_step):
    proc = start_cli(args, tmp_path)
    wait_for(lambda: steps_logged(run_dir) >= min_step, proc, what=f"step {min_step}")
    logged = steps_logged(run_dir)
    send(proc)
    t0 = time.monotonic()
    r = finish(proc, timeout=120)
    assert r.returncode == expect_rc, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60
    newest = committed_steps(run_dir / "checkpoints")[-1]
    # the step in flight finished, then every rank stopped at the same step, with a snapshot
    assert logged <= newest <= logged + 3, (logged, newest)
    assert f"received: stopping after step {newest}" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (run_dir / "summary.json").exists() and not (run_dir / "model").exists()
    again = run_cli(args, cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {newest} " in again.stderr
    assert_bit_identical(run_dir, ref)
    return r


def test_sigterm_to_the_launcher_commits_a_snapshot_and_resumes(tmp_path, tmp_path_factory,
                                                                corpus_dir, cache_dir):
    ref = _ref(tmp_path_factory, corpus_dir, cache_dir)
    args = args_for(corpus_dir, cache_dir, "term", **LONG)
    step = random.Random(3).randint(5, 25)
    r = _stop_and_resume(tmp_path, ref, args, tmp_path / "runs" / "term",
                         lambda p: os.kill(p.pid, signal.SIGTERM), 128 + signal.SIGTERM, step)
    assert "paratrain: stopped by SIGTERM after step" in r.stderr


# pp: a pipeline of 2 stages (the signal reaches the last stage's process only)
@pytest.mark.parametrize("layout", [{}, {"model.num_layers": 4, "trainer.batch_size": 2,
                                         "trainer.pipeline_parallel": 2}], ids=["ddp", "pp"])
def test_sigusr1_to_one_worker_stops_every_rank(tmp_path, tmp_path_factory, corpus_dir,
                                                cache_dir, layout):
    ref = _ref(tmp_path_factory, corpus_dir, cache_dir, **layout)

    def usr1_to_worker_1(proc):
        os.kill(worker_pids(proc.pid)[-1], signal.SIGUSR1)
    r = _stop_and_resume(tmp_path, ref, args_for(corpus_dir, cache_dir, "usr1",
                                                 **{**LONG, **layout}),
                         tmp_path / "runs" / "usr1", usr1_to_worker_1, 128 + signal.SIGUSR1,
                         random.Random(4).randint(9, 25))
    assert "paratrain: stopped by SIGUSR1 after step" in r.stderr


def test_a_second_signal_exits_at_once_and_the_previous_snapshot_holds(
        tmp_path, tmp_path_factory, corpus_dir, cache_dir):
    ref = _ref(tmp_path_factory, corpus_dir, cache_dir)
    args = args_for(corpus_dir, cache_dir, "twice", **LONG)
    run_dir = tmp_path / "runs" / "twice"
    proc = start_cli(args, tmp_path)
    wait_for(lambda: committed_steps(run_dir / "checkpoints") and steps_logged(run_dir) >= 12,
             proc, what="a committed snapshot")
    os.killpg(proc.pid, signal.SIGTERM)  # every process, as Slurm signals a job step
    time.sleep(1.05)  # past the window in which copies of one signal count once
    os.killpg(proc.pid, signal.SIGTERM)
    r = finish(proc, timeout=30)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    again = run_cli(args, cwd=tmp_path, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step" in again.stderr
    assert_bit_identical(run_dir, ref)


def test_requeue_under_slurm(tmp_path, corpus_dir, cache_dir):
    """distributed.requeue=true: after the stop's snapshot, `scontrol requeue $SLURM_JOB_ID`
    (here a stand-in scontrol on PATH that records its arguments: no Slurm on this machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    args = args_for(corpus_dir, cache_dir, "requeue",
                    **{**LONG, "distributed.requeue": "true"})
    run_dir = tmp_path / "runs" / "requeue"
    proc = start_cli(args, tmp_path, env=env)
    wait_for(lambda: steps_logged(run_dir) >= 5, proc, what="step 5")
    os.kill(proc.pid, signal.SIGUSR1)
    r = finish(proc, timeout=120)
    assert r.returncode == 128 + signal.SIGUSR1, r.stderr[-3000:]
    assert calls.read_text().split() == ["requeue", "4242"]
    assert "requeued Slurm job 4242" in r.stderr
    assert committed_steps(run_dir / "checkpoints")


def test_requeue_outside_slurm_is_refused(tmp_path, monkeypatch, capsys, corpus_dir, cache_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    line = cli_error(capsys, args_for(corpus_dir, cache_dir, "x",
                                      **{"distributed.requeue": "true"}))
    assert line.startswith("paratrain: error: distributed.requeue=true requeues a Slurm job")


def test_sigterm_to_a_one_process_run(tmp_path, tmp_path_factory, corpus_dir, cache_dir):
    """One device: the run is in the CLI's own process, which notes the signal itself."""
    one = {"trainer.devices": "cpu"}
    ref = _ref(tmp_path_factory, corpus_dir, cache_dir, **one)
    r = _stop_and_resume(tmp_path, ref, args_for(corpus_dir, cache_dir, "one", **LONG, **one),
                         tmp_path / "runs" / "one", lambda p: os.kill(p.pid, signal.SIGTERM),
                         128 + signal.SIGTERM, random.Random(5).randint(5, 25))
    assert "UserWarning" not in r.stderr, r.stderr[-2000:]
