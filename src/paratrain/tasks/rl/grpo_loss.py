"""GRPO's loss on one micro-batch of sampled completions, as TRL 1.16 GRPOTrainer._compute_loss
computes it (trl/trainer/grpo_trainer.py; the test drives TRL's own code on the same tensors):

    ratio = exp(log pi - log pi_old)                       (pi_old: the policy that sampled)
    per-token loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)
                     + beta * k3 * ratio        (k3 = exp(ref - log pi) - (ref - log pi) - 1)

k3 is the KL estimator; the `ratio` factor is TRL's importance-sampling correction of it
(`use_bias_correction_kl`, TRL's default; rl.bias_correction_kl=false drops it). On-policy the
ratio is 1 (its gradient is not: the factor moves the KL term's gradient).

summed over completion tokens, then normalised by `loss_type`. The loop weighs every
micro-batch's (sum, units) by the units of the whole global batch, so each loss type is written
as a sum over its units:

    dapo     sum of token losses / completion tokens of the global batch   units: tokens
    grpo     sum over completions of their mean token loss / completions   units: completions
    dr_grpo  sum of token losses / max_new_tokens / completions            units: completions
    bnpo     per micro-batch: token mean x its completions / completions   units: completions

dapo, grpo and dr_grpo are then the same on 1 and N workers; bnpo averages per micro-batch, as
TRL's does (the same only when micro-batches are the same size). The loss types are the table
`LOSS_TYPES` (name -> its reduction); config/rl.py takes its choices from the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from ...config.rl import LOSS_TYPE_NAMES


@dataclass(frozen=True)
class LossOptions:
    """rl.loss_type, beta, epsilon, epsilon_high, max_new_tokens, bias_correction_kl."""
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    max_new_tokens: int = 512
    bias_correction_kl: bool = True

    @classmethod
    def of(cls, rl: object) -> "LossOptions":
        return cls(rl.loss_type, rl.beta, rl.epsilon, rl.epsilon_high,  # type: ignore
                   rl.max_new_tokens, rl.bias_correction_kl)  # type: ignore

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class TokenTerms:
    """The per-token pieces of the loss, kept for the figures: (N, C) each."""
    loss: torch.Tensor  # the per-token loss
    ratio: torch.Tensor  # pi / pi_old
    kl: Optional[torch.Tensor]  # the k3 estimate of KL(pi || ref) (beta > 0)


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor],
                advantages: torch.Tensor, o: LossOptions) -> TokenTerms:
    """logps, old_logps, ref_logps (N, C); advantages (N,) -> the per-token loss (module
    docstring)."""
    ratio = torch.exp(logps - old_logps)  # (N, C)
    A = advantages[:, None]  # (N, 1)
    clipped = torch.clamp(ratio, 1 - o.epsilon, 1 + o.high)  # (N, C)
    loss = -torch.min(ratio * A, clipped * A)  # (N, C)
    kl = None
    if o.beta != 0.0:
        assert ref_logps is not None, "beta > 0 needs the reference's log-probs"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # (N, C)
        if o.bias_correction_kl:  # TRL's use_bias_correction_kl: weighed by pi / pi_old
            kl = kl * ratio
        loss = loss + o.beta * kl
    return TokenTerms(loss, ratio, kl)


class LossType(NamedTuple):
    """One rl.loss_type: a micro-batch's (N,) summed token losses, (N,) token counts and
    max_new_tokens -> its sum over its loss units; and whether those units are tokens (else
    completions)."""
    reduce: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    per_token: bool


LOSS_TYPES: dict[str, LossType] = {  # the module docstring's table
    "dapo": LossType(lambda summed, tokens, new: summed.sum(), per_token=True),
    "grpo": LossType(lambda summed, tokens, new: (summed / tokens.clamp(min=1.0)).sum(),
                     per_token=False),
    "dr_grpo": LossType(lambda summed, tokens, new: summed.sum() / new, per_token=False),
    "bnpo": LossType(lambda summed, tokens, new:
                     summed.sum() / tokens.sum().clamp(min=1.0) * summed.numel(),
                     per_token=False),
}
assert tuple(LOSS_TYPES) == LOSS_TYPE_NAMES, "config/rl.py names the loss types of this table"


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, o: LossOptions
                ) -> tuple[torch.Tensor, int]:
    """(N, C) token losses and (N, C) mask -> (the micro-batch's sum over its loss units, those
    units), per rl.loss_type (module docstring)."""
    masked = (per_token * mask).sum(-1)  # (N,) each completion's summed loss
    kind = LOSS_TYPES[o.loss_type]
    return kind.reduce(masked, mask.sum(-1), o.max_new_tokens), loss_units(mask, o.loss_type)


def loss_units(mask: torch.Tensor, loss_type: str) -> int:
    """The loss units of a micro-batch whose completions' (N, C) mask this is."""
    return int(mask.sum()) if LOSS_TYPES[loss_type].per_token else int(mask.size(0))


def clip_counts(terms: TokenTerms, advantages: torch.Tensor, mask: torch.Tensor,
                o: LossOptions) -> dict:
    """Tokens whose ratio the clip cut (TRL's clip_ratio/low, high, region), summed."""
    A = advantages[:, None]  # (N, 1)
    low = (terms.ratio < 1 - o.epsilon) & (A < 0)  # (N, C)
    high = (terms.ratio > 1 + o.high) & (A > 0)  # (N, C)
    return {"clip_low": (low * mask).sum().double(), "clip_high": (high * mask).sum().double(),
            "clip_region": ((low | high) * mask).sum().double()}
