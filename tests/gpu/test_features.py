"""`trainer.compile`, activation checkpointing and the optimizer's CUDA fast path, each a real run
on GPU 0 compared with the fp32 eager reference (tests/gpu/conftest.py's `fp32_run`)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import read_summary
from tests.gpu.conftest import assert_close_losses, losses, train_on_gpu

pytestmark = pytest.mark.timeout(400)


def test_compile_matches_eager(tmp_path, corpus_dir, cache_dir, fp32_run):
    """Inductor fuses and reorders fp32 arithmetic: the same run to 1e-3 per step."""
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, timeout=360,
                       **{"trainer.compile": "true"})
    assert_close_losses(losses(run), losses(fp32_run), 1e-3, "compile")
    first, later = read_summary(run)["step_times_s"][0], read_summary(run)["step_times_s"][-1]
    assert first > later  # the first step compiled; the others reuse the graph


def test_activation_checkpointing_is_the_same_run(tmp_path, corpus_dir, cache_dir, fp32_run):
    """Recomputing a block in backward runs the same kernels on the same inputs."""
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir,
                       **{"trainer.activation_checkpointing": "true"})
    assert_close_losses(losses(run), losses(fp32_run), 1e-5, "activation checkpointing")
    ours = read_summary(run)["memory"][0]["activation_bytes"]
    theirs = read_summary(fp32_run)["memory"][0]["activation_bytes"]
    assert ours < theirs, (ours, theirs)  # what it is for: fewer saved activations


def test_fused_adamw_is_the_cuda_default_and_matches_foreach(tmp_path, corpus_dir, cache_dir,
                                                              fp32_run):
    from paratrain.config import OptimConfig
    from paratrain.runtime.optim import build_optimizer
    model = torch.nn.Linear(4, 4).cuda()
    assert build_optimizer(model, OptimConfig(), torch.device("cuda", 0)).defaults["fused"]
    foreach = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{"optim.fused": "false"})
    assert_close_losses(losses(foreach), losses(fp32_run), 1e-6, "foreach vs fused AdamW")
    fused_w = load_file(str(fp32_run / "model" / "model.safetensors"))
    foreach_w = load_file(str(foreach / "model" / "model.safetensors"))
    worst = max((fused_w[k] - foreach_w[k]).abs().max().item() for k in fused_w)
    assert worst <= 1e-6, f"weights after 10 steps differ by up to {worst:.2e}"
