"""SetFit end to end (data.format=classify, trainer.objective=setfit, a tiny local Llama, mean
pooling): the contrastive phase on 1 worker and on 2 DDP workers runs the same steps and ends
with the same weights and the same head; `paratrain generate` labels a text; the run's model/
folder loads with the `setfit` package, which predicts what paratrain predicts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.conftest import assert_runs_agree, run_cli
from tests.e2e._preference_data import KEYWORD, OTHER, WORDS, small_run_args
from tests.e2e._tiny_model import write_jsonl

pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(900)]


def _labelled(n: int, seed: int) -> list[dict]:
    """Texts that mention KEYWORD ("apple") or OTHER, labelled by which."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 5))]
        words.insert(rng.randrange(len(words) + 1), KEYWORD if i % 2 else OTHER)
        rows.append({"text": " ".join(words), "label": "fruit" if i % 2 else "stone"})
    return rows


def _setfit(run_dir: Path, llama: Path, train: Path, val: Path, **extra) -> Path:
    r = run_cli(small_run_args(llama, train, val, run_dir, **{
        "data.format": "classify", "trainer.objective": "setfit", "trainer.max_steps": 6,
        "embedding.pair_iterations": 2, **extra}), cwd=run_dir.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_setfit_on_one_and_two_workers_and_with_the_setfit_package(tmp_path, preference_llama):
    pytest.importorskip("sklearn")
    from paratrain.tasks.embedding.setfit import predict
    train = write_jsonl(tmp_path / "train.jsonl", _labelled(16, 0))
    val = write_jsonl(tmp_path / "val.jsonl", _labelled(8, 1))
    one = _setfit(tmp_path / "one", preference_llama, train, val,
                  **{"trainer.devices": "cpu", "trainer.batch_size": 8})
    two = _setfit(tmp_path / "two", preference_llama, train, val, **{"trainer.strategy": "ddp"})
    assert len(assert_runs_agree(one, two)) == 6

    texts = [r["text"] for r in _labelled(8, 2)]
    ours = predict(one / "model", texts)
    assert predict(two / "model", texts) == ours and set(ours) <= {"fruit", "stone"}
    r = run_cli(["generate", str(one), "--prompt", texts[0]], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == ours[0], r.stderr[-2000:]
    setfit = pytest.importorskip("setfit")
    model = setfit.SetFitModel.from_pretrained(str(one / "model"), device="cpu")
    assert [str(p) for p in model.predict(texts)] == ours
