"""What an unset or `auto` key means, decided here and nowhere else: the tokenizer a run reads
its data with (`resolve_tokenizer`), the longest fine-tuning sequence (`resolve_max_length`),
the run's name (`default_run_name`) and the modules LoRA adapts (`lora_targets`). The checks
(checks.py, finetune_checks.py) check these values; the data, the tasks and the config tree
read them from here.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError
from . import registry
from .hub import display_name
from .model_folder import FALLBACK_MAX_LENGTH, model_positions

PRETRAINING_RUN_NAME = "stdlib-llama"  # run.name of a run that fine-tunes nothing


def resolve_tokenizer(data: Any, model: Any = None) -> str:
    """What data.tokenizer means, decided here and nowhere else: `bpe`, `char`, or a pretrained
    tokenizer's folder. `auto` (the default) is the model's own tokenizer, model.path's, for
    model.arch=hf (a pretrained model's embeddings are indexed by its own ids: nothing is
    retrained), and a BPE trained on the corpus for a model from scratch (or no model given).
    `data`, `model`: the config's DataConfig and ModelConfig."""
    if data.tokenizer != "auto":
        return data.tokenizer
    if model is not None and model.arch == "hf" and model.path:
        return model.path
    return "bpe"


def resolve_max_length(data: Any, model: Any) -> int:
    """data.max_length, decided here: the value given, else the model's own limit (its
    config.json's max_position_embeddings), else FALLBACK_MAX_LENGTH."""
    if data.max_length is not None:
        return int(data.max_length)
    limit = model_positions(model.path) if model.arch == "hf" else None
    return limit or FALLBACK_MAX_LENGTH


def default_run_name(cfg: Any) -> str:
    """run.name when unset: a fine-tuning run is named after its model folder and data.format
    (`my-model-pairs`, `-lora` with adapters), and the objective when it is not the format's
    first (`my-model-preference-reward`, `t5-pairs-seq2seq`), so that two fine-tunes of
    different models, or of one model on different tasks, do not land in one run dir; anything
    else is stdlib-llama."""
    spec = registry.get(cfg.data.format) if cfg.data.format in registry.names() else None
    if spec is None or not spec.pretrained or not cfg.model.path:
        return PRETRAINING_RUN_NAME
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", display_name(cfg.model.path)).strip("-.")
    try:
        chosen = cfg.task_spec
    except ConfigError:  # validate says why, in its own words
        chosen = spec
    return (f"{stem or 'model'}-{cfg.data.format}"
            + (f"-{chosen.objective}" if chosen is not spec else "")
            + ("-lora" if cfg.model.lora.r else ""))


def lora_targets(lora: Any) -> Any:
    """model.lora.target_modules as peft takes it: a list of names (a bare name is a list of
    one), or peft's own "all-linear"."""
    t = lora.target_modules
    if isinstance(t, str):
        return t if t == "all-linear" else [t]
    return list(t) if isinstance(t, (list, tuple)) else t
