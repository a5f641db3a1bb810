"""Sampling completions inside the training loop (online RL, grpo.py), and the per-token
log-probabilities the losses need.

Generation is batched (every completion of a micro-batch's prompts at once) with a KV cache,
and stops when every row has produced EOS or `max_new_tokens`. Prompts are left-padded; their
positions come from the attention mask, in generation and in the training forward alike, so a
pad never shifts a token's position.

Exact across world sizes: each prompt draws its tokens from a generator of its own, seeded by
(trainer.seed, step, the prompt's index in the training set), never by rank. A prompt's group
of completions always lives on one rank, so 1 and N workers sample the same completions.
Tokens are drawn by inverting the cumulative distribution with one uniform number per row and
token, drawn from that prompt's generator.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Sampling:
    """How completions are sampled: rl.temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens (TRL's names and defaults)."""
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, rl: object) -> "Sampling":
        return cls(rl.max_new_tokens, rl.temperature, rl.top_p, rl.top_k,  # type: ignore
                   rl.min_p, rl.repetition_penalty)  # type: ignore


def prompt_generator(seed: int, step: int, index: int) -> torch.Generator:
    """The generator of one prompt's completions at one step (a function of the three only)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step) * 1_000_003 + index)
    return g


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(N, T) attention mask -> (N, T) position ids: pads (left) at 0, real tokens from 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def unwrapped(model: nn.Module) -> nn.Module:
    """The module under DDP (whose forward would prepare a backward); FSDP2 shards in place."""
    return getattr(model, "module", model)


@torch.no_grad()
def sample_completions(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       generators: Sequence[torch.Generator], group: int, how: Sampling,
                       eos_id: int, pad_id: int, amp: ContextManager = contextlib.nullcontext(),
                       all_done: Callable[[bool], bool] = bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`group` completions of each prompt: prompt_ids / prompt_mask (B, P), left-padded; one
    generator per prompt. Returns completion_ids (B*G, C), right-padded with pad_id after EOS,
    and completion_mask (B*G, C): 1 up to and including EOS. Row b*G + j is prompt b's
    completion j. `all_done`: whether every rank is done, given this rank's answer; a sharded
    model (FSDP) gathers its weights in each forward, so its ranks stop together."""
    was_training = model.training
    model.eval()  # no dropout while sampling
    try:
        return _sample(model, prompt_ids, prompt_mask, generators, group, how, eos_id, pad_id,
                       amp, all_done)
    finally:
        model.train(was_training)


def _sample(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
            generators: Sequence[torch.Generator], group: int, how: Sampling, eos_id: int,
            pad_id: int, amp: ContextManager, all_done: Callable[[bool], bool]
            ) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids.repeat_interleave(group, dim=0)  # (N, P), N = B*G
    mask = prompt_mask.repeat_interleave(group, dim=0)  # (N, P)
    N, dev = ids.shape[0], ids.device
    pos = positions(mask)  # (N, P)
    done = torch.zeros(N, dtype=torch.bool, device=dev)  # (N,)
    seen = _seen(ids, mask, how)  # (N, V) or None: the tokens repetition_penalty penalises
    out: list[torch.Tensor] = []
    cache: dict = {}  # the KV cache, under the name this transformers takes it back by
    step_ids = ids
    for _ in range(how.max_new_tokens):
        with amp:
            o = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True,
                      **cache)
        cache = _kv_cache(o)
        u = torch.cat([torch.rand(group, generator=g) for g in generators]).to(dev)  # (N,)
        logits = o.logits[:, -1, :].float()  # (N, V)
        if seen is not None and seen.size(1) < logits.size(1):
            seen = F.pad(seen, (0, logits.size(1) - seen.size(1)))
        token = next_tokens(logits, u, how, seen)  # (N,)
        token = token.masked_fill(done, pad_id)
        if seen is not None:
            seen[torch.arange(N, device=dev), token] = True
        out.append(token)
        done = done | (token == eos_id)
        if all_done(bool(done.all())):
            break
        step_ids = token[:, None]  # (N, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (N, T+1)
        pos = pos[:, -1:] + 1  # (N, 1)
    completion = torch.stack(out, dim=1)  # (N, C)
    return completion, completion_mask(completion, eos_id)


def _kv_cache(out: object) -> dict:
    """The cache a forward returned, as the keyword the next forward takes: `cache` from
    transformers 5.24 (`past_key_values` deprecated), `past_key_values` before."""
    if getattr(out, "cache", None) is not None:
        return {"cache": out.cache}  # type: ignore[attr-defined]
    return {"past_key_values": out.past_key_values}  # type: ignore[attr-defined]


def completion_mask(completion: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(N, C) 1 for each token up to and including the first EOS (all of them without one)."""
    is_eos = completion == eos_id  # (N, C)
    after = (is_eos.cumsum(-1) - is_eos.long()) > 0  # (N, C) strictly after the first EOS
    return (~after).long()


def _seen(ids: torch.Tensor, mask: torch.Tensor, how: Sampling) -> Optional[torch.Tensor]:
    """(N, P) prompt ids and mask -> (N, max id + 1) which tokens each row holds (its real
    tokens only: a pad is not penalised, so a row's sampling does not depend on its batch);
    None when rl.repetition_penalty is 1 (off). Widened to the vocabulary at the first step."""
    if how.repetition_penalty == 1.0:
        return None
    seen = torch.zeros(ids.size(0), int(ids.max()) + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids, mask.bool())  # pads scatter False: left as they are


def token_probs(logits: torch.Tensor, how: Sampling,
                seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, V) logits -> (N, V) the distribution sampled from, as transformers orders its
    processors: repetition penalty (on `seen`, (N, V) bool), temperature, top-k, top-p (nucleus),
    min-p."""
    if seen is not None:
        penalised = torch.where(logits < 0, logits * how.repetition_penalty,
                                logits / how.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    logits = logits / how.temperature
    if how.top_k:
        kth = torch.topk(logits, min(how.top_k, logits.size(-1))).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (N, V)
    if how.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)  # (N, V)
        drop = sorted_p.cumsum(-1) - sorted_p >= how.top_p  # the mass before it reaches top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    if how.min_p:
        live = probs / probs.sum(-1, keepdim=True)  # (N, V) renormalised after top-p
        probs = probs.masked_fill(live < how.min_p * live.max(-1, keepdim=True).values, 0.0)
    return probs


def next_tokens(logits: torch.Tensor, u: torch.Tensor, how: Sampling,
                seen: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N, V) logits and (N,) uniforms in [0, 1) -> (N,) tokens of `token_probs`, drawn by the
    inverse CDF."""
    probs = token_probs(logits, how, seen)  # (N, V)
    cdf = probs.cumsum(-1)  # (N, V)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)  # (N, 1)
    return pick.clamp(max=probs.size(-1) - 1)[:, 0]


class TokenScores(NamedTuple):
    """(N, C) per completion token: its log-probability, the entropy of its position's
    distribution (when asked), the value head's estimate before it (a model with one: PPO)."""
    logps: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None


def completion_logps(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                     completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                     temperature: float, amp: ContextManager, entropy: bool = False
                     ) -> TokenScores:
    """Log-probabilities of each completion token at `temperature` (TRL divides the logits by it
    too), the entropies when asked, and the values when the model's output has them."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P+C)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (N, P+C)
    with amp:
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask))
    logits = out.logits if hasattr(out, "logits") else out  # (N, P+C, V)
    C = completion_ids.size(1)
    logits = logits[:, -C - 1:-1, :].float() / temperature  # (N, C, V): predicts each token
    logp_all = F.log_softmax(logits, dim=-1)  # (N, C, V)
    logps = logp_all.gather(-1, completion_ids[..., None])[..., 0]  # (N, C)
    values = getattr(out, "vpreds", None)  # a value head's (ppo.py); not ModelOutput.values()
    values = values[:, -C - 1:-1].float() if values is not None else None  # (N, C)
    if not entropy:
        return TokenScores(logps, None, values)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)  # (N, C)
    return TokenScores(logps, ent, values)
