"""CoSENT (Su, 2022; sentence-transformers' CoSENTLoss), the other loss of scored pairs
(`embedding.pair_loss=cosent`): where CosineSimilarityLoss fits each pair's cosine to its score,
CoSENT only asks that the pairs be ordered by cosine as they are by score,

    loss = log(1 + sum over pairs i, j with score_i < score_j of exp(scale (cos_i - cos_j)))

so any scale of scores will do (a 0 to 5 rating as it is). The sum runs over every two pairs of
the *global* batch: each rank's cosines are gathered from every rank with their gradients (as
the ranking loss gathers its candidates), under gradient accumulation over every micro-batch of
the step (GradCache, grad_cache.py), so 1 and N workers, and any accumulation, run the same
steps. Validation scores the pairs of each held-out block among themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gather import gather


def cosent(cos: torch.Tensor, score: torch.Tensor, scale: float) -> torch.Tensor:
    """0-dim CoSENT of N pairs' cosines (N,) and scores (N,): sentence-transformers' formula
    (its 1e12 mask, the 0 that stands for the 1 in log(1 + ...))."""
    diff = scale * (cos[:, None] - cos[None, :])  # (N, N): [i, j] = scale (cos_i - cos_j)
    lower = score[:, None] < score[None, :]  # (N, N): pair i scored below pair j
    diff = diff - (~lower).to(diff.dtype) * 1e12
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), dim=0)


def cosent_losses(u: torch.Tensor, v: torch.Tensor, score: torch.Tensor, scale: float,
                  across_ranks: bool = True) -> torch.Tensor:
    """(B,) every entry the CoSENT of the global batch (this rank's pairs u, v (B, H), scores
    (B,), gathered from every rank when `across_ranks`): summed over the pairs of every rank
    and divided by their number it is the loss, and each rank's gradient is its share."""
    cos = F.cosine_similarity(u, v, dim=-1)  # (B,)
    score = score.float()
    if across_ranks:
        cos, score = gather(cos)[0], gather(score)[0]  # (W B,)
    return cosent(cos, score, scale).expand(u.shape[0])
