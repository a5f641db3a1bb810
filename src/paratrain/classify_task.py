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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .data.tokenizer import TOKENIZER_FILE, copy_tokenizer_files
from .errors import ConfigError
from .fileio import atomic_dir
from .finetune_task import (FinetuneRecords, pretrained_tokenizer_dir,
                            quiet_transformers, read_records)
from .formatting import human_count
from .task import MemoryProbe, to_device


@dataclass
class ClassifyTask:
    """Labelled texts on a sequence-classification model (see module docstring)."""
    cfg: TrainConfig
    tokenizer: Any
    train_ds: Any
    val_ds: Any
    tokenizer_dir: Path
    label_names: list  # label name of each class id
    fsdp_wrap: Sequence[type] = ()
    sample_name: str = "texts"
    perplexity: bool = False
    units_per_sample: Optional[int] = 1  # one loss unit per text
    data_fingerprint: Optional[str] = None
    notes: list = field(default_factory=list)  # for the log: pad token, truncation, labels

    @classmethod
    def prepare(cls, cfg: TrainConfig, records: Optional[FinetuneRecords] = None
                ) -> "ClassifyTask":
        from .data.classify import encode_classify
        from .data.finetune import FinetuneDataset, split_validation
        from .data.hf_tokenizer import load_tokenizer
        quiet_transformers()
        d = cfg.data
        tokenizer_dir = pretrained_tokenizer_dir(cfg)
        tokenizer, note = load_tokenizer(tokenizer_dir)
        notes = [note] if note else []
        train_rows, val_rows = read_records(cfg, records)

        def encode(rows: list, name: str, labels: Optional[list]) -> tuple[list, list]:
            examples, stats, names = encode_classify(
                rows, tokenizer, text_field=d.text_field, label_field=d.label_field,
                max_length=d.max_length, labels=labels, source_name=name)
            notes.append(f"{name}: {stats.rows} texts ({stats.truncated} cut to data.max_length="
                         f"{d.max_length} tokens); longest {stats.longest} tokens")
            return examples, names

        train, names = encode(train_rows, "train_input" if records else str(d.source), None)
        if len(names) < 2:
            raise ConfigError(f"classification needs at least two labels; the training data has "
                              f"only {names!r} in data.label_field={d.label_field!r}")
        notes.append(f"labels: {', '.join(f'{i}={n}' for i, n in enumerate(names))}")
        if val_rows is not None:
            val, _ = encode(val_rows, "validation_input" if records else str(d.val_source),
                            names)
        elif d.val_fraction > 0:
            train, val = split_validation(train, d.val_fraction, seed=cfg.trainer.seed)
        else:
            val = []
        return cls(cfg, tokenizer, FinetuneDataset(train), FinetuneDataset(val) if val else None,
                   tokenizer_dir, names, notes=notes)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .data.finetune import PadCollate
        return PadCollate(self.tokenizer.pad_token_id)

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora.r > 0

    def build_model(self) -> nn.Module:
        """The pretrained model with a classification head for these labels (a new head,
        initialized from the seeded RNG, unless the folder already has one of the same size);
        with LoRA adapters and its base frozen, when asked."""
        from .lora import apply_lora
        model = load_classifier(self.cfg.model.path, self.label_names,
                                self.tokenizer.pad_token_id, len(self.tokenizer))
        return apply_lora(model, self.cfg.model.lora, task_type="SEQ_CLS") if self.lora \
            else model

    def count_units(self, batch: dict) -> int:
        return int(batch["labels"].numel())

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager) -> tuple[torch.Tensor, int]:
        s, n, _ = self.eval_counts(model, batch, device, amp)
        return s, n

    def eval_counts(self, model: nn.Module, batch: dict, device: torch.device,
                    amp: ContextManager) -> tuple[torch.Tensor, int, dict]:
        """(sum of per-text losses, texts, {"correct": right predictions, "samples": texts}):
        the loop sums the counts over the whole validation set and all ranks."""
        batch = to_device(batch, device)
        labels = batch["labels"]  # (B,)
        with amp:
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        logits = out.logits.float()  # (B, C)
        s = F.cross_entropy(logits, labels, reduction="sum")
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

    def shortage_message(self, global_batch: int) -> str:
        return (f"{self.cfg.data.source!r} gives {len(self.train_ds)} training texts, fewer than "
                f"one global batch of {global_batch} (trainer.batch_size x workers x "
                "accumulation); use more records or a smaller batch")

    @property
    def model_info(self) -> dict:
        return {"arch": "hf", "path": self.cfg.model.path, "format": "classify",
                "labels": list(self.label_names)}

    def memory_probe(self) -> Optional[MemoryProbe]:
        return None

    @property
    def tokenizer_path(self) -> Optional[Path]:
        path = self.tokenizer_dir / TOKENIZER_FILE
        return path if path.is_file() else None

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """A `from_pretrained` folder whose config.json names the labels (id2label, label2id),
        with the tokenizer's files copied as they are; with LoRA, the merged model there and the
        adapter alone in adapter/ next to it."""
        add_files = lambda folder: copy_tokenizer_files(self.tokenizer_dir, folder)  # noqa: E731
        if self.lora:
            from .lora import ADAPTER_DIR, save_lora
            save_lora(self.build_model(), state, out_dir, out_dir.parent / ADAPTER_DIR, add_files)
            return
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            add_files(tmp)


def load_classifier(path: Optional[str], label_names: Sequence[str], pad_id: int,
                    vocab_size: int) -> nn.Module:
    """AutoModelForSequenceClassification from a local folder (safetensors only, nothing
    downloaded) with `len(label_names)` classes named in its config; a folder with config.json
    alone gives fresh weights."""
    try:
        import transformers
    except ImportError:
        raise ConfigError("data.format=classify needs the transformers package: "
                          "pip install 'paratrain[hf]'") from None
    p = Path(str(path)).expanduser()
    names = [str(n) for n in label_names]
    labels = {"num_labels": len(names), "id2label": dict(enumerate(names)),
              "label2id": {n: i for i, n in enumerate(names)}, "pad_token_id": pad_id}
    config = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model.path={path!r} is an encoder-decoder model "
                          f"({config.model_type}); classification supports encoder-only and "
                          "decoder-only models for now")
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise ConfigError(f"model.path={path!r} has vocab_size={config.vocab_size}, smaller than "
                          f"its tokenizer's {vocab_size} tokens; use the model's own tokenizer")
    auto = transformers.AutoModelForSequenceClassification
    try:
        if any((p / n).exists() for n in ("model.safetensors", "model.safetensors.index.json")):
            return auto.from_pretrained(p, local_files_only=True, use_safetensors=True,
                                        ignore_mismatched_sizes=True, **labels)
        for key, value in labels.items():
            setattr(config, key, value)
        return auto.from_config(config)
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ConfigError(f"model.path={path!r} ({config.model_type}) has no sequence-"
                          "classification head in transformers; pick another model") from None


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
