"""The advantage estimators of online RL, in one place; each task picks one:

    group-relative  (grpo.py)   a completion's reward less its group's mean, scaled by the
                                group's / the batch's std or not (TRL 1.16 GRPOTrainer)
    leave-one-out   (rloo.py)   its reward less the mean of the other completions of its prompt
                                (TRL 1.16 RLOOTrainer)
    GAE             (ppo.py)    per token, from per-token rewards and a value head's values,
                                then whitened over the step (TRL 0.x PPOTrainer)

All three work on one rank's rows; the statistics of a whole step over every rank (GRPO's
batch std, RLOO's normalisation, PPO's whitening) are all-reduced by the task and passed in.
"""

from __future__ import annotations

import torch


def group_relative(rewards: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """(N,) rewards of N/group prompts' completions (a prompt's `group` rows together) ->
    (N,) advantages: each reward less its group's mean, divided by the group's std ("group"),
    the batch's ("batch") or not at all ("none"), + 1e-4; as TRL 1.16 GRPOTrainer
    (_generate_and_score_completions, sum_then_normalize). The std is unbiased (TRL's nanstd).
    "batch" here is the rank's batch (TRL: the generation batch over all processes)."""
    grouped = rewards.view(-1, group)  # (B, G)
    advantages = (grouped - grouped.mean(dim=1, keepdim=True)).view(-1)  # (N,)
    if scale == "group":
        std = grouped.std(dim=1).repeat_interleave(group)  # (N,)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards)  # (N,)
    else:
        return advantages
    return advantages / (std + 1e-4)


def leave_one_out(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """(N,) rewards, a prompt's `group` rows together -> (N,) each reward less the mean of the
    group's other rewards (TRL 1.16 RLOOTrainer: (sum - r) / (G - 1) as the baseline)."""
    grouped = rewards.view(-1, group)  # (B, G)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (group - 1)  # (B, G)
    return (grouped - baseline).view(-1)


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C) rewards, values and mask -> (advantages, returns), both (N, C), unwhitened."""
    values, rewards = values * mask, rewards * mask
    last = torch.zeros_like(values[:, 0])  # (N,)
    reversed_: list[torch.Tensor] = []
    C = rewards.size(1)
    for t in reversed(range(C)):
        next_values = values[:, t + 1] if t < C - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        reversed_.append(last)
    advantages = torch.stack(reversed_[::-1], dim=1)  # (N, C)
    return advantages, advantages + values


def whiten(x: torch.Tensor, mask: torch.Tensor, mean: float, var: float) -> torch.Tensor:
    """TRL's masked_whiten (shift_mean=True) with the mean and (unbiased) variance given."""
    return (x - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=x.dtype)) * mask


def step_moments(env: object, values: list) -> tuple[float, float]:
    """(mean, unbiased variance) of the (masked) values of a whole step over every rank:
    `values` holds this rank's (tensor, mask) pairs."""
    n, s1, s2 = env.all_reduce_sum([  # type: ignore[attr-defined]
        sum(float(m.sum()) for _, m in values),
        sum(float((x * m).sum()) for x, m in values),
        sum(float((x ** 2 * m).sum()) for x, m in values)]).tolist()
    mean = s1 / max(n, 1.0)
    return mean, (s2 / max(n, 1.0) - mean * mean) * n / max(n - 1, 1.0)
