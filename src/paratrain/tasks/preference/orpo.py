"""Preference optimization without a reference model (`data.format=preference`):
`trainer.objective=orpo` (odds-ratio preference optimization, Hong et al., 2024; TRL's
`ORPOTrainer`, trl.experimental.orpo in TRL 1.16) and `trainer.objective=simpo` (SimPO, Meng et
al., 2024; TRL's `CPOTrainer` with `loss_type="simpo"`, trl.experimental.cpo).

Per pair, with p = a response's log-probability averaged over its tokens (prompt and pads
masked; chosen and rejected rows in one forward, as DPO's):

    orpo:  log_odds = (p_c - p_r) - (log(1 - e^p_c) - log(1 - e^p_r))
           loss = nll_c - orpo.beta * log sigmoid(log_odds)
           nll_c: the chosen sequence's mean cross-entropy over prompt and response (TRL's)
    simpo: loss = -log sigmoid(simpo.beta * (p_c - p_r - simpo.gamma / simpo.beta))
                  + simpo.cpo_alpha * nll_c,   nll_c over the chosen response only (TRL's CPO)

The rewards are beta * p of each response (TRL's). The loss unit is a pair, as for DPO, so 1 and
N workers (and any accumulation) run the same steps: nll_c is each pair's own token mean, where
TRL takes the mean over the chosen tokens of its whole device batch (the same when the batch is
one pair or its chosen sequences have one length: tests/unit/test_trl_parity.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ...data.dataset import IGNORE_INDEX
from ...formatting import human_count
from ..base import NO_FROZEN, Frozen, to_device
from .dpo import DPOTask, reward_counts, reward_metrics


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, without cancellation (TRL's split at -ln 2)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)),
                       torch.log(-torch.expm1(x)))


def token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, T) log-probability of each target (0 where IGNORE_INDEX) from (N, T, V) logits."""
    return -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="none").view(targets.shape)


def whole_sequence_targets(batch: dict) -> torch.Tensor:
    """(N, T) next-token targets over prompt and response alike (pads: IGNORE_INDEX): the
    batch's response `targets`, and before them the next input token."""
    ids, mask, targets = batch["input_ids"], batch["attention_mask"], batch["targets"]
    after = torch.full_like(ids, IGNORE_INDEX)  # (N, T) the next input token, where real
    after[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    return torch.where(targets != IGNORE_INDEX, targets, after)


@dataclass
class ORPOTask(DPOTask):
    """Preference pairs on a causal LM, no reference (module docstring); DPO's records,
    batches, memory probe and reward figures."""

    nll_weight: ClassVar[float] = 1.0  # of nll_c beside the preference term

    def __post_init__(self) -> None:
        self.reference = None  # none is held or computed: build_frozen gives nothing

    @property
    def beta(self) -> float:
        return self.cfg.orpo.beta

    def nll(self, logits: torch.Tensor, batch: dict, logps: torch.Tensor) -> torch.Tensor:
        """(B,) each chosen sequence's mean cross-entropy over prompt and response."""
        B = logits.shape[0]
        whole = whole_sequence_targets({k: v[:B] for k, v in batch.items()})  # (B, T)
        counted = (whole != IGNORE_INDEX).sum(-1).clamp(min=1)  # (B,)
        return -token_logps(logits, whole).sum(-1) / counted

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple:
        """((B,) the preference term, {name: (B,) figure}) from the mean log-probs (B,)."""
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))  # (B,)
        ratio = F.logsigmoid(log_odds)  # (B,)
        return -self.beta * ratio, {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the pairs' losses, pairs, sums of the rewards, right preferences, the NLL
        and the pair term's figures)."""
        batch = to_device(batch, device)
        with amp:
            out = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits if hasattr(out, "logits") else out  # (2B, T, V)
        targets = batch["targets"]  # (2B, T) the response tokens
        tokens = (targets != IGNORE_INDEX).sum(-1).clamp(min=1)  # (2B,)
        logps = token_logps(logits, targets).sum(-1) / tokens  # (2B,) mean per response token
        B = logps.shape[0] // 2
        nll = self.nll(logits[:B], batch, logps[:B])  # (B,)
        term, figures = self.pair_losses(logps[:B], logps[B:])  # (B,)
        rewards = self.beta * logps.detach()  # (2B,)
        counts = reward_counts(rewards[:B], rewards[B:])
        counts.update({name: v.detach().sum().double() for name, v in
                       {"nll_loss": nll, **figures}.items()})
        return (self.nll_weight * nll + term).sum(), B, counts

    def train_metrics(self, counts: dict) -> dict:
        n = counts.get("samples", 0.0)
        own = {k: counts[k] / n for k in counts if n and k not in
               ("chosen", "rejected", "correct", "samples")}
        return {**reward_metrics(counts), **own}

    def describe(self, n_params: int) -> str:
        return (f"{type(self).__name__[:-4]} (beta {self.beta}) on model hf "
                f"({self.cfg.model.path}): {human_count(n_params)} parameters; no reference; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")


@dataclass
class SimPOTask(ORPOTask):
    """SimPO: a margin on the mean log-probs, and CPO's NLL on the chosen responses."""

    @property
    def beta(self) -> float:
        return self.cfg.simpo.beta

    @property
    def nll_weight(self) -> float:  # type: ignore[override]
        return self.cfg.simpo.cpo_alpha

    def nll(self, logits: torch.Tensor, batch: dict, logps: torch.Tensor) -> torch.Tensor:
        return -logps  # (B,) the chosen responses' mean cross-entropy

    def pair_losses(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple:
        gamma = self.cfg.simpo.gamma / self.beta
        return -F.logsigmoid(self.beta * ((chosen - rejected) - gamma)), {}
