"""KTO end to end (trainer.objective=kto on preference pairs, each pair a desirable and an
undesirable example): 1 worker and 2 DDP workers with the same global batch run the same steps
(loss, KL estimate, rewards, trained weights), the KL estimate summed over both workers' batches;
a run that died after a snapshot, rerun by the same command, ends bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_runs_agree, read_metrics, run_cli
from tests.distributed._snapshot_helpers import assert_bit_identical, interrupted_copy
from tests.e2e._preference_data import small_run_args

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def _kto(run_dir: Path, llama: Path, data: tuple[Path, Path], **extra) -> Path:
    r = run_cli(_args(run_dir, llama, data, **extra), cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _args(run_dir: Path, llama: Path, data: tuple[Path, Path], **extra) -> list[str]:
    return small_run_args(llama, *data, run_dir, **{
        "data.format": "preference", "trainer.objective": "kto", "trainer.max_steps": 6,
        "kto.undesirable_weight": 1.5, **extra})


@pytest.mark.slow
def test_one_and_two_workers_run_the_same_kto_steps(tmp_path, preference_llama,
                                                    preference_data):
    one = _kto(tmp_path / "one", preference_llama, preference_data,
               **{"trainer.devices": "cpu", "trainer.batch_size": 8})
    on_two = {"trainer.strategy": "ddp", "checkpoint.every_steps": 3,
              "checkpoint.record_samples": "true"}
    two = _kto(tmp_path / "two", preference_llama, preference_data, **on_two)
    figures = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins")
    rows = {"one": assert_runs_agree(one, two, figures), "two": read_metrics(two)}
    assert len(rows["one"]) == 6
    first = rows["one"][0]  # policy = reference: no reward, KL 0, each loss half its weight
    assert first["kl"] == 0.0 and first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert 0.5 <= first["loss"] <= 0.75 and all(r["kl"] >= 0 for r in rows["one"])
    assert any(r["kl"] > 0 for r in rows["one"])  # an estimate both workers' batches made
    # died after the step-3 snapshot: the same command resumes and ends bit-identical
    died = interrupted_copy(two, tmp_path / "died", keep_until=3)
    r = run_cli(_args(died, preference_llama, preference_data, **on_two), cwd=tmp_path)
    assert r.returncode == 0 and "resumed from step 3" in r.stderr, r.stderr[-3000:]
    assert_bit_identical(died, two)
    assert [m["kl"] for m in read_metrics(died)] == [m["kl"] for m in rows["two"]]


@pytest.mark.slow
def test_one_worker_with_accumulation_estimates_the_kl_of_the_whole_step(
        tmp_path, preference_llama, preference_data):
    """1 worker, batch 4, accumulation 2 = 2 workers of 4: one KL estimate per optimizer step
    (kto.py `rollout`), not one per micro-step."""
    extra = {"trainer.max_steps": 4}
    one = _kto(tmp_path / "one", preference_llama, preference_data,
               **{"trainer.devices": "cpu", **extra})
    two = _kto(tmp_path / "two", preference_llama, preference_data,
               **{"trainer.strategy": "ddp", **extra})
    rows = assert_runs_agree(one, two, ("loss", "kl", "rewards/chosen", "rewards/rejected"))
    assert len(rows) == 4 and any(r["kl"] > 0 for r in rows)
