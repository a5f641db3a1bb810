"""Online RL's learning pass on packed rows (data.pack=true with GRPO, PPO, RLOO): the per-token
log-probabilities of a batch of completions computed without its padding.

A padded pass runs (N, P + C) rows: each prompt left-padded to the longest prompt, each
completion right-padded to the longest completion, so a batch of short completions beside one
long one computes mostly pads. Here each sequence's real tokens (its prompt's, then its
completion's up to and including EOS) go into rows of up to `capacity` tokens by best-fit
decreasing (data/packing.py), with position ids restarting at 0 for each sequence, which is how
the model keeps attention inside it (models/hf.py); the positions are those the padded pass
gives (its pads never shift a position: rollout.positions). The log-probabilities, entropies and
values come back in the padded (N, C) layout, zero on the completion's pads, so the losses, the
masks and the figures are unchanged: the same loss and gradients, within float rounding
(tests/unit/test_packing_steps.py). Only the sampling (generation with a KV cache) stays padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ...data.packing import best_fit_decreasing, restarting_positions
from .rollout import TokenScores


@dataclass
class PackedPass:
    """R packed rows of a batch's N sequences: input_ids and position_ids (R, T); `where` (M,)
    the flat index (row * T + column) of the logit that predicts each of the M real completion
    tokens, and `to` (M,) that token's flat index in the (N, C) completion layout."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    where: torch.Tensor
    to: torch.Tensor


def pack_sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                   capacity: int) -> PackedPass:
    """prompt_ids / prompt_mask (N, P), left-padded; completion_ids / completion_mask (N, C),
    right-padded (the mask a prefix of ones) -> the packed rows (class docstring). Deterministic
    from the lengths alone."""
    N, C = completion_ids.shape
    p_len = prompt_mask.sum(-1).tolist()  # N prompts' real tokens
    c_len = completion_mask.sum(-1).tolist()  # N completions' real tokens
    lengths = [int(p) + int(c) for p, c in zip(p_len, c_len)]
    rows = best_fit_decreasing(torch.tensor(lengths).numpy(), max(capacity, max(lengths)), 0)
    T = max(sum(lengths[n] for n in row.tolist()) for row in rows)
    input_ids = torch.zeros((len(rows), T), dtype=torch.long)  # (R, T); pads at a row's end
    position_ids = torch.zeros((len(rows), T), dtype=torch.long)  # (R, T)
    where, to = [], []
    for r, row in enumerate(rows):
        at = 0
        for n in row.tolist():
            p, c = int(p_len[n]), int(c_len[n])
            seq = torch.cat([prompt_ids[n][prompt_mask[n].bool()].cpu(),
                             completion_ids[n, :c].cpu()])  # (p + c,)
            input_ids[r, at:at + p + c] = seq
            where.append(r * T + at + p - 1 + torch.arange(c))  # the logits before each token
            to.append(n * C + torch.arange(c))
            at += p + c
        position_ids[r] = restarting_positions([lengths[n] for n in row.tolist()] +
                                               ([T - at] if T > at else []))
    dev = completion_ids.device
    return PackedPass(input_ids.to(dev), position_ids.to(dev), torch.cat(where).to(dev),
                      torch.cat(to).to(dev))


def packed_completion_logps(model: nn.Module, prompt_ids: torch.Tensor,
                            prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                            completion_mask: torch.Tensor, temperature: float,
                            amp: ContextManager, capacity: int, entropy: bool = False
                            ) -> TokenScores:
    """rollout.completion_logps on packed rows: (N, C) log-probabilities at `temperature`, the
    entropies when asked, the values when the model's output has them (zero on pads)."""
    packed = pack_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask, capacity)
    with amp:
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids)
    logits = out.logits if hasattr(out, "logits") else out  # (R, T, V)
    picked = logits.flatten(0, 1)[packed.where].float() / temperature  # (M, V)
    logp_all = F.log_softmax(picked, dim=-1)  # (M, V)
    tokens = completion_ids.flatten()[packed.to]  # (M,)
    logps = _unpacked(logp_all.gather(-1, tokens[:, None])[:, 0], packed, completion_ids)
    values = getattr(out, "vpreds", None)  # (R, T): a value head's (ppo.py)
    if values is not None:
        values = _unpacked(values.flatten()[packed.where].float(), packed, completion_ids)
    if not entropy:
        return TokenScores(logps, None, values)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)  # (M,)
    return TokenScores(logps, _unpacked(ent, packed, completion_ids), values)


def _unpacked(values: torch.Tensor, packed: PackedPass, like: torch.Tensor) -> torch.Tensor:
    """(M,) per real completion token -> (N, C) in the padded layout, zero on pads."""
    out = values.new_zeros(like.numel())  # (N*C,)
    return out.index_put((packed.to,), values).view(like.shape)  # (N, C)
