"""What `paratrain plan` (and strategy auto) measures of an online RL run (grpo.py, ppo.py): the
policy (with its LoRA adapters) training on a prompt's rl.num_generations rows of the longest
prompt + rl.max_new_tokens tokens, and the frozen models it holds: the reference (when the KL
coefficient is not 0 and there is no LoRA) and each reward model, built from their configs (no
weights read). Generation's KV cache (2 x layers x KV heads x head size per token and row, in
no_grad) is smaller than the training activations of the same rows and is freed before they are
made, so the peak the plan reports covers it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


class GroupProbe:
    """The memory plan's factory: the policy from its config, its forward run on a sample's
    group of rows."""

    def __init__(self, cfg: Any, rows: int):
        self.cfg, self.rows = cfg, rows

    def __call__(self) -> nn.Module:
        import transformers

        from .lora import apply_lora
        config = transformers.AutoConfig.from_pretrained(self.cfg.model.path,
                                                         local_files_only=True)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if self.cfg.model.lora.r > 0:
            model = apply_lora(model, self.cfg.model.lora)
        return _GroupRows(model, self.rows)


class FrozenProbe:
    """The frozen models' factory: the reference and the reward models, from their configs."""

    def __init__(self, cfg: Any, reference: bool):
        self.cfg, self.reference = cfg, reference

    def __call__(self) -> dict[str, nn.Module]:
        import transformers

        from .reward_models import reward_model_key
        auto = transformers.AutoConfig.from_pretrained
        out = {reward_model_key(i): transformers.AutoModelForSequenceClassification.from_config(
            auto(Path(folder).expanduser(), local_files_only=True))
            for i, folder in enumerate(self.cfg.rl.reward_models)}
        if self.reference:
            out["reference"] = transformers.AutoModelForCausalLM.from_config(
                auto(self.cfg.model.path, local_files_only=True))
        return out


class _GroupRows(nn.Module):
    """(1, T) ids -> the logits of the first row, after a forward of `rows` rows."""

    def __init__(self, model: nn.Module, rows: int):
        super().__init__()
        self.model, self.rows = model, rows
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # its blocks

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx.repeat(self.rows, 1)).logits[:1]  # (1, T, V) of (rows, T, V)
