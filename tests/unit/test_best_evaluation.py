"""keep_best reports the best evaluation's figures (a classifier's accuracy) at the end: they
travel in the snapshot with the best loss, so a run resumed after its best evaluation still
reports that evaluation's accuracy, not the last one's or none."""

import json

import torch

from paratrain.runtime.early_stop import BestTracker
from paratrain.runtime.loop_state import LoopState


def test_the_best_evaluations_figures_survive_a_snapshot():
    state = LoopState(step=40)
    state.best.update(20, 0.9, {"val_accuracy": torch.tensor(0.75), "val_samples": 64})
    assert not state.best.update(40, 1.1, {"val_accuracy": 0.5, "val_samples": 64})
    saved = json.loads(json.dumps(state.to_snapshot()))  # what a snapshot's marker holds

    resumed = BestTracker(patience=3)
    resumed.load_state_dict(saved["best"])
    assert (resumed.best_step, resumed.best_loss) == (20, 0.9)
    assert resumed.best_metrics == {"val_accuracy": 0.75, "val_samples": 64}
    assert resumed.evals_without_improvement == 1


def test_a_snapshot_from_before_has_no_figures_and_still_loads():
    tracker = BestTracker()
    tracker.load_state_dict({"best_loss": 0.9, "best_step": 20, "evals_without_improvement": 0})
    assert tracker.best_metrics == {} and tracker.best_step == 20
