"""Host syncs per optimizer step on CUDA: a step that logs nothing reads nothing back from the
GPU (the loss sums, the gradient norm and the training counts stay on the device until a log
step; the loss units are counted on the host batch; the stop check and a padded step's unit
count go through a gloo group of host memory: runtime/host_group.py). The bound is at most one
sync on a non-log step, so the GPU's queue is never drained between two log lines.

Each run is a real `Trainer(cfg).fit()` under torchrun, one process per GPU, with
torch.cuda.set_sync_debug_mode("warn") counting every synchronizing call (tests/gpu/_sync_count.py).
The first step is left out: it measures the run's memory figures once (activations, gradients)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO, run_cli
from tests.gpu.conftest import gpu_overrides, needs_gpus

pytestmark = pytest.mark.timeout(400)

MAX_SYNCS = 1  # per non-log optimizer step


def _syncs_per_step(tmp, corpus_dir, cache_dir, nproc: int, **extra) -> list[dict]:
    """Each rank's {"steps": {step: [where each sync came from]}, "log_steps": [...]}."""
    over = gpu_overrides(corpus_dir, cache_dir, **{
        "trainer.max_steps": 12, "trainer.log_every": 5, "trainer.eval_every": 1000,
        "trainer.progress_bar": True, **extra})
    if nproc > 1:
        over += [f"trainer.devices=cuda:{','.join(map(str, range(nproc)))}"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", "-m", "tests.gpu._sync_count", str(tmp / "syncs")]
    r = run_cli(over + [f"run.dir={tmp / 'run'}"], cwd=tmp, timeout=300, launcher=launcher,
                env={"PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((tmp / f"syncs-rank-{rank}.json").read_text()) for rank in range(nproc)]


def _check(ranks: list[dict]) -> None:
    for rank, got in enumerate(ranks):
        steps = {int(k): v for k, v in got["steps"].items()}
        assert len(steps) == 12, sorted(steps)
        quiet = [s for s in steps if s not in got["log_steps"] and s > 1]
        assert quiet, got["log_steps"]
        over = {s: steps[s] for s in quiet if len(steps[s]) > MAX_SYNCS}
        assert not over, f"rank {rank}: more than {MAX_SYNCS} host sync(s) on non-log steps " \
                         f"(step: where each came from): {json.dumps(over, indent=1)}"
        # a log step reads the sums back: the counter does see syncs
        assert any(steps[s] for s in got["log_steps"]), steps


@pytest.mark.parametrize("data", ["packed", "padded"])
def test_one_gpu_steps_without_host_syncs(tmp_path, corpus_dir, cache_dir, data):
    """packed: every window counts the same (no count to agree on); padded: the loss units of
    each step are counted on the host."""
    _check(_syncs_per_step(tmp_path, corpus_dir, cache_dir, 1, **{"data.format": data}))


@needs_gpus(2)
def test_ddp_over_nccl_steps_without_host_syncs(tmp_path, corpus_dir, cache_dir):
    """DDP on 2 GPUs: the per-step stop check and a padded step's unit count travel on the
    host group (gloo), not on the GPUs' nccl communicator."""
    _check(_syncs_per_step(tmp_path, corpus_dir, cache_dir, 2, **{
        "trainer.strategy": "ddp", "trainer.batch_size": 4, "data.format": "padded"}))
