"""`paratrain bench` end to end on a tiny model: it runs, and what it writes is well formed.
(Speed is not tested here: the figures live in docs/benchmarks.md, made by commands anyone can
rerun on a quiet machine.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import cli_error, run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(120)

ROW_KEYS = {"label", "strategy", "world_size", "runs", "timed_steps", "steps_per_s",
            "tokens_per_s", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
            "step_time_spread", "first_step_s", "data_wait_fraction", "peak_bytes_per_device",
            "memory_imbalance", "mfu", "vs_plain", "step_cpu_median_s", "cpu_vs_plain"}


def _bench_args(corpus_dir, cache_dir, *flags: str, **extra) -> list[str]:
    return ["bench"] + tiny_overrides(corpus_dir, cache_dir, **{
        "run.name": "b", "trainer.devices": "cpu:2", **extra}) + \
        ["--steps", "3", "--warmup", "1", "--repeats", "1", *flags]


def _bench(tmp_path, corpus_dir, cache_dir, *flags: str, **extra):
    return run_cli(_bench_args(corpus_dir, cache_dir, *flags, **extra), cwd=tmp_path, timeout=110)


@pytest.mark.slow
def test_bench_rows_json_and_chart(tmp_path, corpus_dir, cache_dir):
    r = _bench(tmp_path, corpus_dir, cache_dir, "--rows", "dp,ddp,plain")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "runs" / "b" / "bench"
    report = json.loads((out / "bench.json").read_text())
    assert report["mode"] == "strategies"
    assert [row["label"] for row in report["rows"]] == ["ddp", "plain"]
    assert [s["label"] for s in report["skipped"]] == ["dp"]
    assert "CUDA" in report["skipped"][0]["reason"]
    # interleaved: every row once per repeat, in row order
    assert report["method"]["order"] == ["ddp#0", "plain#0"]
    for row in report["rows"]:
        assert ROW_KEYS <= set(row), ROW_KEYS - set(row)
        assert row["timed_steps"] == 3 and row["steps_per_s"] > 0 and row["tokens_per_s"] > 0
        assert row["step_time_p10_s"] <= row["step_time_median_s"] <= row["step_time_p90_s"]
        assert len(row["peak_bytes_per_device"]) == row["world_size"]
        assert row["memory_imbalance"] >= 1.0 and row["mfu"] is None  # no MFU on CPU
    by = {row["label"]: row for row in report["rows"]}
    assert (by["ddp"]["world_size"], by["plain"]["world_size"]) == (2, 2)
    assert by["ddp"]["strategy"] == "ddp" and by["plain"]["vs_plain"] == 1.0
    assert 0 <= by["ddp"]["data_wait_fraction"] < 1
    # side-by-side runs compared pair by pair, and the load the figures were taken under
    assert by["plain"]["vs_plain_per_repeat"] == [1.0]
    assert len(by["ddp"]["vs_plain_per_repeat"]) == 1 and by["ddp"]["vs_plain_paired_median"] > 0
    assert len(report["machine"]["load_avg_at_start"]) == 3
    assert len(report["machine"]["load_avg_1min_after_each_run"]) == 2
    assert "ddp vs plain, repeat by repeat" in r.stdout and "load average" in r.stdout
    # the table on stdout, the chart next to bench.json (matplotlib is in the test extra)
    assert "vs plain" in r.stdout and "dp: skipped" in r.stdout
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
        assert report["plot"] == str(Path("runs/b/bench/bench.png"))
    # timing runs do not keep their weights
    assert not list((out / "runs").glob("*/model"))


@pytest.mark.slow
def test_bench_scaling_efficiency(tmp_path, corpus_dir, cache_dir):
    r = _bench(tmp_path, corpus_dir, cache_dir, "--scaling")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "b" / "bench" / "bench.json").read_text())
    one, two = report["rows"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    eff = two["tokens_per_s"] / (2 * one["tokens_per_s"])
    assert report["scaling"]["efficiency"] == pytest.approx(eff)
    assert "weak scaling efficiency 1 -> 2 workers" in r.stdout


@pytest.mark.parametrize("flags, extra, message", [
    (["--rows", "single,nope"], {}, "--rows nope not understood"),
    (["--scaling"], {"trainer.devices": "cpu"}, "--scaling needs several devices"),
    (["--steps", "1"], {}, "need at least 1 warm-up step, 2 timed steps"),
])
def test_bench_user_errors_are_one_line(tmp_path, monkeypatch, capsys, corpus_dir, cache_dir,
                                        flags, extra, message):
    """In this process (cli.main); the entry point's own exit code is test_errors.py's."""
    monkeypatch.chdir(tmp_path)
    line = cli_error(capsys, _bench_args(corpus_dir, cache_dir, *flags, **extra), only_line=True)
    assert message in line
