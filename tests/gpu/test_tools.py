"""The commands around training, on a GPU: `paratrain generate` on CUDA, `paratrain doctor`
over nccl, `paratrain bench` reporting MFU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.conftest import run_cli
from tests.gpu.conftest import gpu_overrides, needs_gpus

pytestmark = pytest.mark.timeout(400)


def test_generate_on_cuda(tmp_path, fp32_run):
    r = run_cli(["generate", str(fp32_run), "--prompt", "def ", "--max-new-tokens", "20",
                 "--device", "cuda"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("def ") and len(r.stdout.strip()) > len("def"), r.stdout


def test_doctor_reports_cuda_and_nccl(tmp_path):
    """One GPU: versions, the GPU by name, nccl available (nothing to all-reduce with one)."""
    r = run_cli(["doctor", "--devices", "cuda:0"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert re.search(r"CUDA \(torch built with\):\s+\d+\.\d+", out), out
    assert re.search(r"NCCL:\s+\d+\.\d+", out), out
    assert torch.cuda.get_device_name(0) in out
    assert re.search(r"nccl:\s+available", out), out


@needs_gpus(2)
def test_doctor_all_reduce_over_nccl(tmp_path):
    r = run_cli(["doctor", "--devices", "cuda", "--max-mb", "64"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert re.search(r"all-reduce: \d+ rank\(s\), nccl", r.stdout), r.stdout
    assert float(re.search(r"# avg bus bandwidth: ([0-9.]+) GB/s", r.stdout).group(1)) > 0


def test_bench_reports_mfu(tmp_path, corpus_dir, cache_dir):
    out = tmp_path / "bench"
    r = run_cli(["bench", *gpu_overrides(corpus_dir, cache_dir), "--rows", "single,plain",
                 "--steps", "5", "--warmup", "2", "--repeats", "1", "--out", str(out)],
                cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["label"]: row for row in json.loads((out / "bench.json").read_text())["rows"]}
    for label in ("single", "plain"):  # the GPU's peak comes from its name (H100: 989 TFLOP/s)
        assert rows[label]["mfu"] is not None and 0 < rows[label]["mfu"] < 1, rows[label]
        assert rows[label]["tokens_per_s"] > 0
    assert "MFU" in r.stdout
