"""Kahneman-Tversky optimization (`trainer.objective=kto`, Ethayarajh et al., 2024): a causal LM
learns from completions marked desirable or undesirable, one at a time, against a frozen
reference. The loss is TRL's KTOTrainer's (loss_type "kto"; tests/unit/test_trl_parity.py
drives TRL's own code on the same batch):

    r      = log pi(completion) - log ref(completion)          (summed over completion tokens)
    KL     = max(0, mean over the batch's mismatched sequences of log pi - log ref), no gradient
    loss   = desirable_weight   * (1 - sigmoid(beta (r - KL)))     for a desirable example
             undesirable_weight * (1 - sigmoid(beta (KL - r)))     for an undesirable one

averaged over the examples. The mismatched sequences (tasks/preference/kto_records.py: each prompt with another
example's completion) are scored by policy and reference without gradients. TRL averages the
per-device KL estimates over the processes; here the sums and counts are added over the
data-parallel ranks, and under gradient accumulation over every micro-batch of the step too
(`rollout`, the loop's "whole step first" seam, scores the step's mismatched sequences before
it trains on any): one estimate per optimizer step, so 1 worker with accumulation k runs the
steps of k workers. (TRL estimates it per device batch: its accumulated micro-steps each have
their own.) With data.drop_last=false a short last step may leave a rank without a micro-batch;
then each micro-step keeps its own estimate, summed over the ranks.

An example is the loss unit. Rewards are beta r; metrics.jsonl logs rewards/chosen (the mean
over desirable examples), rewards/rejected, rewards/margins and kl (TRL's names). The
reference is DPO's (preference.py `Reference`): a frozen copy of model.path, the policy with
LoRA's adapters off, or dpo.reference; precomputed reference log-probs are DPO's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from ...formatting import human_count
from ..base import NO_FROZEN, Frozen, sequence_logps, to_device
from ..finetuning import Encoder
from .dpo import DPOTask, PairEncoder
from .packed_pairs import half_rows


@dataclass
class KTOTask(DPOTask):
    """Desirable and undesirable completions against a reference (module docstring)."""

    sample_name: ClassVar[str] = "examples"
    unit_name: ClassVar[str] = "examples"

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        from .kto_records import encode_kto
        return PairEncoder(encode_kto, cfg, tokenizer, notes)

    @classmethod
    def sides(cls) -> tuple[str, str]:
        return ("completion", "mismatched")

    @property
    def collate(self) -> Callable[[list], Any]:
        from .kto_records import KTOCollate
        return KTOCollate(self.tokenizer.pad_token_id)

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the examples' weighted losses, examples, reward and KL sums)."""
        batch = to_device(batch, device)
        B = batch["label"].shape[0]
        if "kl" in batch:  # the step's estimate (`rollout`), with the reference's scores
            ref, kl = batch["ref_logps"], batch["kl"]
        else:
            ref, mismatched = self._scores(model, batch, amp, frozen)
            kl = _mean_over_ranks(mismatched - ref[B:]).clamp(min=0)  # 0-dim
        policy = sequence_logps(model, half_rows(batch, second=False), amp)  # (B,)
        ratio = policy - ref[:B]  # (B,)
        p = self.cfg.kto
        good = batch["label"]  # (B,) bool
        losses = torch.where(good, p.desirable_weight * (1 - torch.sigmoid(p.beta * (ratio - kl))),
                             p.undesirable_weight * (1 - torch.sigmoid(p.beta * (kl - ratio))))
        rewards = p.beta * ratio.detach()  # (B,)
        counts = {"chosen": rewards[good].sum().double(), "n_chosen": good.sum().double(),
                  "rejected": rewards[~good].sum().double(), "n_rejected": (~good).sum().double(),
                  "kl": kl.double() * B, "samples": float(B)}
        return losses.sum(), B, counts

    def rollout(self, model: nn.Module, micro: list, step: int, env: Any, amp: ContextManager,
                frozen: Frozen = NO_FROZEN) -> tuple[list, dict]:
        """Under gradient accumulation, the KL estimate of the whole step (every micro-batch
        of every rank) first; each micro-batch leaves with it and its reference scores."""
        if len(micro) == 1 or not self.cfg.data.drop_last:  # drop_last: no rank short of one
            return micro, {}
        batches = [to_device(mb, env.device) for mb in micro]
        scores = [self._scores(model, b, amp, frozen) for b in batches]  # ((2B,), (B,)) each
        kl = _mean_over_ranks(torch.cat([m - r[m.shape[0]:] for r, m in scores])).clamp(min=0)
        return [{**b, "ref_logps": r, "kl": kl} for b, (r, _) in zip(batches, scores)], {}

    @torch.no_grad()
    def _scores(self, model: nn.Module, batch: dict, amp: ContextManager, frozen: Frozen
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """((2B,) the reference's scores of the completions then the mismatched sequences,
        (B,) the policy's of the mismatched ones), without gradients."""
        ref = self.reference_logps(model, batch, amp, frozen)  # (2B,)
        return ref, sequence_logps(model, half_rows(batch, second=True), amp)

    def train_metrics(self, counts: dict) -> dict:
        return kto_metrics(counts)

    def eval_metrics(self, counts: dict) -> dict:
        return {**{f"val_{k}": v for k, v in kto_metrics(counts).items()},
                "val_samples": int(counts.get("samples", 0))}

    def describe(self, n_params: int) -> str:
        p = self.cfg.kto
        return (f"KTO (beta {p.beta}, weights {p.desirable_weight} / {p.undesirable_weight}) "
                f"on model hf ({self.cfg.model.path}): {human_count(n_params)} parameters; "
                f"reference: {self.reference.value}; tokenizer {self.tokenizer_dir} "
                f"({len(self.tokenizer)} tokens)")


def _mean_over_ranks(values: torch.Tensor) -> torch.Tensor:
    """The mean of (N,) values over every data-parallel rank's batch (no gradient)."""
    both = torch.stack([values.detach().float().sum(),
                        torch.tensor(float(values.numel()), device=values.device)])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(both)
    return both[0] / both[1].clamp(min=1)


def kto_metrics(counts: dict) -> dict:
    """Means from summed counts, under TRL's names: the rewards of desirable (chosen) and
    undesirable (rejected) examples, their margin, and the KL estimate."""
    n = counts.get("samples", 0.0)
    if not n:
        return {}
    out = {"kl": counts["kl"] / n}
    if counts["n_chosen"]:
        out["rewards/chosen"] = counts["chosen"] / counts["n_chosen"]
    if counts["n_rejected"]:
        out["rewards/rejected"] = counts["rejected"] / counts["n_rejected"]
    if counts["n_chosen"] and counts["n_rejected"]:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out
