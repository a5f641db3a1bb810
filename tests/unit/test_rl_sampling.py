"""Sampling options as TRL passes them to transformers (rl.temperature, top_p, top_k, min_p,
repetition_penalty; tasks/rl/rollout.py `token_probs`): the distribution sampled from equals
the one transformers' own logits processors leave, in their order, on the same logits; the
defaults are TRL's."""

from __future__ import annotations

import pytest
import torch

from paratrain.tasks.rl.rollout import Sampling, token_probs


def _transformers_probs(logits, ids, how):
    gen = pytest.importorskip("transformers.generation.logits_process")
    steps = [gen.RepetitionPenaltyLogitsProcessor(how.repetition_penalty),
             gen.TemperatureLogitsWarper(how.temperature)]
    if how.top_k:
        steps.append(gen.TopKLogitsWarper(how.top_k))
    if how.top_p < 1.0:
        steps.append(gen.TopPLogitsWarper(how.top_p))
    if how.min_p:
        steps.append(gen.MinPLogitsWarper(how.min_p))
    scores = logits.clone()
    for step in steps:
        scores = step(ids, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("how", [
    Sampling(8, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
    Sampling(8, temperature=1.2, min_p=0.2),
    Sampling(8, repetition_penalty=0.8),
], ids=["all", "min_p", "reward-repeats"])
def test_the_sampled_distribution_is_transformers(how):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64) * 3  # (N, V)
    ids = torch.randint(0, 50, (4, 9), generator=g)  # (N, T) what each row holds
    seen = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, ids, True)
    ours = token_probs(logits, how, seen if how.repetition_penalty != 1.0 else None)
    ours = ours / ours.sum(-1, keepdim=True)
    assert torch.allclose(ours, _transformers_probs(logits, ids, how), rtol=0, atol=1e-12)


def test_the_defaults_are_trls():
    trl = pytest.importorskip("trl")
    fields = trl.GRPOConfig.__dataclass_fields__
    from paratrain.config.rl import RLConfig
    rl = RLConfig()
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(rl, key) == fields[key].default, key
    assert Sampling.of(rl) == Sampling(rl.max_new_tokens, 1.0, 1.0, 0, None, 1.0)
