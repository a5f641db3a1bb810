"""RLOO (tasks/rl/rloo.py) against TRL 1.16's own RLOOTrainer on the same tensors: the loss and
its gradient through RLOOTrainer._compute_loss run as it is; the leave-one-out advantages with
the KL in the reward against TRL's formula (_generate_and_score_completions, transcribed: it
is one long method that generates too); TRL's defaults named where they differ from GRPO's."""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import torch

from paratrain.tasks.rl.advantages import leave_one_out
from paratrain.tasks.rl.rloo import sequence_loss

N, C, G = 6, 7, 3


def _tensors(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(N, C, generator=g, dtype=torch.float64) * 0.3  # (N, C)
    mask = torch.ones(N, C, dtype=torch.float64)
    for row, length in enumerate([7, 3, 5, 1, 6, 4]):
        mask[row, length:] = 0
    # the summed log-ratios: ratios past both ends of the clip, and inside it
    old = (logps * mask).sum(-1) - torch.tensor([0.5, -0.5, 0.1, -0.1, 0.05, 0.3],
                                                dtype=torch.float64)
    return {"logps": logps, "old": old, "mask": mask,
            "advantages": torch.randn(N, generator=g, dtype=torch.float64)}


def _trl_loss(t: dict, logps: torch.Tensor, eps: float, eps_high: float) -> torch.Tensor:
    rloo = pytest.importorskip("trl.trainer.rloo_trainer")
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps),
                                                             None),
        aux_loss_enabled=False, epsilon_low=eps, epsilon_high=eps_high,
        model=types.SimpleNamespace(training=True), _metrics={"train": defaultdict(list)},
        accelerator=types.SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x))
    inputs = {"prompt_ids": torch.zeros(N, 2, dtype=torch.long),
              "prompt_mask": torch.ones(N, 2, dtype=torch.long),
              "completion_ids": torch.zeros(N, C, dtype=torch.long),
              "completion_mask": t["mask"].long(), "old_logps": t["old"],
              "advantages": t["advantages"]}
    return rloo.RLOOTrainer._compute_loss(trainer, None, inputs)


def test_the_loss_and_its_gradient_are_trls():
    t = _tensors()
    ours_in = t["logps"].clone().requires_grad_()
    per_seq, ratio = sequence_loss(ours_in, t["old"], t["advantages"], t["mask"], 0.2, 0.28)
    ours = per_seq.sum() / N  # the loop: the sum over completions / the completions
    ours.backward()
    theirs_in = t["logps"].clone().requires_grad_()
    theirs = _trl_loss(t, theirs_in, 0.2, 0.28)
    theirs.backward()
    clipped = (ratio < 0.8) | (ratio > 1.28)
    assert clipped.any() and (~clipped).any()  # both sides of the clip run
    assert abs(float((ours - theirs).detach())) <= 1e-9
    assert torch.allclose(ours_in.grad, theirs_in.grad, rtol=0, atol=1e-9)
    assert float(ours_in.grad.abs().sum()) > 0


def _trl_advantages(rewards, old, ref, mask, beta):
    """RLOOTrainer._generate_and_score_completions (TRL 1.16, lines 1664-1699), every reward
    scored, normalize_advantages=False."""
    per_token_kl = old - ref
    kl = (per_token_kl * mask).sum(-1)
    rewards = rewards - beta * kl
    grouped = rewards.view(-1, G)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baselines = ((torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (counts - 1)).view(-1)
    return torch.nan_to_num(rewards - baselines, nan=0.0)


def test_leave_one_out_advantages_with_the_kl_in_the_reward_are_trls():
    t = _tensors(1)
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(N, generator=g, dtype=torch.float64)
    old = t["logps"]
    ref = old + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.2
    beta = 0.05
    ours = leave_one_out(rewards - beta * ((old - ref) * t["mask"]).sum(-1), G)
    assert torch.allclose(ours, _trl_advantages(rewards, old, ref, t["mask"], beta),
                          rtol=0, atol=1e-12)
    assert float(ours.view(-1, G).sum(dim=1).abs().max()) <= 1e-12  # a group's sum is 0


def test_trls_rloo_defaults_are_the_ones_the_guide_names():
    """RLOOConfig's defaults that differ from GRPOConfig's (the guide's port table names them:
    rl.beta=0.05 rl.num_generations=2); the rest are the same as GRPO's and ours."""
    trl = pytest.importorskip("trl")
    fields = trl.RLOOConfig.__dataclass_fields__
    assert fields["beta"].default == 0.05 and fields["num_generations"].default == 2
    assert fields["normalize_advantages"].default is False
    from paratrain.config.rl import RLConfig
    rl = RLConfig()
    assert rl.normalize_advantages is False
    assert (fields["epsilon"].default, fields["num_iterations"].default,
            fields["max_completion_length"].default, fields["temperature"].default) == \
        (rl.epsilon, rl.num_iterations, rl.max_new_tokens, rl.temperature)
