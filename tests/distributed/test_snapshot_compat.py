"""A snapshot written by an older paratrain (tests/fixtures/snapshot_v1, commit 9e39f32, before the
run-plan redesign) still resumes, exactly as one of today's does.

The fixture was made on another machine, whose CPU kernels may round differently from this one's
(by ~1e-7), so nothing here is compared bitwise with a number computed there. Instead: today's
code loads the old snapshot and saves the same state again (2 gloo ranks, FSDP, the run's plan);
that copy holds the same tensors bit for bit, and the old snapshot and the copy, each resumed
here with the same configuration (2 CPU workers, FSDP), continue bit-identically. The
continuation is also within 1e-6 of an uninterrupted run of today's code."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from paratrain.launch.environment import free_port
from tests._progress import join_while_progressing
from tests.conftest import read_metrics, read_summary, run_cli
from tests.distributed import _workers
from tests.distributed._snapshot_helpers import weights

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "snapshot_v1"


def _args(run_dir: Path, cache_dir: Path) -> list[str]:
    return ["train", f"data.source={FIXTURE / 'corpus.txt'}", "data.tokenizer=char",
            "data.seq_length=16", f"data.cache_dir={cache_dir}", "model.preset=null",
            "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
            "model.num_kv_heads=1", "trainer.devices=cpu:2", "trainer.strategy=fsdp",
            "trainer.batch_size=2", "trainer.global_batch_size=8", "trainer.max_steps=8",
            "trainer.log_every=1", "trainer.eval_every=1000", "trainer.progress_bar=false",
            "optim.warmup_steps=2", "checkpoint.every_steps=4", "checkpoint.async_save=false",
            "distributed.timeout_s=60", f"run.dir={run_dir}"]


def _tensors(snapshot: Path, out: Path) -> dict:
    """Every tensor and value a snapshot holds (model and optimizer), read back in full."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(snapshot, out)
    return torch.load(out, weights_only=True)


def _assert_same(got, want, where: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


def test_snapshot_from_an_older_version_resumes_bit_identical(tmp_path):
    cache = tmp_path / "cache"
    fresh = tmp_path / "fresh"  # first: it also builds the token cache the others reuse
    r = run_cli(_args(fresh, cache), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]

    old = tmp_path / "old-snapshot" / "step-0000004"
    shutil.copytree(FIXTURE / "step-0000004", old)
    resaved_run = tmp_path / "resaved"
    ctx = mp.start_processes(_workers.resave_snapshot, nprocs=2, join=False,
                             start_method="spawn",
                             args=(2, free_port(), _args(resaved_run, cache)[1:]
                                   + [f"checkpoint.resume={old}"]))
    join_while_progressing(ctx)
    resaved = resaved_run / "checkpoints" / "step-0000004"
    assert json.loads((resaved / "committed.json").read_text())["step"] == 4
    _assert_same(_tensors(resaved, tmp_path / "resaved.pt"), _tensors(old, tmp_path / "old.pt"))

    runs = {}
    for name, snapshot in (("from-old", old), ("from-resaved", resaved)):
        runs[name] = run_dir = tmp_path / name
        r = run_cli(_args(run_dir, cache) + [f"checkpoint.resume={snapshot}"], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from step 4" in r.stderr
        if snapshot == old:
            assert "has no checksums (written before paratrain recorded them): its sizes were " \
                "checked, its contents cannot be verified" in r.stderr  # said, never silent
        assert read_summary(run_dir)["resumed_from"]["step"] == 4
    got, again = read_metrics(runs["from-old"]), read_metrics(runs["from-resaved"])
    assert [m["step"] for m in got] == [m["step"] for m in again] == [5, 6, 7, 8]
    for a, b in zip(got, again):  # the same state, loaded on this machine: bit for bit
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    w_old, w_new = weights(runs["from-old"]), weights(runs["from-resaved"])
    assert w_old.keys() == w_new.keys()
    assert all(torch.equal(w_old[k], w_new[k]) for k in w_old)

    # against today's uninterrupted run: its first 4 steps are this machine's, the snapshot's
    # the fixture machine's, so within 1e-6 (the schedule's lr is plain arithmetic: exact)
    after = [m for m in read_metrics(fresh) if m["step"] > 4]
    assert [m["step"] for m in after] == [5, 6, 7, 8]
    for a, b in zip(after, got):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6
        assert a["lr"] == b["lr"]
    # The old snapshot's marker is read as it was written: its step and world size.
    marker = json.loads((FIXTURE / "step-0000004" / "committed.json").read_text())
    assert marker["step"] == 4 and marker["world_size"] == 2
