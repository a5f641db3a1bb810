"""Data parallelism over nccl: DDP and FSDP2 (with and without CPU offload, in fp32 and the
mixed precisions) at world 1 against no wrapper; nn.DataParallel; and, on machines with 2+ GPUs
(skipped on one, with the reason), every strategy over nccl against one GPU within 1e-5."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import REPO, read_summary, run_cli
from tests.gpu.conftest import assert_close_losses, losses, needs_gpus, train_on_gpu

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def world_one(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("world-one")
    r = run_cli(["-m", "tests.gpu._world_one"], cwd=tmp, timeout=240,
                launcher=[sys.executable], env={"PYTHONPATH": os.pathsep.join(
                    p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


# variant: (its reference, relative tolerance per step). FSDP's mixed precision all-gathers
# bf16 parameters instead of autocasting fp32 ones: the precision tests' tolerance
WORLD_ONE = {"ddp": ("single", 1e-5), "fsdp": ("single", 1e-5), "fsdp-offload": ("single", 1e-5),
             "ddp-bf16": ("single-bf16", 1e-5), "fsdp-bf16": ("single-bf16", 0.03),
             "fsdp-fp16": ("single", 0.03)}


@pytest.mark.parametrize("variant", list(WORLD_ONE))
def test_nccl_world_one_matches_no_wrapper(world_one, variant):
    assert world_one["backend"] == "nccl"
    ref, tol = WORLD_ONE[variant]
    assert_close_losses(world_one[variant], world_one[ref], tol, f"{variant} vs {ref}")
    assert world_one[variant][-1] < world_one[variant][0]  # and it learns


def test_data_parallel_one_process(tmp_path, corpus_dir, cache_dir, fp32_run):
    """trainer.strategy=dp: nn.DataParallel over every visible GPU, from one process."""
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{"trainer.strategy": "dp"})
    s = read_summary(run)
    assert s["strategy"] == "dp" and s["world_size"] == 1, s
    assert_close_losses(losses(run), losses(fp32_run), 1e-5, "dp vs one GPU")


# ---- several GPUs: the same global batch of 8 over 2 (or 4) GPUs, against one -------------
MULTI = {"ddp": {"trainer.strategy": "ddp"}, "fsdp": {"trainer.strategy": "fsdp"},
         "tp2": {"trainer.strategy": "fsdp", "trainer.tensor_parallel": 2},
         "pp2": {"trainer.pipeline_parallel": 2}}


@needs_gpus(2)
@pytest.mark.parametrize("layout", list(MULTI))
def test_two_gpus_match_one(tmp_path, corpus_dir, cache_dir, fp32_run, layout):
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{
        "trainer.devices": "cuda:0,1", "trainer.batch_size": 4, **MULTI[layout]})
    assert read_summary(run)["world_size"] == 2
    assert_close_losses(losses(run), losses(fp32_run), 1e-5, f"{layout} on 2 GPUs vs one")


@needs_gpus(2)
def test_data_parallel_two_gpus_matches_ddp(tmp_path, corpus_dir, cache_dir, fp32_run):
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{
        "trainer.devices": "cuda:0,1", "trainer.strategy": "dp"})
    assert_close_losses(losses(run), losses(fp32_run), 1e-5, "dp on 2 GPUs vs one")


@needs_gpus(4)
def test_hsdp_four_gpus_matches_one(tmp_path, corpus_dir, cache_dir, fp32_run):
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{
        "trainer.devices": "cuda:0,1,2,3", "trainer.batch_size": 2, "trainer.strategy": "hsdp",
        "trainer.shard_group_size": 2})
    assert read_summary(run)["strategy"] == "hsdp"
    assert_close_losses(losses(run), losses(fp32_run), 1e-5, "hsdp 2x2 vs one GPU")
