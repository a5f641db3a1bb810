"""PPO's pieces as TRL's PPOTrainer computes them (trl 0.x, trl/trainer/ppo_trainer.py, the
trainer DataDreamer wraps: `compute_rewards`, `compute_advantages`, `loss`; TRL 1.x has no PPO):

    reward_t    = -kl_coef * (log pi_old - log ref)_t, + the score at the completion's last token
    advantage   = GAE(gamma, lam) of the rewards against the value head's values, whitened
    returns     = advantage (before whitening) + values
    policy loss = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))
    value loss  = 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)
    per token   = policy loss + vf_coef * value loss

averaged over the completion tokens. Here the average is over the completion tokens of the
whole global batch (a sum over tokens, the loop's loss units), and the whitening uses the mean
and variance of the whole step's advantages over all ranks (TRL: each process's own), so 1 and N
workers give the same run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .advantages import gae, whiten  # noqa: F401  (PPO's estimator; re-exported for the tests)


@dataclass(frozen=True)
class PPOOptions:
    """rl.kl_coef, gamma, lam, epsilon (the clip range), cliprange_value, vf_coef."""
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    epsilon: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1

    @classmethod
    def of(cls, rl: object) -> "PPOOptions":
        return cls(rl.kl_coef, rl.gamma, rl.lam, rl.epsilon,  # type: ignore[attr-defined]
                   rl.cliprange_value, rl.vf_coef)  # type: ignore[attr-defined]


def token_rewards(scores: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor,
                  mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """scores (N,), log-probs and mask (N, C) -> (N, C) rewards: the KL penalty on every token,
    the score added at each completion's last token."""
    rewards = -kl_coef * (old_logps - ref_logps) * mask  # (N, C)
    last = (mask.cumsum(-1) * mask).argmax(-1)  # (N,) the last counted token
    return rewards.index_put((torch.arange(len(scores)), last),
                             scores.to(rewards.dtype), accumulate=True)


def ppo_token_losses(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                     values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                     o: PPOOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All (N, C) -> (the per-token loss, its policy part, its value part)."""
    clipped_v = torch.clamp(values, old_values - o.cliprange_value,
                            old_values + o.cliprange_value)
    vf = 0.5 * torch.max((values - returns) ** 2, (clipped_v - returns) ** 2)
    ratio = torch.exp(logps - old_logps)
    pg = torch.max(-advantages * ratio,
                   -advantages * torch.clamp(ratio, 1 - o.epsilon, 1 + o.epsilon))
    return pg + o.vf_coef * vf, pg, vf
