"""Every precision on a GPU against fp32, and fp16's grad scaler skipping the steps whose
gradients overflow (as torch's GradScaler does). Tolerances are per-step relative differences of
the logged loss over 10 steps of the tiny Llama."""

from __future__ import annotations

import math
import sys

import pytest

from tests.conftest import REPO, read_metrics, read_summary, run_cli
from tests.gpu.conftest import assert_close_losses, losses, train_on_gpu

pytestmark = pytest.mark.timeout(300)

# bf16 has 8 bits of mantissa (fp16: 11): its matmuls drift further from fp32's; bf16-true also
# keeps the weights and AdamW's updates in bf16
TOLERANCE = {"bf16-mixed": 0.03, "fp16-mixed": 0.03, "bf16-true": 0.08}


@pytest.mark.parametrize("precision", list(TOLERANCE))
def test_precision_tracks_fp32(tmp_path, corpus_dir, cache_dir, fp32_run, precision):
    run = train_on_gpu(tmp_path, corpus_dir, cache_dir, **{"trainer.precision": precision})
    s = read_summary(run)
    assert s["precision"] == precision and s["memory"][0]["device"] == "cuda:0", s
    assert_close_losses(losses(run), losses(fp32_run), TOLERANCE[precision], precision)
    if precision != "fp16-mixed":  # (fp16's scaler may skip a first step: the next test)
        assert all(r["grad_norm"] is not None for r in read_metrics(run)), precision


OVERFLOW = """
import json, sys
sys.path.insert(0, {repo!r})
from paratrain import Trainer
from tests.gpu._overflow_model import huge_loss, make_model, same_sample_dataset

if __name__ == "__main__":
    r = Trainer(model=make_model, train_data=same_sample_dataset(), loss_fn=huge_loss,
                devices="cuda:0", precision="fp16-mixed", max_steps=24, batch_size=8,
                log_every=1, eval_every=1000, lr=1e-3, warmup_steps=0, progress_bar=False,
                run_dir="run").fit()
    print("RESULT", json.dumps({{"loss": r.final_loss}}))
"""


def test_fp16_grad_scaler_skips_overflowing_steps(tmp_path):
    """The first steps overflow in fp16: the scaler skips them (the weights stay as they were,
    so the same sample gives the same loss), halves its scale, and training then goes on."""
    script = tmp_path / "overflow.py"
    script.write_text(OVERFLOW.format(repo=str(REPO)))
    r = run_cli([str(script)], cwd=tmp_path, timeout=240, launcher=[sys.executable])
    assert r.returncode == 0, r.stderr[-4000:]
    rows = read_metrics(tmp_path / "run")
    norms = [r["grad_norm"] for r in rows]  # an overflow's inf/nan is logged as null
    skipped = 0
    while skipped < len(norms) and norms[skipped] is None:
        skipped += 1
    assert 1 <= skipped < len(rows) - 2, norms
    assert all(n is not None and math.isfinite(n) for n in norms[skipped:]), norms
    # skipped steps change nothing: the loss of the same sample stays put until the first
    # step whose gradients fit, then it moves (down: the loss is linear in the weights)
    first = rows[0]["loss"]
    assert all(r["loss"] == first for r in rows[:skipped + 1]), [r["loss"] for r in rows]
    assert rows[-1]["loss"] < first and math.isfinite(rows[-1]["loss"])
