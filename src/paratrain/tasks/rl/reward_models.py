"""Reward models as GRPO's scorers (rl.reward_models): folders of a one-label sequence
classification model, such as what `trainer.objective=reward` writes to its run's model/.

Each is built once per worker and handed to the run as a frozen model (`GRPOTask.build_frozen`):
placed, sharded and precision-cast like the policy, never trained or saved. A completion is
scored as the reward model was trained (tasks/preference/reward.py): the prompt followed by the completion,
one text tokenized whole by the reward model's own tokenizer; a chat prompt is rendered with
that tokenizer's chat template (the completion as the assistant turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import torch
from torch import nn

from ...errors import ConfigError


def reward_model_key(i: int) -> str:
    """The frozen model's name in the run (`frozen`)."""
    return f"reward_model_{i}"


def load_reward_model(folder: str, trust_remote_code: bool = False) -> nn.Module:
    """The folder's AutoModelForSequenceClassification (local safetensors only), one label.
    `trust_remote_code`: model.trust_remote_code."""
    import transformers

    from ...models.hf import quiet_transformers, remote_code
    quiet_transformers()
    path = Path(folder).expanduser()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, local_files_only=True, use_safetensors=True, **remote_code(trust_remote_code))
    if model.config.num_labels != 1:  # a classifier (config/rl.py refused other heads)
        raise ConfigError(f"rl.reward_models: {folder} is a classifier with "
                          f"{model.config.num_labels} labels; a reward model gives one score "
                          "(trainer.objective=reward trains one)")
    return model


class RewardModelScorer:
    """Scores completions with one reward model (its tokenizer loaded on first use)."""

    def __init__(self, folder: str):
        self.folder, self._tokenizer = folder, None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import transformers
            self._tokenizer = transformers.AutoTokenizer.from_pretrained(
                Path(self.folder).expanduser(), local_files_only=True)
            if self._tokenizer.pad_token is None:
                self._tokenizer.pad_token = self._tokenizer.eos_token
        return self._tokenizer

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        """prompt + completion per completion, as the reward model read its training texts."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion)
            elif getattr(self.tokenizer, "chat_template", None):
                out.append(self.tokenizer.apply_chat_template(
                    prompt + [{"role": "assistant", "content": completion}], tokenize=False))
            else:
                out.append("\n".join(m["content"] for m in prompt) + "\n" + completion)
        return out

    @torch.no_grad()
    def score(self, model: nn.Module, prompts: list, completions: list[str],
              device: torch.device, amp: ContextManager) -> list[float]:
        """One score per completion: the model's one logit on its text."""
        enc = self.tokenizer(self.texts(prompts, completions), return_tensors="pt",
                             padding=True)
        with amp:
            logits = model(input_ids=enc["input_ids"].to(device),
                           attention_mask=enc["attention_mask"].to(device)).logits  # (N, 1)
        return logits.float()[:, 0].tolist()
