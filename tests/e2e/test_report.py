"""Run records as a user sees them: report.png and TensorBoard events after a 2-worker run, and
`paratrain report RUN_DIR` redrawing it."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

from tests._runs import LOGGED, tiny_run
from tests.conftest import cli_run, read_metrics, read_summary

pytestmark = pytest.mark.timeout(300)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a valid PNG holds first."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_dir, cache_dir):
    """(where it ran, the run dir) of the session's 2-worker run of 30 steps (`LOGGED`, the one
    test_cli.py reads too): read only."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("tensorboard")
    trained = tiny_run(tmp_path_factory, corpus_dir, cache_dir, **LOGGED)
    return trained.cwd, trained.dir


def test_report_png_after_a_run(run):
    _, run_dir = run
    w, h = png_size(run_dir / "report.png")
    assert 800 <= w <= 2400 and 500 <= h <= 1600
    assert (run_dir / "report.png").stat().st_size > 20_000  # four panels drawn, not a blank
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]  # atomic: no leftovers


def png_text(path) -> dict[str, str]:
    """The tEXt chunks of a PNG (key -> text)."""
    data, out, i = path.read_bytes(), {}, 8
    while i < len(data):
        length, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"tEXt":
            key, _, text = data[i + 8:i + 8 + length].partition(b"\0")
            out[key.decode("latin-1")] = text.decode("latin-1")
        i += 12 + length
    return out


def test_report_draws_the_final_validation_loss_as_a_point(run):
    _, run_dir = run
    drawn = json.loads(png_text(run_dir / "report.png")["paratrain"])["validation"]
    rows, summary = read_metrics(run_dir), read_summary(run_dir)
    during = [[m["step"], m["val_loss"]] for m in rows if "val_loss" in m]
    assert during and drawn[:-1] == during  # the evaluations at steps 10 and 20...
    assert drawn[-1] == [30, summary["val_loss"]]  # ...and the final one, at the last step


def test_tensorboard_events_match_metrics_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    _, run_dir = run
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"train/loss", "train/lr", "perf/tokens_per_s", "val/loss"} <= tags
    rows = read_metrics(run_dir)
    logged = {e.step: e.value for e in ea.Scalars("train/loss")}
    assert sorted(logged) == [m["step"] for m in rows] == [5, 10, 15, 20, 25, 30]
    for m in rows:
        assert logged[m["step"]] == pytest.approx(m["loss"], rel=1e-6)  # stored as float32
    val = {e.step: e.value for e in ea.Scalars("val/loss")}
    assert val == pytest.approx({m["step"]: m["val_loss"] for m in rows if "val_loss" in m})
    # memory per rank from summary.json, at the last step
    summary = read_summary(run_dir)
    for entry in summary["memory"]:
        tag = f"memory/rank{entry['rank']}/params_mb"
        [event] = ea.Scalars(tag)
        assert event.step == 30
        assert event.value == pytest.approx(entry["params_bytes"] / 2**20, rel=1e-6)


def test_report_command_redraws(run, tmp_path, capsys):
    cwd = tmp_path
    run_dir = shutil.copytree(run[1], tmp_path / "run")  # this test changes what it finds
    png = run_dir / "report.png"
    png.unlink()
    r = cli_run(capsys, ["report", str(run_dir)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "report.png" in r.stdout and png_size(png)[0] >= 800
    # a running run (no summary.json yet) is drawn too, to another file
    summary = run_dir / "summary.json"
    os.rename(summary, run_dir / "summary.bak")
    try:
        r = cli_run(capsys, ["report", str(run_dir), "--out", str(cwd / "live.png")])
    finally:
        os.rename(run_dir / "summary.bak", summary)
    assert r.returncode == 0, r.stderr[-2000:]
    png_size(cwd / "live.png")


def test_report_errors_are_one_line(tmp_path, capsys):
    from paratrain import cli
    assert cli.main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert cli.main(["report", str(tmp_path)]) == 2  # a folder, but no run in it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no metrics.jsonl" in err[0]
