"""Snapshots with real processes and real storage: a killed job resumes bit-identical, a torn or
damaged snapshot is never used, 2 workers' snapshot continues on 1 worker without repeating or
skipping a sample, and snapshots on an S3-compatible server (moto on loopback) resume too.

Every comparison is against one uninterrupted run of the same configuration (CPU, fp32)."""

from __future__ import annotations

import os
import signal

import pytest

from paratrain.checkpoint import inspection
from paratrain.checkpoint import store as snapshot
from tests.conftest import read_metrics, read_summary, run_cli, start_cli
from tests.distributed._s3 import SECRET
from tests.distributed._snapshot_helpers import (
    args_for,
    assert_bit_identical,
    committed_steps,
    interrupted_copy,
    kill_job,
    killed_and_rerun,
    reference_run,
    samples,
    steps_logged,
    wait_for,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def ref(tmp_path_factory, corpus_dir, cache_dir):
    return reference_run(tmp_path_factory, corpus_dir, cache_dir)


def test_reference_run_keeps_the_last_committed_snapshots(ref):
    """every_steps=4 over 16 steps: 4, 8, 12 (none after the last step), keep_last=3."""
    assert committed_steps(ref / "checkpoints") == [4, 8, 12]
    s = read_summary(ref)
    assert s["resumed_from"] is None
    assert s["snapshots"]["count"] == 3 and s["snapshots"]["async"] is True


def test_killed_job_rerun_resumes_bit_identical(tmp_path, ref, corpus_dir, cache_dir):
    args = args_for(corpus_dir, cache_dir, "killed")
    run_dir = tmp_path / "runs" / "killed"
    newest = killed_and_rerun(
        args, tmp_path, run_dir,
        lambda: committed_steps(run_dir / "checkpoints") and steps_logged(run_dir) >= 10,
        "step 10 with a committed snapshot")
    assert read_summary(run_dir)["resumed_from"]["step"] == newest
    assert_bit_identical(run_dir, ref)


def test_kill_during_a_snapshot_write_uses_the_previous_one(tmp_path, ref, corpus_dir, cache_dir):
    """A snapshot every step; the job is frozen (SIGSTOP) while a step folder exists without its
    commit marker, checked, then SIGKILLed: the torn folder is ignored and removed, the previous
    committed snapshot is intact and the rerun continues from it."""
    args = args_for(corpus_dir, cache_dir, "torn", **{"checkpoint.every_steps": 1})
    run_dir = tmp_path / "runs" / "torn"
    ck = run_dir / "checkpoints"

    def torn():
        done = committed_steps(ck)
        open_ = [int(p.name[5:]) for p in ck.glob("step-*")
                 if not (p / "committed.json").exists()]
        return done and open_ and max(open_) > done[-1] and (done[-1], max(open_))

    proc = start_cli(args, tmp_path)
    caught = None
    for _ in range(100):
        wait_for(torn, proc, poll=0.001, what="a snapshot being written")
        os.killpg(proc.pid, signal.SIGSTOP)
        caught = torn()  # still torn once everything is frozen?
        if caught:
            break
        os.killpg(proc.pid, signal.SIGCONT)
    kill_job(proc)
    assert caught, "never froze the job while a snapshot was being written"
    last_good, torn_step = caught
    store = snapshot.Store(str(ck))
    assert store.problem(store.url(last_good)) is None  # intact, complete
    assert store.marker(store.url(torn_step)) is None  # not committed: not a snapshot

    r = run_cli(args, cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {last_good} " in r.stderr
    assert any("removing snapshot folder" in line and snapshot.step_dir(torn_step) in line
               for line in r.stderr.splitlines()), r.stderr
    assert_bit_identical(run_dir, ref)


def test_truncated_and_corrupt_snapshots_are_skipped_with_a_warning(tmp_path, ref, corpus_dir,
                                                                     cache_dir):
    run_dir = interrupted_copy(ref, tmp_path / "runs" / "damaged", keep_until=12)
    ck = run_dir / "checkpoints"
    shard = ck / "step-0000012" / "__0_0.distcp"  # cut short: caught by the recorded sizes
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    meta = ck / "step-0000008" / ".metadata"  # same size, garbage: caught by its checksum
    meta.write_bytes(b"\x00" * meta.stat().st_size)

    r = run_cli(args_for(corpus_dir, cache_dir, "damaged"), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [line for line in r.stderr.splitlines() if "skipping snapshot" in line]
    fallback = "falling back to runs/damaged/checkpoints/step-0000004"
    assert any("step-0000012" in w and "__0_0.distcp has" in w and w.endswith(fallback)
               for w in warnings), r.stderr
    assert any("step-0000008" in w and ".metadata does not match its checksum" in w
               and w.endswith(fallback) for w in warnings), r.stderr
    assert "resumed from step 4 " in r.stderr
    assert_bit_identical(run_dir, ref)


def test_two_workers_snapshot_continues_on_one_worker(tmp_path, ref, corpus_dir, cache_dir):
    """Same global batch (8 = 4 x 2 = 8 x 1): DCP reshards model and optimizer, the sampler
    continues the global order; the recorded sample ids of every step match the uninterrupted
    2-worker run, so none is repeated or skipped."""
    run_dir = interrupted_copy(ref, tmp_path / "runs" / "shrunk", keep_until=8)
    r = run_cli(args_for(corpus_dir, cache_dir, "shrunk", **{
        "trainer.devices": "cpu:1", "trainer.batch_size": 8}), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 8 " in r.stderr and "saved by 2 worker(s), resharded to 1" \
        in r.stderr
    s = read_summary(run_dir)
    assert s["world_size"] == 1 and s["resumed_from"]["world_size"] == 2

    got, want = samples(run_dir), samples(ref)
    assert sorted(got) == list(range(1, 17))
    assert got == want
    every = [i for step in sorted(got) for i in got[step]]
    assert len(every) == len(set(every)) == 16 * 8  # one epoch is longer: nothing twice

    losses, ref_losses = read_metrics(run_dir), read_metrics(ref)
    assert [m["step"] for m in losses] == [m["step"] for m in ref_losses]
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(losses, ref_losses)) < 1e-5


# ---- object storage ----------------------------------------------------------------------------
def test_snapshots_on_s3_resume_after_a_kill(tmp_path, ref, corpus_dir, cache_dir, s3_server,
                                             monkeypatch):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)  # for this process's own look at the bucket
    url = "s3://snapshots/runs/s3run"
    args = args_for(corpus_dir, cache_dir, "s3run", **{"checkpoint.dir": url})
    run_dir = tmp_path / "runs" / "s3run"
    store = snapshot.Store(url)

    proc = start_cli(args, tmp_path, env=s3_server)
    # the local log first: listing the bucket on every poll is slow enough to miss the window
    wait_for(lambda: steps_logged(run_dir) >= 10 and any(s.committed for s in store.snapshots()),
             proc, what="a committed snapshot on S3")
    kill_job(proc)
    newest = [s.step for s in store.snapshots() if s.committed][-1]

    r = run_cli(args, cwd=tmp_path, timeout=240, env=s3_server)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {newest} ({url}/{snapshot.step_dir(newest)})" in r.stderr
    assert_bit_identical(run_dir, ref)
    assert [s.step for s in store.snapshots() if s.committed] == [4, 8, 12]
    assert not (run_dir / "checkpoints").exists()  # everything went to the bucket
    described = inspection.describe(store.url(12))
    assert described["usable"] and described["world_size"] == 2 and described["tensors"]
    # credentials stay in the environment: never in the run dir, the log or the snapshot
    assert SECRET not in r.stderr + r.stdout
    for p in run_dir.rglob("*"):
        if p.is_file():
            assert SECRET.encode() not in p.read_bytes(), p
    assert SECRET.encode() not in store.fs.cat_file(f"{store.path}/step-0000012/committed.json")
