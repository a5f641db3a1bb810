"""Direct preference optimization (`data.format=preference`, `trainer.objective=dpo`): a
pretrained causal LM learns to prefer the chosen response of each pair over the rejected one,
measured against a frozen reference model (Rafailov et al., 2023).

Per pair, with log-probabilities summed over the response tokens only (prompt and pads masked):

    z = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    sigmoid: -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)   (eps: label_smoothing)
    ipo:     (z' - 1 / (2 beta))^2   z' from log-probs averaged per response token (TRL's form,
             the one behind the IPO paper's results, its authors confirmed)
    ipo_sum: (z - 1 / (2 beta))^2    on the summed log-probs (the paper's formula as written)
    hinge:   max(0, 1 - beta z)

The rewards are beta (log pi - log ref) of each response. Chosen and rejected rows go through
the model in one forward (tasks/preference/pairs.py puts them in one batch). The loss unit is a pair,
so the loop's weighting makes 1 and N workers (and any accumulation) the same run, and the
reward figures (`train_counts` / `eval_counts`) are sums over pairs that the loop adds up over
micro-steps and ranks exactly like the loss.

The reference, decided once from the config (`Reference`): a frozen copy of model.path built
and sharded like the policy (never in the optimizer, the gradients or the snapshots; counted in
the memory table); with LoRA, the policy itself with its adapters switched off (peft's
disable_adapter: no second copy, torchtune's way); `dpo.reference=DIR`, another frozen model;
or `dpo.precompute_reference=true`: its log-probs computed once before training and cached with
the data (reference_cache.py), so no reference is held while training.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...data.dataset import IGNORE_INDEX
from ...formatting import human_count
from ...models.hf import hf_config, remote_code
from ..base import NO_FROZEN, Frozen, MemoryProbe, per_sequence, sequence_logps, to_device
from ..sft import CausalLMTask
from ..finetuning import Encoder


class Reference(enum.Enum):
    """Where DPO's reference log-probabilities come from."""
    COPY = "a frozen copy of model.path, placed and sharded like the policy"
    ADAPTERS_OFF = "the policy with its LoRA adapters off (no second copy)"
    FOLDER = "a frozen model from dpo.reference, placed and sharded like the policy"
    PRECOMPUTED = "log-probabilities computed once before training (no model held)"

    @classmethod
    def of(cls, cfg: Any) -> "Reference":
        p = cfg.dpo
        if p.precompute_reference:
            return cls.PRECOMPUTED
        if p.reference is not None:
            return cls.FOLDER
        return cls.ADAPTERS_OFF if cfg.model.lora.r > 0 else cls.COPY


def _sigmoid(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)


def _ipo(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return (z - 1 / (2 * beta)) ** 2  # z: of per-token means for "ipo", of sums for "ipo_sum"


def _hinge(z: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    return torch.relu(1 - beta * z)


DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid, "ipo": _ipo, "ipo_sum": _ipo, "hinge": _hinge}  # config/preference.DPO_LOSSES
PER_TOKEN_LOSSES = frozenset({"ipo"})  # z from log-ratios divided by each response's tokens


class PairTask:
    """What DPO and reward models share: a pair is the loss unit (its chosen and rejected rows
    in one batch), and the reward figures come from `train_counts` (which the subclass gives)
    for training and validation alike."""
    sample_name: ClassVar[str] = "pairs"
    unit_name: ClassVar[str] = "pairs"
    perplexity: ClassVar[bool] = False
    units_per_sample: ClassVar[Optional[int]] = 1  # one loss unit per pair

    @classmethod
    def dataset(cls, examples: list) -> Any:
        from .pairs import preference_dataset
        return preference_dataset(examples)

    def count_units(self, batch: dict) -> int:
        if "num_sequences" in batch:  # packed rows (packed_pairs.py)
            return int(batch["num_sequences"]) // 2
        return int(batch["input_ids"].shape[0]) // 2

    @classmethod
    def token_lengths(cls, ds: Any) -> Any:
        """(N,) a pair's two sequences' tokens in a packed row (data.pack)."""
        from .packed_pairs import pair_sizes
        return pair_sizes(ds, cls.sides(), shift=True)

    @classmethod
    def sides(cls) -> tuple[str, str]:
        return ("chosen", "rejected")

    row_capacity_key: ClassVar[str] = "2 x data.max_length"

    def row_capacity(self) -> int:
        """A packed row holds whole pairs: up to two sequences of data.max_length each."""
        return 2 * int(self.cfg.max_length)

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        s, n, _ = self.train_counts(model, batch, device, amp, frozen)
        return s, n

    def eval_counts(self, model: nn.Module, batch: dict, device: torch.device,
                    amp: ContextManager, frozen: Frozen = NO_FROZEN
                    ) -> tuple[torch.Tensor, int, dict]:
        return self.train_counts(model, batch, device, amp, frozen)

    def train_metrics(self, counts: dict) -> dict:
        return reward_metrics(counts)

    def eval_metrics(self, counts: dict) -> dict:
        return {**{f"val_{k}": v for k, v in reward_metrics(counts).items()},
                "val_samples": int(counts.get("samples", 0))}


@dataclass
class DPOTask(PairTask, CausalLMTask):
    """Preference pairs on a causal LM against a reference (module docstring)."""

    def __post_init__(self) -> None:
        self.reference = Reference.of(self.cfg)
        self.pair_loss = DPO_LOSSES[self.cfg.dpo.loss]
        self.per_token = self.cfg.dpo.loss in PER_TOKEN_LOSSES

    def attach(self, env: Any, log: Callable[[str], None]) -> None:
        """The precomputed reference's log-probs joined to the pairs (before packing)."""
        if self.reference is Reference.PRECOMPUTED:
            from .reference_cache import attach_reference
            attach_reference(self, env, log)

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        from .pairs import encode_dpo
        return PairEncoder(encode_dpo, cfg, tokenizer, notes)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .pairs import PairCollate
        return PairCollate(self.tokenizer.pad_token_id, shift=True)

    def build_frozen(self) -> dict[str, nn.Module]:
        """The reference model, when one is held (not with LoRA's adapters off, nor with
        precomputed log-probs)."""
        if self.reference not in (Reference.COPY, Reference.FOLDER):
            return {}
        return {"reference": self.build_reference(self.cfg.dpo.reference or self.cfg.model.path)}

    def build_reference(self, path: str) -> nn.Module:
        """The causal LM at `path`, seeded like the policy (a folder without weights gives the
        policy's own random start)."""
        from ...models.hf import HFArgs, build_hf
        torch.manual_seed(self.cfg.trainer.seed)
        model = build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer), path=str(path),
                                   quantized=False))
        model.config.pad_token_id = self.tokenizer.pad_token_id
        if self.cfg.data.pack:  # it scores the same packed rows as the policy
            from ...models.hf import check_packed_attention, use_packed_attention
            use_packed_attention(model)
            check_packed_attention(model)
        return model

    def memory_probe(self) -> Optional[MemoryProbe]:
        """The policy (with its adapters, under LoRA) and the reference it holds, from their
        configs; a sample is two rows (a pair's; KTO's completion and mismatched sequence) of
        the longest sequence."""
        longest = int(max(self.train_ds.lengths(side).max() for side in self.collate.sides))
        reference = self.cfg.dpo.reference or self.cfg.model.path
        held = self.reference in (Reference.COPY, Reference.FOLDER)
        from ..probe import causal_probe
        return causal_probe(self.cfg, longest, len(self.tokenizer), rows=2,
                            build_frozen=_FrozenProbe(self.cfg, reference) if held else None)

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the pairs' losses, pairs, sums of the rewards and of right preferences)."""
        batch = to_device(batch, device)
        with torch.no_grad():
            ref = self.reference_logps(model, batch, amp, frozen)  # (2B,)
        policy = sequence_logps(model, batch, amp)  # (2B,)
        B = policy.shape[0] // 2
        ratio = policy - ref  # (2B,) log pi - log ref of every response
        scores = ratio / response_tokens(batch).clamp(min=1) if self.per_token else ratio
        z = scores[:B] - scores[B:]  # (B,)
        losses = self.pair_loss(z, self.cfg.dpo.beta, self.cfg.dpo.label_smoothing)  # (B,)
        rewards = self.cfg.dpo.beta * ratio.detach()  # (2B,)
        return losses.sum(), B, reward_counts(rewards[:B], rewards[B:])

    def reference_logps(self, model: nn.Module, batch: dict, amp: ContextManager,
                        frozen: Frozen) -> torch.Tensor:
        """(2B,) the reference's summed response log-probs for the batch's rows."""
        if self.reference is Reference.PRECOMPUTED:
            return batch["reference"].float()
        if self.reference is Reference.ADAPTERS_OFF:
            from ..lora import adapters_of
            peft_model = adapters_of(model)
            with peft_model.disable_adapter():
                return sequence_logps(peft_model, batch, amp)
        return sequence_logps(frozen["reference"], batch, amp)

    def describe(self, n_params: int) -> str:
        p = self.cfg.dpo
        return (f"DPO ({p.loss} loss, beta {p.beta}) on model hf ({self.cfg.model.path}): "
                f"{human_count(n_params)} parameters; reference: {self.reference.value}; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")


class _FrozenProbe:
    """The reference's factory, from its config (the plan builds it on the meta device)."""

    def __init__(self, cfg: Any, path: str):
        self.cfg, self.path = cfg, path

    def __call__(self) -> dict[str, nn.Module]:
        import transformers
        trust = self.cfg.model.trust_remote_code
        return {"reference": transformers.AutoModelForCausalLM.from_config(
            hf_config(self.path, trust), **remote_code(trust))}


def response_tokens(batch: dict) -> torch.Tensor:
    """(N,) each sequence's counted (response) tokens, as a float for dividing log-probs."""
    return per_sequence((batch["targets"] != IGNORE_INDEX).float(), batch)


def reward_counts(chosen: torch.Tensor, rejected: torch.Tensor) -> dict:
    """Sums over pairs of the chosen and rejected rewards (B,) and of right preferences (0-dim
    tensors, left on the device: the loop reads them once per step)."""
    return {"chosen": chosen.sum().double(), "rejected": rejected.sum().double(),
            "correct": (chosen > rejected).sum().double(), "samples": float(chosen.numel())}


def reward_metrics(counts: dict) -> dict:
    """Means per pair from summed counts: what metrics.jsonl, summary.json and TensorBoard
    show (the accuracy: the share of pairs whose chosen response has the higher reward)."""
    n = counts.get("samples", 0.0)
    if not n:
        return {}
    chosen, rejected = counts["chosen"] / n, counts["rejected"] / n
    accuracy = counts["correct"] / n
    return {"rewards/chosen": chosen, "rewards/rejected": rejected,
            "rewards/margin": chosen - rejected, "accuracy": accuracy,
            "rewards/margins": chosen - rejected, "rewards/accuracies": accuracy}  # TRL's names


class PairEncoder(Encoder):
    """A tasks/preference/pairs.py encoder with the config's fields and length."""

    def __init__(self, encode: Any, cfg: Any, tokenizer: Any, notes: list):
        from .pairs import PreferenceFields
        self.encode, self.tokenizer, self.notes = encode, tokenizer, notes
        self.fields, self.max_length = PreferenceFields.of(cfg), cfg.max_length

    def __call__(self, rows: list, source_name: str) -> list:
        pairs, stats = self.encode(rows, self.tokenizer, self.fields,
                                   max_length=self.max_length, source_name=source_name)
        self.notes.append(stats.summary())
        return pairs
