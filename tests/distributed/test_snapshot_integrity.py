"""Snapshots you can trust, with real worker processes and real storage (issue 24):

- a shard whose bytes changed after it was written (a bit flip: same size) is caught by its
  checksum at resume, skipped with one line for the previous snapshot, and the run ends
  bit-identical to an uninterrupted one; `paratrain checkpoint verify` names the file (exit 1)
  and passes a good folder (exit 0);
- a snapshot that cannot be written ("disk full": a per-process file-size limit, RLIMIT_FSIZE,
  inherited by the launcher's workers) loses nothing, and the run stops after
  `checkpoint.max_failed_saves` in a row; the same command then completes bit-identical;
- on S3 (moto on loopback, behind a proxy that refuses one shard upload with 503 SlowDown): the
  refused upload is retried by s3fs/botocore and the snapshot commits; a final model/ that
  cannot be written leaves a snapshot of the last step, and the same command writes the model
  without training again; a bit flip on S3 is caught as on a local disk;
- a node-local checkpoint.dir on two nodes is refused at the first commit, in one line.

Every comparison is against one uninterrupted run of the same configuration, trained in this
session (CPU, fp32)."""

from __future__ import annotations

import shutil
import sys
import zlib

import pytest

from paratrain.checkpoint import store as snapshot
from paratrain.launch.environment import free_port
from tests.conftest import cli_run, finish_all, read_metrics, run_cli, start_cli
from tests.distributed._s3 import FlakyProxy
from tests.distributed._snapshot_helpers import (
    args_for,
    assert_bit_identical,
    committed_steps,
    interrupted_copy,
    reference_run,
)
from tests.distributed.test_multinode import node_args

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def ref(tmp_path_factory, corpus_dir, cache_dir):
    return reference_run(tmp_path_factory, corpus_dir, cache_dir)


def flipped(data: bytes) -> bytes:
    """400 bytes inverted in the middle: the size stays, the content does not."""
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0xFF for b in data[mid:mid + 400]) + data[mid + 400:]


def crc(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def file_size_limit(n: int) -> list[str]:
    """A launcher: `python -m paratrain` under RLIMIT_FSIZE = n bytes, which its workers inherit
    (a write past it fails with EFBIG: Python ignores SIGXFSZ). Nothing in paratrain knows."""
    code = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (%d, %d)); "
            "os.execv(sys.executable, [sys.executable, '-m', 'paratrain'] + sys.argv[1:])" % (n, n))
    return [sys.executable, "-c", code]


def verify(path, cwd, env=None):
    """`paratrain checkpoint verify PATH` in a process of its own: with `env` (the S3 server's),
    a client that caches nothing of what this process saw of the bucket."""
    return run_cli(["checkpoint", "verify", str(path)], cwd=cwd, timeout=120, env=env)


def test_a_bit_flip_is_caught_and_the_run_falls_back_bit_identical(tmp_path, ref, corpus_dir,
                                                                  cache_dir, capsys):
    r = cli_run(capsys, ["checkpoint", "verify", ref])
    assert r.returncode == 0, r.stdout + r.stderr
    assert [line.split()[2] for line in r.stdout.splitlines()] == ["4", "8", "12"]
    assert all(" ok: all 4 files match their crc32 checksums" in x for x in r.stdout.splitlines())

    run_dir = interrupted_copy(ref, tmp_path / "runs" / "flipped", keep_until=12)
    shard = run_dir / "checkpoints" / "step-0000012" / "__1_0.distcp"
    written = crc(shard.read_bytes())
    shard.write_bytes(flipped(shard.read_bytes()))
    now = crc(shard.read_bytes())
    assert now != written
    bad = (f"__1_0.distcp does not match its checksum (crc32 {now} now, {written} when it was "
           "written)")

    r = cli_run(capsys, ["checkpoint", "verify", run_dir])
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[3] for line in lines] == ["ok:", "ok:", "BAD:"]
    assert lines[2].endswith(bad), lines[2]
    r = cli_run(capsys, ["checkpoint", "verify", run_dir / "checkpoints" / "step-0000008"])
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1, r.stdout + r.stderr

    r = run_cli(args_for(corpus_dir, cache_dir, "flipped"), cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"warning: skipping snapshot runs/flipped/checkpoints/step-0000012: {bad}; falling "
            "back to runs/flipped/checkpoints/step-0000008") in r.stderr, r.stderr
    assert "resumed from step 8 " in r.stderr
    assert_bit_identical(run_dir, ref)


def test_a_snapshot_that_cannot_be_written_loses_nothing(tmp_path, ref, corpus_dir, cache_dir,
                                                         capsys):
    """Resumed from step 4 under a file-size limit that the model file fits and no shard does:
    the snapshots of steps 8 and 12 fail, the run stops after the second
    (checkpoint.max_failed_saves=2), step 4's snapshot is intact; the same command without the
    limit completes bit-identical."""
    model = (ref / "model" / "model.safetensors").stat().st_size
    shard = min(p.stat().st_size for p in (ref / "checkpoints").rglob("*.distcp"))
    assert model < shard
    run_dir = interrupted_copy(ref, tmp_path / "runs" / "full", keep_until=4)
    args = args_for(corpus_dir, cache_dir, "full", **{"checkpoint.max_failed_saves": 2})

    r = run_cli(args, cwd=tmp_path, timeout=240, launcher=file_size_limit((model + shard) // 2))
    assert r.returncode == 2, r.stderr[-3000:]
    warned = [x for x in r.stderr.splitlines() if "could not be written" in x]
    assert len(warned) == 2, r.stderr[-3000:]
    assert warned[0].startswith("[paratrain] warning: snapshot runs/full/checkpoints/step-0000008 "
                                "could not be written (OSError: [Errno 27] File too large")
    assert "the newest committed snapshot, runs/full/checkpoints/step-0000004, is intact" \
        in warned[0]
    assert warned[1].startswith("paratrain: error: 2 snapshot(s) in a row could not be written "
                                "(checkpoint.max_failed_saves=2), the last runs/full/checkpoints/"
                                "step-0000012: OSError: [Errno 27] File too large"), warned[1]
    assert warned[1] == r.stderr.strip().splitlines()[-1]
    ck = run_dir / "checkpoints"
    assert committed_steps(ck) == [4] and sorted(p.name for p in ck.iterdir()) == ["step-0000004"]
    assert not (run_dir / "summary.json").exists()
    assert cli_run(capsys, ["checkpoint", "verify", ck / "step-0000004"]).returncode == 0

    r = run_cli(args, cwd=tmp_path, timeout=240)  # the same command, space is back
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4 " in r.stderr
    assert_bit_identical(run_dir, ref)


def test_on_s3_retries_catches_a_bit_flip_and_writes_a_failed_model_without_training(
        tmp_path, ref, corpus_dir, cache_dir, s3_server, monkeypatch):
    for k, v in s3_server.items():
        monkeypatch.setenv(k, v)  # this process's own look at the bucket: moto directly
    url_a, url_b = "s3://snapshots/integrity/a", "s3://snapshots/integrity/b"
    args_a = args_for(corpus_dir, cache_dir, "a", **{"checkpoint.dir": url_a})
    run_a, run_b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    model = (ref / "model" / "model.safetensors").stat().st_size

    # The store refuses the first shard upload; the local disk takes no file as large as the
    # model: every snapshot goes to S3, model/ cannot be written.
    with FlakyProxy(s3_server["AWS_ENDPOINT_URL"], times=1,
                    fail_if=lambda method, path: method == "PUT" and ".distcp" in path) as proxy:
        r = run_cli(args_a, cwd=tmp_path, timeout=300, launcher=file_size_limit(model // 2),
                    env={**s3_server, "AWS_ENDPOINT_URL": proxy.url})
    assert r.returncode == 2, r.stderr[-3000:]
    refused = [p for m, p, status in proxy.log if status == 503]
    assert len(refused) == 1 and "/step-0000004/" in refused[0], proxy.log
    assert ("PUT", refused[0], 200) in proxy.log  # the same upload, retried, accepted
    assert f"snapshot {url_a}/step-0000004 committed" in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("paratrain: error: the final model could not be written to "
                           "runs/a/model (SafetensorError: ") and "File too large" in last, last
    assert last.endswith(f"the run is not finished; a snapshot of its last step, {url_a}/"
                         "step-0000016, is committed: once that is fixed, the same command "
                         "writes the model without training again"), last
    assert not (run_a / "model").exists() and not (run_a / "summary.json").exists()

    r = verify(url_a, tmp_path, env=s3_server)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [line.split()[2] for line in r.stdout.splitlines()] == ["8", "12", "16"]

    # A copy of the unfinished run whose newest snapshot changed on the store.
    store = snapshot.Store(url_a)
    store.fs.copy(f"{store.path}/", "snapshots/integrity/b/", recursive=True)
    shutil.copytree(run_a, run_b)
    key = "snapshots/integrity/b/step-0000016/__1_0.distcp"
    data = store.fs.cat_file(key)
    store.fs.pipe_file(key, flipped(data))
    bad = (f"__1_0.distcp does not match its checksum (crc32 {crc(flipped(data))} now, "
           f"{crc(data)} when it was written)")
    r = verify(url_b, tmp_path, env=s3_server)
    assert r.returncode == 1 and r.stdout.splitlines()[-1].endswith(bad), r.stdout + r.stderr

    logged = (run_a / "metrics.jsonl").read_bytes()
    r = run_cli(args_a, cwd=tmp_path, timeout=240, env=s3_server)  # the same command
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step 16 ({url_a}/step-0000016)" in r.stderr
    assert (run_a / "metrics.jsonl").read_bytes() == logged  # no step trained again
    assert_bit_identical(run_a, ref)

    r = run_cli(args_for(corpus_dir, cache_dir, "b", **{"checkpoint.dir": url_b}), cwd=tmp_path,
                timeout=240, env=s3_server)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"warning: skipping snapshot {url_b}/step-0000016: {bad}; falling back to "
            f"{url_b}/step-0000012") in r.stderr, r.stderr[-3000:]
    assert f"resumed from step 12 ({url_b}/step-0000012)" in r.stderr
    assert f"moved aside to {url_b}/step-0000016.corrupt, not deleted" in r.stderr  # on S3 too
    assert_bit_identical(run_b, ref)
    assert store.fs.cat_file(f"{key.replace('step-0000016', 'step-0000016.corrupt')}") == \
        flipped(data)
    assert len(read_metrics(run_b)) == 16


def test_a_node_local_checkpoint_dir_is_refused_at_the_first_commit(tmp_path, corpus_dir,
                                                                    cache_dir):
    """Two nodes on one host, each in its own folder: checkpoint.dir (runs/mn/checkpoints) is
    local to each, so rank 0 cannot see rank 1's shard and commits nothing."""
    port = free_port()
    extra = {"checkpoint.every_steps": 2, "checkpoint.max_failed_saves": 1}
    procs = [start_cli(node_args(corpus_dir, cache_dir, r, port, **extra), tmp_path / f"node{r}")
             for r in (0, 1)]
    (rc0, _, err0), (rc1, _, _) = finish_all(procs, timeout=150)
    assert (rc0, rc1) != (0, 0), err0[-3000:]
    last = err0.strip().splitlines()[-1]
    assert last.startswith("paratrain: error: 1 snapshot(s) in a row could not be written"), last
    assert ("__1_0.distcp, written by rank 1, is not visible from rank 0 under "
            "runs/mn/checkpoints/step-0000002: checkpoint.dir must be storage that every node "
            "sees") in last, last
    assert committed_steps(tmp_path / "node0" / "runs" / "mn" / "checkpoints") == []
