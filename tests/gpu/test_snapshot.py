"""A snapshot written from CUDA tensors: the run it came from continues bit-identical on the same
GPU (losses, sample ids, final weights), and the same snapshot resumes on a CPU."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics, read_summary, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.gpu.conftest import gpu_overrides, train_on_gpu

pytestmark = pytest.mark.timeout(400)

SNAPSHOTS = {"checkpoint.every_steps": 4, "checkpoint.record_samples": "true",
             "trainer.max_steps": 12}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus_dir, cache_dir):
    return train_on_gpu(tmp_path_factory.mktemp("gpu-snap"), corpus_dir, cache_dir, **SNAPSHOTS)


def test_cuda_snapshot_resumes_bit_identical_on_the_gpu(tmp_path, corpus_dir, cache_dir,
                                                        straight):
    run = interrupted_copy(straight, tmp_path / "run", keep_until=8)
    r = run_cli(["train", *gpu_overrides(corpus_dir, cache_dir, **SNAPSHOTS), f"run.dir={run}"],
                cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 8 " in r.stderr, r.stderr[-3000:]
    assert_bit_identical(run, straight)


def test_cuda_snapshot_resumes_on_cpu(tmp_path, corpus_dir, cache_dir, straight):
    snapshot = straight / "checkpoints" / "step-0000008"
    run = tmp_path / "cpu"
    r = run_cli(["train", *gpu_overrides(corpus_dir, cache_dir, **{
        **SNAPSHOTS, "trainer.devices": "cpu", "checkpoint.resume": snapshot,
        "checkpoint.every_steps": 0}), f"run.dir={run}"], cwd=tmp_path, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 8 " in r.stderr, r.stderr[-3000:]
    assert read_summary(run)["memory"][0]["device"] == "cpu"
    got = {m["step"]: m["loss"] for m in read_metrics(run)}
    want = {m["step"]: m["loss"] for m in read_metrics(straight)}
    assert sorted(got) == [9, 10, 11, 12], sorted(got)
    for step in got:  # the same weights, optimizer state and samples: other kernels' rounding
        assert abs(got[step] - want[step]) <= 1e-4 * want[step], (step, got[step], want[step])
