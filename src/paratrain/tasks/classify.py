"""Text classification (`data.format=classify`): a pretrained Hugging Face model with a sequence
classification head (AutoModelForSequenceClassification) on labelled texts, with the model's own
tokenizer.

The loss unit is a sample: each micro-step's loss is the sum of per-text cross-entropies, so the
loop's unit weighting makes every text count the same across ranks and micro-steps, and 1 and N
workers give the same run. Validation also counts correct predictions (`eval_counts`), summed by
the loop over every validation text exactly once, so the accuracy is exact whatever the world
size. Labels that are strings get ids in sorted order; the run's model/ records the mapping as
`id2label` / `label2id` in its config.json, so `from_pretrained` gives named predictions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config.tree import TrainConfig
from ..errors import ConfigError
from ..formatting import human_count
from ..models.hf import hf_config, loads_weights, quiet_transformers, remote_code
from .base import NO_FROZEN, Frozen, MemoryProbe, to_device, training_smoothing
from .finetuning import Encoder, PretrainedTask


@dataclass
class ClassifyTask(PretrainedTask):
    """Labelled texts on a sequence-classification model (see module docstring)."""
    label_names: Sequence[str] = ()  # label name of each class id
    sample_name: ClassVar[str] = "texts"
    unit_name: ClassVar[str] = "texts"
    lora_task_type: ClassVar[str] = "SEQ_CLS"  # peft trains the new head in full
    auto_class: ClassVar[str] = "AutoModelForSequenceClassification"
    perplexity: ClassVar[bool] = False
    units_per_sample: ClassVar[Optional[int]] = 1  # one loss unit per text

    @classmethod
    def encoder(cls, cfg: TrainConfig, tokenizer: Any, notes: list) -> Encoder:
        return EncodeLabelled(cfg, tokenizer, notes)

    @classmethod
    def recorded_fields(cls, model_info: dict) -> dict:
        return {"label_names": list(model_info.get("labels") or ())}

    def load_pretrained(self) -> nn.Module:
        """The pretrained model with a classification head for these labels (a new head,
        initialized from the seeded RNG, unless the folder already has one of the same size)."""
        return load_classifier(self.cfg.model.path, self.label_names,
                               self.tokenizer.pad_token_id, len(self.tokenizer),
                               self.cfg.model.trust_remote_code)

    def head_config(self) -> dict:
        return {"num_labels": len(self.label_names)}

    def memory_probe(self) -> Optional[MemoryProbe]:
        """The classifier (with its adapters, under LoRA) on its longest text; None for a
        quantized base (the plan would count its weights at full precision)."""
        if self.cfg.model.quantize:
            return None
        from .probe import causal_probe
        return causal_probe(self.cfg, int(self.token_lengths(self.train_ds).max()),
                            len(self.tokenizer), head={
                                **self.head_config(), "pad_token_id": self.tokenizer.pad_token_id})

    def count_units(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        s, n, _ = self.eval_counts(model, batch, device, amp,
                                   label_smoothing=training_smoothing(model, self.cfg))
        return s, n

    def eval_counts(self, model: nn.Module, batch: dict, device: torch.device,
                    amp: ContextManager, frozen: Frozen = NO_FROZEN, label_smoothing: float = 0.0
                    ) -> tuple[torch.Tensor, int, dict]:
        """(sum of per-text losses, texts, {"correct": right predictions, "samples": texts}):
        the loop sums the counts over the whole validation set and all ranks."""
        batch = to_device(batch, device)
        labels = batch["labels"]  # (B,)
        with amp:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits.float()  # (B, C)
        s = F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)
        correct = float((logits.argmax(-1) == labels).sum())
        return s, int(labels.numel()), {"correct": correct, "samples": float(labels.numel())}

    def eval_metrics(self, counts: dict) -> dict:
        """The validation figures reported with the loss, from the summed counts."""
        n = counts.get("samples", 0.0)
        return {"val_accuracy": counts.get("correct", 0.0) / n if n else None,
                "val_samples": int(n)}

    def describe(self, n_params: int) -> str:
        return (f"model hf ({self.cfg.model.path}) classifying into {len(self.label_names)} "
                f"labels: {human_count(n_params)} parameters; tokenizer {self.tokenizer_dir} "
                f"({len(self.tokenizer)} tokens)")

    @property
    def model_info(self) -> dict:
        return {**super().model_info, "labels": list(self.label_names)}


class EncodeLabelled(Encoder):
    """Texts and their labels; label ids come from the training rows (sorted names), and the
    validation rows are encoded with the same ids."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, notes: list):
        self.data, self.tokenizer, self.notes = cfg.data, tokenizer, notes
        self.max_length = cfg.max_length  # data.max_length, or the model's limit
        self.names: Optional[list] = None

    def __call__(self, rows: list, source_name: str) -> list:
        from ..data.classify import encode_classify
        d = self.data
        examples, stats, names = encode_classify(
            rows, self.tokenizer, text_field=d.text_field, label_field=d.label_field,
            max_length=self.max_length, labels=self.names, source_name=source_name)
        self.notes.append(f"{source_name}: {stats.rows} texts ({stats.truncated} cut to "
                          f"data.max_length={self.max_length} tokens); longest {stats.longest} "
                          "tokens")
        if self.names is None:  # the training rows: they name the labels
            if len(names) < 2:
                raise ConfigError(f"classification needs at least two labels; the training "
                                  f"data has only {names!r} in data.label_field="
                                  f"{d.label_field!r}")
            self.notes.append(f"labels: {', '.join(f'{i}={n}' for i, n in enumerate(names))}")
            self.names = names
        return examples

    def task_fields(self) -> dict:
        return {"label_names": self.names}


def load_classifier(path: Optional[str], label_names: Sequence[str], pad_id: int,
                    vocab_size: int, trust_remote_code: bool = False) -> nn.Module:
    """AutoModelForSequenceClassification from a local folder (safetensors only, nothing
    downloaded) with `len(label_names)` classes named in its config; a folder with config.json
    alone gives fresh weights. `trust_remote_code`: model.trust_remote_code."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("data.format=classify needs the transformers package: "
                          "pip install 'paratrain[hf]'") from None
    p = Path(str(path)).expanduser()
    names = [str(n) for n in label_names]
    labels = {"num_labels": len(names), "id2label": dict(enumerate(names)),
              "label2id": {n: i for i, n in enumerate(names)}, "pad_token_id": pad_id}
    remote = remote_code(trust_remote_code)
    config = hf_config(p, trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model.path={path!r} is an encoder-decoder model "
                          f"({config.model_type}); classification supports encoder-only and "
                          "decoder-only models for now")
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise ConfigError(f"model.path={path!r} has vocab_size={config.vocab_size}, smaller than "
                          f"its tokenizer's {vocab_size} tokens; use the model's own tokenizer")
    auto = transformers.AutoModelForSequenceClassification
    try:
        if loads_weights(p):
            return auto.from_pretrained(p, local_files_only=True, use_safetensors=True,
                                        ignore_mismatched_sizes=True, **labels, **remote)
        for key, value in labels.items():
            setattr(config, key, value)
        return auto.from_config(config, **remote)
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ConfigError(f"model.path={path!r} ({config.model_type}) has no sequence-"
                          "classification head in transformers; pick another model") from None


def generate_label(model_dir: Path, prompt: str, opts: Any) -> str:
    """`paratrain generate` on a classifier's run: the label of the prompt, and on stderr what
    was done instead of continuing it. `opts`: models.generate.GenerateOptions."""
    label, p = classify_text(model_dir, prompt, opts.device)
    print(f"paratrain: {opts.run_dir} is a text classifier: it labels --prompt (probability "
          f"{p:.3f}) instead of continuing it", file=sys.stderr)
    return label


def classify_text(model_dir: Path, text: str, device: str) -> tuple[str, float]:
    """(predicted label, its probability) for `text` with a trained classifier folder."""
    import transformers
    quiet_transformers()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True).to(device).eval()
    ids = tokenizer(text, return_tensors="pt").to(device)
    if ids["input_ids"].numel() == 0:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    with torch.no_grad():
        probs = model(**ids).logits.float().softmax(-1)[0]  # (C,)
    k = int(probs.argmax())
    return str(model.config.id2label.get(k, k)), float(probs[k])
