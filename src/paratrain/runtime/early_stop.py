"""Early stopping and the best evaluation (DataDreamer's load-best-at-end), decided from the
validation loss, which is exact and the same on every rank whatever the world size, so every rank
stops at the same step and the kept weights do not depend on how many workers ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class BestTracker:
    patience: Optional[int] = None  # evaluations without improvement before stopping; None: never
    threshold: float = 0.0  # an improvement must lower the loss by more than this
    best_loss: Optional[float] = None
    best_step: Optional[int] = None
    evals_without_improvement: int = 0
    # the task's figures of the best evaluation (accuracy, ...): keep_best reports them, so a
    # snapshot carries them (JSON numbers)
    best_metrics: dict = field(default_factory=dict)

    def update(self, step: int, val_loss: Optional[float], metrics: Optional[dict] = None
               ) -> bool:
        """Record an evaluation (its loss, and the task's figures); True when it is the best so
        far (the lowest loss). Patience counts evaluations that did not beat the best by more
        than `threshold`."""
        if val_loss is None:
            return False
        first = self.best_loss is None
        if first or val_loss < self.best_loss - self.threshold:
            self.evals_without_improvement = 0
        else:
            self.evals_without_improvement += 1
        if first or val_loss < self.best_loss:
            self.best_loss, self.best_step = val_loss, step
            self.best_metrics = {k: v if v is None or isinstance(v, (int, str)) else float(v)
                                 for k, v in (metrics or {}).items()}
            return True
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.evals_without_improvement >= self.patience

    def why(self) -> str:
        return (f"validation loss has not improved by more than {self.threshold:g} for "
                f"{self.evals_without_improvement} evaluations (best {self.best_loss:.4f} at "
                f"step {self.best_step})")

    def state_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("patience", "threshold")}

    def load_state_dict(self, state: dict) -> None:
        self.best_loss, self.best_step = state.get("best_loss"), state.get("best_step")
        self.evals_without_improvement = int(state.get("evals_without_improvement", 0))
        self.best_metrics = dict(state.get("best_metrics") or {})  # (older snapshots: none)
