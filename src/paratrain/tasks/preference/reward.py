"""Reward models (`data.format=preference`, `trainer.objective=reward`): a pretrained model with
a one-score head (AutoModelForSequenceClassification, num_labels=1, built from a causal-LM folder
as transformers does, or a classifier folder) learns to score each pair's chosen text above its
rejected one, with the Bradley-Terry loss of InstructGPT and TRL's RewardTrainer:

    -log sigmoid(r(chosen) - r(rejected) - margin)      (margin: data.margin_field, else 0)

A text is the prompt followed by the response, tokenized whole as `tokenizer(text)` does, so the
saved model/ scores a text with transformers alone exactly as training did. The loss unit is a
pair; the accuracy (the share of pairs scored the right way round) and the mean scores are sums
over pairs that the loop adds up over micro-steps and ranks like the loss.

Packed (data.pack=true, decoder-only models): whole pairs go into rows as for DPO
(packed_pairs.py), each sequence with position ids restarting at 0 so attention stays inside it;
the head scores every token (transformers' *ForSequenceClassification applies `score` to each
token, then pools one per row), and each sequence's score is read at its own last non-pad token
(`packed_scores`), the token a padded row is pooled at: the same scores, losses and gradients.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...formatting import human_count
from ...models.hf import hf_config
from ..base import NO_FROZEN, Frozen, MemoryProbe, to_device
from ..classify import load_classifier
from ..finetuning import Encoder, PretrainedTask, quiet_transformers
from .dpo import PairEncoder, PairTask, reward_counts

SCORE_LABEL = "score"  # the head's one output, named in config.json's id2label
SCORE_HEAD = "score"  # the module transformers' decoder-only classifiers score tokens with


@dataclass
class RewardTask(PairTask, PretrainedTask):
    """Preference pairs on a one-score sequence-classification model (module docstring)."""
    lora_task_type: ClassVar[str] = "SEQ_CLS"  # peft trains the new head in full

    @classmethod
    def check_model(cls, cfg: Any) -> None:
        """A model transformers cannot give a sequence-classification head is one line here,
        before any worker starts."""
        import transformers
        quiet_transformers()
        config = hf_config(cfg.model.path, cfg.model.trust_remote_code)
        heads = transformers.AutoModelForSequenceClassification._model_mapping
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError(f"model.path={cfg.model.path!r} ({config.model_type}) is an "
                              "encoder-decoder model; paratrain trains reward models on "
                              "decoder-only or encoder-only models (one score from the last "
                              "token), not on encoder-decoder ones: use such a model")
        own = "AutoModelForSequenceClassification" in (getattr(config, "auto_map", None) or {})
        if type(config) not in heads and not own:  # own: the folder's code has the head
            raise ConfigError(f"model.path={cfg.model.path!r} ({config.model_type}) has no "
                              "sequence-classification head in transformers (AutoModelFor"
                              "SequenceClassification), so it cannot be a reward model; use a "
                              "decoder-only or encoder-only model that has one")

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        from .pairs import encode_reward
        return PairEncoder(encode_reward, cfg, tokenizer, notes)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .pairs import PairCollate
        return PairCollate(self.tokenizer.pad_token_id, shift=False)

    @classmethod
    def token_lengths(cls, ds: Any) -> Any:
        """(N,) a pair's two whole sequences' tokens in a packed row (no shift)."""
        from .packed_pairs import pair_sizes
        return pair_sizes(ds, cls.sides(), shift=False)

    def build_model(self) -> nn.Module:
        """The classifier; packed, with the per-token head its scores are read from (or one
        line, before the first step)."""
        model = super().build_model()
        if self.cfg.data.pack:
            score_head(model)
        return model

    def memory_probe(self) -> Optional[MemoryProbe]:
        """The one-score model (with its adapters, under LoRA) on a pair's two rows of the longest
        sequence, or on one packed row; None for a quantized base."""
        if self.cfg.model.quantize:
            return None
        from ..probe import causal_probe
        head = {"num_labels": 1, "pad_token_id": self.tokenizer.pad_token_id}
        if self.cfg.data.pack:
            return causal_probe(self.cfg, self.row_capacity(), len(self.tokenizer), head=head)
        longest = int(max(self.train_ds.lengths(side).max() for side in self.sides()))
        return causal_probe(self.cfg, longest, len(self.tokenizer), rows=2, head=head)

    def load_pretrained(self) -> nn.Module:
        return load_classifier(self.cfg.model.path, [SCORE_LABEL], self.tokenizer.pad_token_id,
                               len(self.tokenizer), self.cfg.model.trust_remote_code)

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the pairs' losses, pairs, sums of the scores and of right orders)."""
        batch = to_device(batch, device)
        if "ends" in batch:  # packed rows
            scores = packed_scores(model, batch, amp)  # (2B,)
        else:
            with amp:
                out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            scores = out.logits.float().squeeze(-1)  # (2B,)
        B = scores.shape[0] // 2
        losses = -F.logsigmoid(scores[:B] - scores[B:] - batch["margin"])  # (B,)
        return losses.sum(), B, reward_counts(scores[:B].detach(), scores[B:].detach())

    def describe(self, n_params: int) -> str:
        return (f"reward model hf ({self.cfg.model.path}, one-score head): "
                f"{human_count(n_params)} parameters; tokenizer {self.tokenizer_dir} "
                f"({len(self.tokenizer)} tokens)")


def packed_scores(model: nn.Module, batch: dict, amp: ContextManager) -> torch.Tensor:
    """(2P,) each packed sequence's score: the forward of the whole model (so DDP, FSDP and peft
    wrap it as usual) with the head's per-token output (2R, T, 1) kept by a forward hook, read at
    each sequence's last token (`ends`, packed_pairs.py). The row-pooled logits go unused."""
    head = score_head(model)
    seen: list = []
    handle = head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with amp:
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    finally:
        handle.remove()
    per_token = seen[0].float()[..., 0]  # (2R, T)
    return per_token.flatten()[batch["ends"]]  # (2P,)


def score_head(model: nn.Module) -> nn.Module:
    """The one-score head applied to every token (`score` in transformers' decoder-only
    *ForSequenceClassification; the outermost module of that name: peft's wrapper, DDP's
    inner model's)."""
    found = [(name.count("."), name) for name, _ in model.named_modules()
             if name.rsplit(".", 1)[-1] == SCORE_HEAD]
    if found:
        return model.get_submodule(min(found)[1])
    raise ConfigError(f"data.pack=true: {type(model).__name__} has no per-token `{SCORE_HEAD}` "
                      "head (an encoder pools its first token), so packed rows cannot be scored "
                      "per example; use a decoder-only model or data.pack=false")


def generate_score(model_dir: Path, prompt: str, opts: Any) -> str:
    """`paratrain generate` on a reward model's run: the score of --prompt (the whole text:
    prompt and response), and on stderr what was done instead of continuing it."""
    from ...models.hf import load_for_prompt
    _, model, ids = load_for_prompt(model_dir, "AutoModelForSequenceClassification", prompt,
                                    opts.device)
    with torch.no_grad():
        score = float(model(**ids).logits.float()[0, 0])
    print(f"paratrain: {opts.run_dir} is a reward model: it scores --prompt (the prompt and "
          "its response as one text) instead of continuing it", file=sys.stderr)
    return f"{score:.6f}"
