"""Validation fits the run: a bounded default (said at start), every held-out sample on request."""

from types import SimpleNamespace

from paratrain.config import TrainConfig
from paratrain.runtime.validation import bound_line


def _plan_and_task(eval_samples, held_out):
    cfg = TrainConfig.from_yaml(None, [f"trainer.eval_samples={eval_samples}"])
    task = SimpleNamespace(val_ds=range(held_out), sample_name="sequences of 256 tokens")
    return SimpleNamespace(cfg=cfg), task


def test_the_default_bound_is_said_and_null_evaluates_every_sample():
    assert TrainConfig.from_yaml(None, []).trainer.eval_samples == 1024
    assert bound_line(*_plan_and_task(1024, 20_000)) == (
        "validation: the first 1,024 of 20,000 held-out sequences of 256 tokens at each "
        "evaluation (trainer.eval_samples; null: every one)")
    assert bound_line(*_plan_and_task(1024, 900)) is None  # nothing left out: nothing said
    assert bound_line(*_plan_and_task("null", 20_000)) is None
