"""Packed fine-tuning (data.pack=true) as real runs (issue 38): the rows are made before the data
is dealt, so 1 worker accumulating and 2 workers train the same rows (per-step losses within
1e-5), and a packed run that died resumes bit-identical (snapshot helpers of the snapshot
tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._runs import trained_run
from tests.conftest import read_metrics, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.e2e._tiny_model import make_pairs, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    here = tmp_path_factory.mktemp("packed-data")
    return write_jsonl(here / "train.jsonl", make_pairs(120))


TWO = {"trainer.devices": "cpu:2", "trainer.batch_size": 2, "checkpoint.every_steps": 2,
       "checkpoint.record_samples": "true"}  # also the resume test's reference


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("packed-cache")


def _packed(pairs_llama: Path, data: Path, cache: Path, **extra) -> dict:
    return {"model.arch": "hf", "model.path": pairs_llama, "data.format": "pairs",
            "data.source": data, "data.cache_dir": cache, "data.pack": "true",
            "data.max_length": 128, "trainer.global_batch_size": 4, "trainer.max_steps": 6,
            "trainer.log_every": 1, "trainer.eval_every": 1000, "trainer.progress_bar": "false",
            "optim.warmup_steps": 1, "distributed.timeout_s": 60, **extra}


def test_one_and_two_workers_train_the_same_packed_rows(tmp_path_factory, pairs_llama, data,
                                                        cache):
    """One worker accumulating 2 micro-batches of 2 rows against 2 workers of 2 rows each: the
    same global batches of the same rows, the same per-step losses."""
    one = trained_run(tmp_path_factory, _packed(pairs_llama, data, cache, **{
        "trainer.devices": "cpu:1", "trainer.batch_size": 2}), timeout=400)
    two = trained_run(tmp_path_factory, _packed(pairs_llama, data, cache, **TWO), timeout=400)
    a, b = read_metrics(one.dir), read_metrics(two.dir)
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * max(1.0, abs(x["loss"])), (x, y)
    assert "x 2 accumulation = 4 packed rows" in one.stderr, one.stderr[-2000:]
    for run in (one, two):
        assert "trainer.batch_size counts rows" in run.stderr
        assert "per row on average" in run.stderr
        summary = json.loads((run.dir / "summary.json").read_text())
        assert 0 <= summary["padding_share"] < 0.25
        config = json.loads((run.dir / "model" / "config.json").read_text())
        assert config["use_cache"] is True  # off while training packed rows, back for generate


def test_a_packed_run_that_died_resumes_bit_identical(tmp_path_factory, tmp_path, pairs_llama,
                                                      data, cache):
    ref = trained_run(tmp_path_factory, _packed(pairs_llama, data, cache, **TWO), timeout=400)
    died = interrupted_copy(ref.dir, tmp_path / "died", keep_until=4)
    args = ["train"] + [f"{k}={v}" for k, v in _packed(pairs_llama, data, cache, **TWO).items()
                        ] + [f"run.dir={died}"]
    r = run_cli(args, cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step 4" in r.stderr
    assert_bit_identical(died, ref.dir)


def test_the_preference_guides_packing_block_runs_as_printed(tmp_path, pairs_llama):
    """docs/guides/preference.md's packed DPO command, in a folder holding my-model/ and
    prefs.jsonl, as a user copies it."""
    import shutil

    from tests.e2e._doc_blocks import doc_blocks
    mine = [b for b in doc_blocks() if b.marker == "run by" and b.page.endswith("preference.md")
            and b.reason.startswith("tests/distributed/test_packing_runs.py")]
    commands = [args for b in mine for args in b.commands()]
    assert commands and all("data.pack=true" in c for c in commands)
    shutil.copytree(pairs_llama, tmp_path / "my-model")
    rows = make_pairs(61)
    write_jsonl(tmp_path / "prefs.jsonl", [
        {"prompt": a["input"], "chosen": a["output"], "rejected": b["output"]}
        for a, b in zip(rows, rows[1:])])
    for args in commands:
        r = run_cli(args[1:], cwd=tmp_path, timeout=400)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "pairs per row on average" in r.stderr and "counts rows" in r.stderr
    summary = json.loads((tmp_path / "runs" / "dpo-packed" / "summary.json").read_text())
    assert summary["padding_share"] < 0.5 and summary["steps"] == 4
