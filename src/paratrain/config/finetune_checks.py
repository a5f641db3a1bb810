"""What a run that trains a pretrained model is checked for before any process starts: the data
format against the model (fine-tuning formats need model.arch=hf and its tokenizer), the task's
own checks from the registry, LoRA's options, data.max_length against the model's positions, and
the tokenizer a pretrained model reads a corpus with. One ConfigError line each, as in
checks.py, whose `validate` calls these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError, check_choice
from ..formatting import one_of
from . import registry
from .defaults import lora_targets, resolve_max_length
from .model_folder import (
    TOKENIZER_MARKERS,
    has_tokenizer,
    has_weights,
    model_config,
    model_positions,
)

TOKENIZERS = ("auto", "bpe", "char")
LORA_BIASES = ("none", "all", "lora_only")


def check_data_format(cfg: Any, spec: registry.TaskSpec) -> None:
    """Fine-tuning formats need a pretrained model and its tokenizer; corpora a tokenizer kind;
    then the task's own checks."""
    d = cfg.data
    if d.pack and not spec.packs:
        raise ConfigError(
            f"data.pack=true cannot pack data.format={d.format} (trainer.objective="
            f"{spec.objective}) exactly: {spec.no_pack}; leave data.pack=false"
            + " and set data.group_by_length=true to cut the padding instead"
            if spec.pretrained else
            f"data.pack applies to fine-tuning formats ({one_of(registry.names(pretrained=True))}"
            f"); data.format={d.format} " + (
                "already packs documents into windows" if spec.packed else
                "keeps one document per row"))
    if d.document_mask and not (spec.packed and not spec.pretrained):
        raise ConfigError(f"data.document_mask applies to data.format=packed (windows that span "
                          f"documents); data.format={d.format} " + (
                              "keeps one document per row already" if not spec.pretrained else
                              "keeps examples apart with data.pack=true"))
    if d.document_mask and cfg.trainer.pipeline_parallel > 1:
        raise ConfigError("data.document_mask=true cannot run under trainer.pipeline_parallel > 1 "
                          "(the stages pass activations alone, not the positions); use one "
                          "or leave data.document_mask=false")
    if d.group_by_length and not spec.pretrained:
        raise ConfigError(f"data.group_by_length applies to fine-tuning formats; data.format="
                          f"{d.format} " + ("cuts full windows, all of one length" if spec.packed
                                            else "pads one document per row of data.seq_length"))
    if spec.pretrained:
        if cfg.model.arch != "hf":
            raise ConfigError(f"data.format={d.format} fine-tunes a pretrained Hugging Face "
                              f"model: set model.arch=hf model.path=DIR (got model.arch="
                              f"{cfg.model.arch}); export one of ours with `paratrain "
                              "checkpoint export RUN_DIR OUT --format hf`")
        for check in spec.checks:
            check(cfg)
        _check_lora(cfg.model.lora)
        _check_quantize(cfg, spec)
        _check_max_length(cfg)
        if d.tokenizer != "auto" and not Path(d.tokenizer).expanduser().is_dir():
            raise ConfigError(f"data.tokenizer={d.tokenizer!r}" + (
                " trains a new tokenizer" if d.tokenizer in TOKENIZERS else
                " is not a directory") + f"; data.format={d.format} encodes with the pretrained "
                "model's own tokenizer: leave data.tokenizer unset (auto: model.path's) or pass "
                "a tokenizer folder saved with save_pretrained")
        return
    if cfg.model.lora.r:
        raise ConfigError("model.lora applies to a pretrained Hugging Face model being "
                          "fine-tuned: use model.arch=hf with data.format="
                          + one_of(registry.names(pretrained=True)))
    if d.tokenizer not in TOKENIZERS and not Path(d.tokenizer).expanduser().is_dir():
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not one of: "
                          f"{', '.join(TOKENIZERS)}, or a directory (a pretrained tokenizer "
                          "saved with save_pretrained)")


QUANTIZE = ("nf4", "int8")


def _check_quantize(cfg: Any, spec: registry.TaskSpec) -> None:
    """model.quantize: a known kind, LoRA on a causal LM fine-tune, bitsandbytes installed, and
    a layout that keeps every weight whole on its rank (one device or DDP)."""
    q = cfg.model.quantize
    if q is None:
        return
    if q not in QUANTIZE:
        raise ConfigError(f"model.quantize={q!r} is not one of: {', '.join(QUANTIZE)} (or null)")
    if not cfg.model.lora.r:
        raise ConfigError(f"model.quantize={q} freezes the base in {q}: train LoRA adapters on "
                          "it with model.lora.r=N (QLoRA), or leave model.quantize unset")
    if spec.objective != "sft" or spec.encoder_decoder:
        raise ConfigError(f"model.quantize={q} applies to fine-tuning a causal LM on pairs or "
                          f"chat records; data.format={cfg.data.format} (trainer.objective="
                          f"{spec.objective}) trains without it")
    if cfg.trainer.strategy in ("fsdp", "hsdp") or cfg.trainer.precision == "bf16-true":
        raise ConfigError(f"model.quantize={q} runs on one device or DDP in fp32 / bf16-mixed: "
                          "FSDP2 cannot shard bitsandbytes' packed weights and bf16-true would "
                          f"cast them (got trainer.strategy={cfg.trainer.strategy}, "
                          f"trainer.precision={cfg.trainer.precision})")
    import importlib.util
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"model.quantize={q} stores the base through bitsandbytes: pip "
                          "install bitsandbytes (its CPU backend runs here too)")


def _check_lora(lora: Any) -> None:
    targets = lora_targets(lora)
    if lora.r < 0:
        raise ConfigError(f"model.lora.r={lora.r} must be >= 0 (0: off, full fine-tuning)")
    if not targets or not (targets == "all-linear" or all(
            isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"model.lora.target_modules={lora.target_modules!r} must be module "
                          "names, e.g. [q_proj,v_proj] (a single name works too), or all-linear")
    check_choice("model.lora.bias", lora.bias, LORA_BIASES)
    if lora.layers_to_transform is not None and not lora.layers_to_transform:
        raise ConfigError("model.lora.layers_to_transform=[] gives adapters to no layer; list "
                          "layer indices, or leave it null for every layer")


def _check_max_length(cfg: Any) -> None:
    """data.max_length fits the model's positions (one line naming both numbers)."""
    d = cfg.data
    limit = model_positions(cfg.model.path)
    length = resolve_max_length(d, cfg.model)
    if length < 2:
        raise ConfigError(f"data.max_length={length} must be at least 2")
    if limit is not None and length > limit:
        raise ConfigError(f"data.max_length={length} is longer than model.path's "
                          f"max_position_embeddings={limit} (its config.json); the model has no "
                          f"positions beyond that: pass data.max_length={limit} or less, or "
                          "leave it unset (the model's limit)")


def check_hf_corpus_tokenizer(cfg: Any) -> None:
    """A pretrained model on a corpus reads the ids of its own tokenizer (auto), or of a folder
    given; a tokenizer trained here (bpe) must at least fit in its embeddings."""
    d, path = cfg.data, cfg.model.path
    if d.tokenizer == "auto" and not has_tokenizer(path):
        raise ConfigError(
            f"model.path={path} has no tokenizer ({' / '.join(TOKENIZER_MARKERS[:2])}) and "
            "data.tokenizer=auto uses the model's own; pass data.tokenizer=DIR, the folder of "
            "the tokenizer it was trained with" + (
                "" if has_weights(path) else " (or data.tokenizer=bpe to train one on the "
                "corpus: the folder holds no weights, so nothing pretrained is lost)"))
    if d.tokenizer == "bpe":
        model_vocab = model_config(path).get("vocab_size")  # broken: models.hf says why
        if isinstance(model_vocab, int) and d.vocab_size > model_vocab:
            raise ConfigError(
                f"data.tokenizer=bpe trains a vocabulary of data.vocab_size={d.vocab_size}, more "
                f"than model.path's embeddings hold (vocab_size={model_vocab} in its "
                "config.json); lower data.vocab_size, or leave data.tokenizer unset to use the "
                "model's own tokenizer")
