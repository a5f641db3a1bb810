"""`paratrain doctor` on this machine: the report, an all-reduce with a bandwidth figure, and
point-to-point send/recv (what pipeline stages exchange)."""

from __future__ import annotations

import re

import pytest
import torch

from paratrain.launch.environment import free_port
from tests.conftest import finish_all, run_cli, start_cli

pytestmark = pytest.mark.timeout(150)

BUSBW = re.compile(r"# avg bus bandwidth: ([0-9.]+) GB/s")
P2P_PEAK = re.compile(r"peak ([0-9.]+) GB/s per link and direction")


def test_doctor_gloo_two_workers(tmp_path):
    r = run_cli(["doctor", "--devices", "cpu:2", "--max-mb", "4"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for words in ("torch:", "gloo:", "CPU cores usable", "127.0.0.1 resolves to",
                  "all-reduce: 2 rank(s), gloo", "busbw(GB/s)"):
        assert words in out, out
    assert float(BUSBW.search(out).group(1)) > 0
    assert len(re.findall(r"^\s+\d+\s+\d+\s+float\s+sum", out, re.M)) == 6  # 4 KiB, 16 KiB, .. 4 MiB
    # then what pipeline stages do: send/recv between neighbours, a row per size, a link figure
    assert "point-to-point (pipeline stages): 2 rank(s), gloo" in out, out
    p2p = out.split("point-to-point (pipeline stages)")[1]
    assert len(re.findall(r"^\s+\d+\s+[0-9.]+\s+[0-9.]+$", p2p, re.M)) == 6, p2p
    assert float(P2P_PEAK.search(p2p).group(1)) > 0


def test_doctor_across_two_nodes(tmp_path):
    port = free_port()
    procs = [start_cli(["doctor", "--devices", "cpu:1", "--nnodes", "2", "--node-rank", str(r),
                        "--master-port", str(port), "--max-mb", "1"], tmp_path / f"n{r}")
             for r in (0, 1)]
    for rc, out, err in finish_all(procs, timeout=120):
        assert rc == 0, out[-3000:] + err[-3000:]
        assert "all-reduce: 2 rank(s), gloo" in out and BUSBW.search(out), out


def test_doctor_reports_a_port_in_use(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        r = run_cli(["doctor", "--devices", "cpu:1", "--master-port", str(s.getsockname()[1])],
                    cwd=tmp_path, timeout=60)
    assert r.returncode == 1
    assert "FAILED" in r.stdout and "already in use" in r.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for an nccl all-reduce")
def test_doctor_nccl(tmp_path):
    r = run_cli(["doctor", "--devices", "cuda", "--max-mb", "64"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "nccl" in r.stdout and BUSBW.search(r.stdout)
    assert "point-to-point (pipeline stages): 2 rank(s), nccl" in r.stdout
    assert P2P_PEAK.search(r.stdout), r.stdout
