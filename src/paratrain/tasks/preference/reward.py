"""Reward models (`data.format=preference`, `trainer.objective=reward`): a pretrained model with
a one-score head (AutoModelForSequenceClassification, num_labels=1, built from a causal-LM folder
as transformers does, or a classifier folder) learns to score each pair's chosen text above its
rejected one, with the Bradley-Terry loss of InstructGPT and TRL's RewardTrainer:

    -log sigmoid(r(chosen) - r(rejected) - margin)      (margin: data.margin_field, else 0)

A text is the prompt followed by the response, tokenized whole as `tokenizer(text)` does, so the
saved model/ scores a text with transformers alone exactly as training did. The loss unit is a
pair; the accuracy (the share of pairs scored the right way round) and the mean scores are sums
over pairs that the loop adds up over micro-steps and ranks like the loss.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ...formatting import human_count
from ..base import NO_FROZEN, Frozen, to_device
from ..classify import load_classifier
from ..finetuning import Encoder, PretrainedTask, quiet_transformers
from .dpo import PairEncoder, PairTask, reward_counts

SCORE_LABEL = "score"  # the head's one output, named in config.json's id2label


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
        config = transformers.AutoConfig.from_pretrained(Path(cfg.model.path).expanduser(),
                                                         local_files_only=True)
        heads = transformers.AutoModelForSequenceClassification._model_mapping
        if getattr(config, "is_encoder_decoder", False):
            raise ConfigError(f"model.path={cfg.model.path!r} ({config.model_type}) is an "
                              "encoder-decoder model; paratrain trains reward models on "
                              "decoder-only or encoder-only models (one score from the last "
                              "token), not on encoder-decoder ones: use such a model")
        if type(config) not in heads:
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

    def load_pretrained(self) -> nn.Module:
        return load_classifier(self.cfg.model.path, [SCORE_LABEL], self.tokenizer.pad_token_id,
                               len(self.tokenizer))

    def train_counts(self, model: nn.Module, batch: dict, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(sum of the pairs' losses, pairs, sums of the scores and of right orders)."""
        batch = to_device(batch, device)
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
