"""Online RL with RLOO (`data.format=prompts`, `trainer.objective=rloo`; REINFORCE Leave-One-Out,
Ahmadian et al. 2024, as TRL 1.16's RLOOTrainer): each step samples rl.num_generations
completions of each prompt (as GRPO: grpo.py, rollout.py) and scores them; with rl.beta > 0 the
reward of each completion loses beta x its summed log-ratio to the reference (the first-order
KL, in the reward, not in the loss); a completion's advantage is its reward less the mean of
its prompt's other completions (advantages.py: leave_one_out), optionally normalised over the
whole step (rl.normalize_advantages, all ranks). The loss is the clipped surrogate on each
completion's summed log-probability (one ratio per sequence):

    ratio = exp(sum_t log pi - sum_t log pi_old)
    loss  = mean over completions of -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)

written as a sum over completions (the loop's loss units), so 1 and N workers give the same
run. TRL's defaults that differ from GRPO's: rl.beta=0.05 and rl.num_generations=2 (the
online-RL guide's port table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from ..base import NO_FROZEN, Frozen
from .advantages import leave_one_out, step_moments
from .grpo import GRPOTask


def sequence_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, epsilon: float, epsilon_high: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """logps (N, C), old_logps (N,) summed, advantages (N,), mask (N, C) -> ((N,) each
    completion's loss, (N,) its ratio), as TRL 1.16 RLOOTrainer._compute_loss."""
    ratio = torch.exp((logps * mask).sum(-1) - old_logps)  # (N,)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # (N,)
    return -torch.min(ratio * advantages, clipped * advantages), ratio


@dataclass
class RLOOTask(GRPOTask):
    """RLOO on prompt records (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.unit_name = "completions"

    def _advantages(self, model: nn.Module, batches: list, scored: list, env: Any,
                    amp: ContextManager, frozen: Frozen) -> list:
        """Old (summed) log-probs, the KL in the reward, leave-one-out advantages; normalised
        over the whole step when rl.normalize_advantages."""
        out = [self._rloo(model, b, s, amp, frozen) if b is not None else None
               for b, s in zip(batches, scored)]
        kept = [b for b in out if b is not None]
        if self.cfg.rl.normalize_advantages:
            mean, var = step_moments(env, [(b["advantages"], torch.ones_like(b["advantages"]))
                                           for b in kept])
            for b in kept:  # TRL: (A - mean) / (std + 1e-4), the std unbiased
                b["advantages"] = (b["advantages"] - mean) / (max(var, 0.0) ** 0.5 + 1e-4)
        return out

    def _rloo(self, model: nn.Module, b: dict, per_fn: torch.Tensor, amp: ContextManager,
              frozen: Frozen) -> dict:
        rl = self.cfg.rl
        b = self._masked(b, per_fn)
        mask = b["loss_mask"].float()  # (N, C) TRL masks truncated completions here too
        reward = self.rewards.total(per_fn).to(mask.device)  # (N,)
        with torch.no_grad():
            old = self._logps(model, b, amp).logps  # (N, C)
            if rl.beta != 0.0:
                kl = (old - self._reference_logps(model, b, amp, frozen)) * mask  # (N, C)
                reward = reward - rl.beta * kl.sum(-1)
                b["kl_tokens"] = kl.sum()
        b.update({"old_logps": (old * mask).sum(-1),
                  "advantages": leave_one_out(reward.double(), self.group).float()})
        return b

    def _masked(self, b: dict, per_fn: torch.Tensor) -> dict:
        truncated = ~(b["completion_ids"] == self.eos).any(dim=1)  # (N,) no EOS: cut short
        mask = b["completion_mask"]
        if self.cfg.rl.mask_truncated_completions:
            mask = mask * (~truncated)[:, None]
        return {**b, "loss_mask": mask, "rewards": per_fn, "truncated": truncated}

    def count_units(self, batch: dict) -> int:
        return int(batch["loss_mask"].size(0))

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(the micro-batch's summed completion losses, its completions, sums for figures)."""
        logps, entropy, _ = self._logps(model, batch, amp, entropy=True)  # (N, C) each
        mask, A = batch["loss_mask"], batch["advantages"]
        o = self.options
        loss, ratio = sequence_loss(logps, batch["old_logps"], A, mask, o.epsilon, o.high)
        ratio = ratio.detach()
        low, high = (ratio < 1 - o.epsilon) & (A < 0), (ratio > 1 + o.high) & (A > 0)
        zero = torch.zeros((), dtype=torch.float64)
        counts = {"tokens": mask.sum().double(), "entropy": (entropy * mask).sum().double(),
                  "sequences": float(A.numel()), "seq_clip_low": low.sum().double(),
                  "seq_clip_high": high.sum().double(),
                  "seq_clip_region": (low | high).sum().double(),
                  "clip_low": zero, "clip_high": zero, "clip_region": zero}
        kl: Optional[torch.Tensor] = batch.get("kl_tokens")
        if kl is not None:
            counts["kl"] = kl.double()
        return loss.sum(), int(A.numel()), counts

    def train_metrics(self, counts: dict) -> dict:
        """GRPO's figures; clip_ratio/* per completion (TRL's RLOO clips whole sequences)."""
        out = super().train_metrics(counts)
        n = counts.get("sequences", 0.0)
        for side in ("low", "high", "region"):
            if n:
                out[f"clip_ratio/{side}_mean"] = counts[f"seq_clip_{side}"] / n
        return out

    def describe(self, n_params: int) -> str:
        rl = self.cfg.rl
        return (f"RLOO ({self.group} completions per prompt, beta {rl.beta}) on " +
                super().describe(n_params).split(" on ", 1)[1])

    @property
    def model_info(self) -> dict:
        return {**super().model_info, "objective": "rloo"}
