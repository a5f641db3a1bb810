"""How the memory plan measures a pretrained Hugging Face causal LM without building it whole.

The plan counts the state (parameters, gradients, optimizer moments) from the model built on the
meta device, which costs no memory at any size. Activations need a real forward on the CPU; an
8B model built there in fp32 would take 32 GB and minutes before a run's first step (`auto`
decides at every start). Its blocks are alike, so the forward runs on the model cut to one block
and to two, and the plan extrapolates to all of them (`MemoryProbe.shallow`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..models.hf import hf_config, remote_code
from .base import MemoryProbe


class CausalProbe:
    """The model from its config (random weights: only shapes and activations count), with its
    adapters under LoRA, its forward run on `rows` rows a sample (a DPO pair's 2, an RL group's
    completions); `blocks`: only the first that many of its blocks. `head`: a classifier's
    (AutoModelForSequenceClassification, its config's num_labels and pad_token_id)."""

    def __init__(self, cfg: Any, rows: int = 1, head: Optional[dict] = None):
        self.cfg, self.rows, self.head = cfg, rows, head

    def __call__(self, blocks: Optional[int] = None) -> nn.Module:
        import transformers

        from .lora import apply_lora
        trust = self.cfg.model.trust_remote_code
        config = hf_config(self.cfg.model.path, trust, **(self.head or {}))
        if blocks is not None:
            cut(config, blocks)
        auto = transformers.AutoModelForSequenceClassification if self.head else \
            transformers.AutoModelForCausalLM
        model = auto.from_config(config, **remote_code(trust))
        if self.cfg.model.lora.r > 0:
            model = apply_lora(model, self.cfg.model.lora,
                               task_type="SEQ_CLS" if self.head else "CAUSAL_LM")
        return _Rows(model, self.rows)

    @property
    def blocks(self) -> int:
        return hf_config(self.cfg.model.path,
                         self.cfg.model.trust_remote_code).get_text_config().num_hidden_layers


def cut(config: Any, blocks: int) -> None:
    """The config of the same model with only its first `blocks` blocks (and their per-block
    settings, where the config lists them)."""
    text = config.get_text_config()
    text.num_hidden_layers = blocks
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:blocks]


def causal_probe(cfg: Any, seq_length: int, vocab_size: int, rows: int = 1,
                 head: Optional[dict] = None, **frozen: Any) -> MemoryProbe:
    """The plan's probe of the model a task trains (model.path), on samples of `rows` rows of
    `seq_length` tokens; `head`: CausalProbe's; `frozen`: MemoryProbe's build_frozen and cache."""
    probe = CausalProbe(cfg, rows, head)
    return MemoryProbe(probe, seq_length, vocab_size, shallow=(probe, probe.blocks), **frozen)


class _Rows(nn.Module):
    """(1, T) ids -> the (1, T, V) logits of the first row (a classifier's (1, C)), after a
    forward of `rows` rows: what the plan's forward and loss take."""

    def __init__(self, model: nn.Module, rows: int):
        super().__init__()
        self.model, self.rows = model, rows
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # its blocks (AC)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx.repeat(self.rows, 1)).logits[:1]  # (1, T, V) of (rows, T, V)
