"""Run records people look at: report.png and TensorBoard events, after a 2-worker run."""

from __future__ import annotations

import struct

import pytest

from paratrain import cli
from tests.conftest import read_metrics, run_cli, tiny_overrides

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, corpus_dir, cache_dir):
    cwd = tmp_path_factory.mktemp("report")
    over = tiny_overrides(corpus_dir, cache_dir, **{
        "run.name": "rec", "trainer.devices": "cpu:2", "trainer.max_steps": 12,
        "trainer.log_every": 3, "trainer.eval_every": 6, "trainer.eval_samples": 16})
    r = run_cli(["train"] + over, cwd=cwd, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return cwd / "runs" / "rec"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_report_png_after_a_run(run_dir):
    w, h = _png_size(run_dir / "report.png")
    assert w >= 800 and h >= 500


def test_tensorboard_events_hold_the_logged_losses(run_dir):
    acc_mod = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = acc_mod.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    rows = read_metrics(run_dir)
    assert [e.step for e in events] == [r["step"] for r in rows] == [3, 6, 9, 12]
    for e, r in zip(events, rows):
        assert e.value == pytest.approx(r["loss"], rel=1e-6)
    assert [e.step for e in acc.Scalars("val/loss")] == [6]


def test_report_command_redraws(run_dir, tmp_path):
    (run_dir / "report.png").unlink()
    r = run_cli(["report", str(run_dir)], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _png_size(run_dir / "report.png")[0] >= 800


def test_report_of_a_missing_run_is_exit_2(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
