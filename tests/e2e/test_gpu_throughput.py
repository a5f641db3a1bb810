"""benchmarks/gpu_throughput.py --smoke: the GPU throughput bench's whole path (paratrain's
Trainer.fit() and the plain loop in one process, the figures, the JSON) on the CPU with the tiny
preset, so the script a borrowed GPU machine runs cannot rot between GPU sessions."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.timeout(300)


def test_smoke_runs_both_loops_and_writes_the_figures(tmp_path, corpus_dir):
    out = tmp_path / "out"
    r = run_cli([str(REPO / "benchmarks" / "gpu_throughput.py"), "--smoke", "--out", str(out),
                 "--corpus", str(corpus_dir), "--work", str(tmp_path)], cwd=tmp_path,
                timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "gpu_throughput.json").read_text())
    assert list(out.iterdir()) == [out / "gpu_throughput.json"]  # the runs went elsewhere
    (row,) = report["rows"]
    assert (row["preset"], row["mode"]) == ("tiny", "eager") and report["smoke"] is True
    for side in ("paratrain", "plain"):
        assert row[side]["tokens_per_s"] > 0 and row[side]["peak_bytes"] > 0, row
        assert row[side]["mfu"] is None  # no GPU peak to divide by on a CPU
    assert row["ratio"] == pytest.approx(row["paratrain"]["tokens_per_s"]
                                         / row["plain"]["tokens_per_s"])
    assert report["targets"]["ratio_met"] is None and "tiny" in report["table"]


def test_without_a_gpu_it_says_to_use_smoke(tmp_path):
    r = run_cli([str(REPO / "benchmarks" / "gpu_throughput.py"), "--out", str(tmp_path)],
                cwd=tmp_path, timeout=60, launcher=[sys.executable],
                env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2 and "use --smoke" in r.stderr, r.stderr


def test_the_gpu_check_on_a_machine_without_a_gpu_exits_0_saying_so(tmp_path):
    """`bash benchmarks/gpu_check.sh OUT` where torch sees no GPU: nothing installed, nothing
    run, exit 0 with the reason (the issue's "done when" on a CPU machine)."""
    r = run_cli([str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path / "out")],
                cwd=tmp_path, timeout=60, launcher=["bash"],
                env={"PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no GPU found (torch.cuda.is_available() is False" in r.stdout + r.stderr
