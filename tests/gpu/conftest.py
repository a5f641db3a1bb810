"""The GPU tier: every test here is marked `gpu` and skipped, with the reason, where CUDA is
absent (the CPU suite collects them, so they cannot rot unseen); a test that needs several GPUs
says how many with `needs_gpus(n)` and is skipped, with its reason, on a machine with fewer.

Each test is a real `paratrain train` (or `Trainer.fit()`) on a small model, on the GPU, the way
a user starts one; the CPU suite's fixtures (a corpus, a token cache) are shared. The whole tier
is sized to run in a few minutes on one H100 (benchmarks/gpu_check.sh runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import read_metrics, run_cli, tiny_overrides

HERE = Path(__file__).resolve().parent
NO_CUDA = "no CUDA GPU visible (torch.cuda.is_available() is False): the GPU tier runs on a GPU"


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} GPUs; {gpu_count()} visible")


def pytest_collection_modifyitems(config, items):
    """Mark this folder's tests `gpu`; skip them all, saying why, without CUDA."""
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def gpu_overrides(corpus_dir: Path, cache_dir: Path, **extra) -> list[str]:
    """The tiny model of the CPU suite on GPU 0: 10 steps of 8 x 64 tokens, fp32, a loss logged
    every step (`extra` on top, e.g. a precision)."""
    base = {"trainer.devices": "cuda:0", "trainer.batch_size": 8,
            "trainer.global_batch_size": 8, "data.seq_length": 64, "checkpoint.every_steps": 0,
            "trainer.eval_samples": 8}
    return tiny_overrides(corpus_dir, cache_dir, **{**base, **extra})


def train_on_gpu(tmp: Path, corpus_dir: Path, cache_dir: Path, timeout: float = 240,
                 **extra) -> Path:
    """`paratrain train` with `gpu_overrides(...)`; returns the finished run dir."""
    run_dir = tmp / "run"
    r = run_cli(["train", *gpu_overrides(corpus_dir, cache_dir, **extra), f"run.dir={run_dir}"],
                cwd=tmp, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return run_dir


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir) if "loss" in row]


def assert_close_losses(got: list[float], want: list[float], rel: float, what: str) -> None:
    """Per-step losses within `rel` of the reference's (relative), step by step."""
    assert len(got) == len(want), (what, got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= rel, f"{what}: worst relative loss difference {worst:.2e} > {rel:g}\n" \
                         f"got  {got}\nwant {want}"


@pytest.fixture(scope="session")
def fp32_run(tmp_path_factory, corpus_dir, cache_dir) -> Path:
    """The reference every precision and feature is compared with: 10 fp32 steps on GPU 0."""
    return train_on_gpu(tmp_path_factory.mktemp("gpu-fp32"), corpus_dir, cache_dir)
