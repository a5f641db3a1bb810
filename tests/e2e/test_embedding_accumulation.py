"""Embeddings and SetFit on a BERT-like encoder (a pooler that mean pooling never reads), beside
the Llama of test_embedding.py / test_setfit.py: 2 DDP workers train it (the pooler is built
out, so DDP finds no parameter without a gradient), and 1 worker with gradient accumulation 2
runs the same steps as 2 workers within 1e-5 — for the ranking loss because its candidates span
the whole step (GradCache, tasks/embedding/grad_cache.py), for SetFit's scored pairs because
each pair's loss is its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_runs_agree, read_metrics, run_cli
from tests.e2e._preference_data import preference_rows, small_run_args
from tests.e2e._tiny_model import write_jsonl
from tests.e2e._preference_data import labelled_rows as _labelled

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def _records(n: int, seed: int) -> list[dict]:
    return [{"anchor": r["prompt"], "positive": r["chosen"], "negative": r["rejected"]}
            for r in preference_rows(n, seed)]


def _train(run_dir: Path, model: Path, train: Path, val: Path, **extra) -> Path:
    r = run_cli(small_run_args(model, train, val, run_dir, **{"trainer.max_steps": 4,
                                                               **extra}),
                cwd=run_dir.parent, timeout=400)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return run_dir


ONE_WORKER = {"trainer.devices": "cpu"}  # batch 4 per micro-step, global 8: accumulation 2


@pytest.mark.slow
@pytest.mark.parametrize("symmetric,strategy,batch", [(False, "ddp", 4), (True, "fsdp", 2)])
def test_bert_embeddings_on_two_workers_equal_one_worker_with_accumulation(
        tmp_path, preference_bert, symmetric, strategy, batch):
    """A global batch of 8: 2 DDP workers of 4 against 1 worker with accumulation 2; 2 FSDP
    workers with accumulation 2 (batch 2) against 1 worker with accumulation 4 (measured: loss
    within 6e-7, weights 1.4e-6)."""
    train = write_jsonl(tmp_path / "train.jsonl", _records(48, 0))
    val = write_jsonl(tmp_path / "val.jsonl", _records(8, 1))
    opts = {"data.format": "embedding", "embedding.symmetric": str(symmetric).lower(),
            "trainer.batch_size": batch}
    two = _train(tmp_path / "two", preference_bert, train, val,
                 **{"trainer.strategy": strategy, **opts})
    one = _train(tmp_path / "one", preference_bert, train, val, **ONE_WORKER, **opts)
    assert len(assert_runs_agree(one, two)) == 4


@pytest.mark.slow
def test_bert_setfit_on_two_workers_equals_one_worker_with_accumulation(tmp_path,
                                                                        preference_bert):
    pytest.importorskip("sklearn")
    train = write_jsonl(tmp_path / "train.jsonl", _labelled(16, 0))
    val = write_jsonl(tmp_path / "val.jsonl", _labelled(8, 1))
    opts = {"data.format": "classify", "trainer.objective": "setfit",
            "embedding.pair_iterations": 2}
    two = _train(tmp_path / "two", preference_bert, train, val,
                 **{"trainer.strategy": "ddp", **opts})
    one = _train(tmp_path / "one", preference_bert, train, val, **ONE_WORKER, **opts)
    assert len(assert_runs_agree(one, two)) == 4


@pytest.mark.slow
def test_bert_cosent_on_two_workers_equals_one_worker_with_accumulation(tmp_path,
                                                                        preference_bert):
    """embedding.pair_loss=cosent orders every scored pair of the global batch against every
    other (0 to 5 ratings, as they are): gathered across workers, cached across micro-steps.
    Within 1e-4, not 1e-5: CoSENT's logsumexp over every two pairs at scale 20 amplifies the
    float32 rounding of the two sums (DDP's mean, accumulation) under Adam — measured 4.3e-5 on
    the step-4 loss of 3.94 (the gradient itself equals the whole batch's within 1e-5:
    tests/unit/test_grad_cache.py)."""
    rows = [{"text1": r["prompt"], "text2": r["chosen"] if i % 2 else r["rejected"],
             "score": float(i % 6)} for i, r in enumerate(preference_rows(48, 0))]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    val = write_jsonl(tmp_path / "val.jsonl", rows[:8])
    opts = {"data.format": "embedding", "embedding.pair_loss": "cosent"}
    two = _train(tmp_path / "two", preference_bert, train, val,
                 **{"trainer.strategy": "ddp", **opts})
    one = _train(tmp_path / "one", preference_bert, train, val, **ONE_WORKER, **opts)
    rows = assert_runs_agree(one, two, tol=1e-4)
    assert len(rows) == 4 and abs(rows[0]["loss"] - read_metrics(two)[0]["loss"]) <= 1e-5
