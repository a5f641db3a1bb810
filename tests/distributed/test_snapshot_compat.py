"""A snapshot written by an older paratrain (tests/fixtures/snapshot_v1, commit 9e39f32, before the
run-plan redesign) still resumes: the steps after it come out bit-identical to an uninterrupted
run of today's code with the same configuration (2 CPU workers, FSDP)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import read_metrics, read_summary, run_cli

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


def test_snapshot_from_an_older_version_resumes_bit_identical(tmp_path):
    cache = tmp_path / "cache"
    fresh = tmp_path / "fresh"
    r = run_cli(_args(fresh, cache), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]

    old = tmp_path / "old-snapshot"
    shutil.copytree(FIXTURE / "step-0000004", old / "step-0000004")
    resumed = tmp_path / "resumed"
    r = run_cli(_args(resumed, cache) + [f"checkpoint.resume={old / 'step-0000004'}"],
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4" in r.stderr
    assert "has no checksums (written before paratrain recorded them): its sizes were checked, " \
        "its contents cannot be verified" in r.stderr  # said, never silent
    assert read_summary(resumed)["resumed_from"]["step"] == 4

    after = [m for m in read_metrics(fresh) if m["step"] > 4]
    got = read_metrics(resumed)
    assert [m["step"] for m in got] == [5, 6, 7, 8]
    for a, b in zip(after, got):
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"])
    # The old snapshot's marker is read as it was written: its step and world size.
    marker = json.loads((FIXTURE / "step-0000004" / "committed.json").read_text())
    assert marker["step"] == 4 and marker["world_size"] == 2
