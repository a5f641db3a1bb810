"""Reward models end to end and offline (data.format=preference, trainer.objective=reward): a one-score
head on a tiny causal Llama built here, on synthetic pairs whose chosen responses mention a
keyword the rejected ones lack. Real worker processes (1 and 2 workers give the same losses and
figures: tests/e2e/test_task_contract.py): the validation accuracy reaches 0.9; the saved model/
scores texts with plain transformers exactly as the run reported, and `paratrain generate`
prints that score."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_run, read_summary, run_cli
from tests.e2e._preference_data import (
    N_VAL,
    small_run_args,
)

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def llama(preference_llama) -> Path:
    return preference_llama  # the session's (tests/e2e/conftest.py)


@pytest.fixture(scope="module")
def data(preference_data) -> tuple[Path, Path]:
    return preference_data


def reward_args(model: Path, train: Path, val: Path, run_dir: Path, **extra) -> list[str]:
    return small_run_args(model, train, val, run_dir, **{
        "data.format": "preference", "trainer.objective": "reward", "optim.warmup_steps": 5,
        **extra})


def test_accuracy_rises_and_the_saved_model_scores_the_same(tmp_path, llama, data, capsys):
    train, val = data
    run_dir = tmp_path / "run"
    r = run_cli(reward_args(llama, train, val, run_dir, **{
        "trainer.devices": "cpu", "trainer.batch_size": 8, "trainer.max_steps": 40,
        "trainer.eval_every": 20, "trainer.log_every": 10}), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    s = read_summary(run_dir)
    assert s["val_accuracy"] >= 0.9 and s["val_samples"] == N_VAL
    assert f"accuracy {s['val_accuracy']:.4f} on {N_VAL} pairs" in r.stderr
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "score"}
    # the saved model scores each whole text with transformers alone as the run reported
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(run_dir / "model", local_files_only=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        run_dir / "model", local_files_only=True).eval()
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    with torch.no_grad():
        scores = {k: [float(model(**tok(row["prompt"] + row[k], return_tensors="pt")).logits[0, 0])
                      for row in rows] for k in ("chosen", "rejected")}
    for k in ("chosen", "rejected"):
        assert sum(scores[k]) / len(rows) == pytest.approx(s[f"val_rewards/{k}"], abs=1e-5)
    right = sum(c > r_ for c, r_ in zip(scores["chosen"], scores["rejected"])) / len(rows)
    assert right == s["val_accuracy"]
    text = rows[0]["prompt"] + rows[0]["chosen"]
    g = cli_run(capsys, ["generate", str(run_dir), "--prompt", text])
    assert g.returncode == 0, g.stderr[-2000:]
    assert float(g.stdout) == pytest.approx(scores["chosen"][0], abs=1e-5)
    assert "reward model" in g.stderr
