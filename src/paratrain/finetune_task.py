"""Fine-tuning a pretrained Hugging Face causal LM on input->output pairs or chat records, with
the model's own tokenizer (nothing is retrained) and the loss on the answers only.

The records are read and encoded in every process the same way (encoding is deterministic), so
the workers need only the config, or the Python API's lists, to rebuild the task. Sequences are
padded to the longest of each micro-batch; pads and prompts are IGNORE_INDEX targets, so the
loop's token weighting makes 1 and N workers the same run. The run's model/ folder is a
`from_pretrained` folder that carries the tokenizer files byte for byte.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from torch import nn

from .config import TrainConfig
from .config_checks import resolve_tokenizer
from .data.tokenizer import TOKENIZER_FILE, copy_tokenizer_files
from .errors import ConfigError
from .fileio import atomic_dir
from .formatting import human_count
from .task import MemoryProbe, TokenLoss


@dataclass
class FinetuneRecords:
    """Records given in Python (`Trainer(train_input=..., train_output=...)`): lists of dicts,
    sent to the workers as they are."""
    train: list
    val: Optional[list] = None


@dataclass
class FinetuneTask(TokenLoss):
    """A pretrained causal LM on encoded pairs / chat records (see module docstring); the loss
    unit is an answer token."""
    cfg: TrainConfig
    tokenizer: Any
    train_ds: Any
    val_ds: Any
    tokenizer_dir: Path
    fsdp_wrap: Sequence[type] = ()
    sample_name: str = "examples"
    perplexity: bool = True
    units_per_sample: Optional[int] = None  # answers differ in length: count per batch
    data_fingerprint: Optional[str] = None
    notes: list = field(default_factory=list)  # for the log: pad token, truncation, drops

    @classmethod
    def prepare(cls, cfg: TrainConfig, records: Optional[FinetuneRecords] = None
                ) -> "FinetuneTask":
        from .data.finetune import (FinetuneDataset, encode_chat, encode_pairs,
                                    split_validation)
        from .data.hf_tokenizer import load_tokenizer
        quiet_transformers()
        d = cfg.data
        tokenizer_dir = pretrained_tokenizer_dir(cfg)
        check_causal_lm(cfg.model.path)
        tokenizer, note = load_tokenizer(tokenizer_dir)
        notes = [note] if note else []
        train_rows, val_rows = read_records(cfg, records)

        def encode(rows: list, name: str) -> list:
            if d.format == "chat":
                examples, stats = encode_chat(
                    rows, tokenizer, messages_field=d.messages_field, max_length=d.max_length,
                    chat_template=d.chat_template, system_prompt=d.system_prompt,
                    source_name=name)
            else:
                examples, stats = encode_pairs(
                    rows, tokenizer, input_field=d.input_field, output_field=d.output_field,
                    max_length=d.max_length, chat_template=d.chat_template,
                    system_prompt=d.system_prompt, source_name=name)
            notes.append(stats.summary())
            return examples

        train = encode(train_rows, "train_input" if records else str(d.source))
        if val_rows is not None:
            val = encode(val_rows, "validation_input" if records else str(d.val_source))
        elif d.val_fraction > 0:
            train, val = split_validation(train, d.val_fraction, seed=cfg.trainer.seed)
        else:
            val = []
        return cls(cfg, tokenizer, FinetuneDataset(train), FinetuneDataset(val) if val else None,
                   tokenizer_dir, notes=notes)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .data.finetune import PadCollate
        return PadCollate(self.tokenizer.pad_token_id)

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora.r > 0

    def build_model(self) -> nn.Module:
        """The pretrained model (with LoRA adapters and its base frozen, when asked)."""
        from .lora import apply_lora
        from .models.hf import HFArgs, build_hf
        model = build_hf(HFArgs(self.cfg.model.path, len(self.tokenizer)))
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return apply_lora(model, self.cfg.model.lora) if self.lora else model

    def describe(self, n_params: int) -> str:
        return (f"model hf ({self.cfg.model.path}): {human_count(n_params)} parameters; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")

    def shortage_message(self, global_batch: int) -> str:
        return (f"{self.cfg.data.source!r} gives {len(self.train_ds)} training examples, fewer "
                f"than one global batch of {global_batch} (trainer.batch_size x workers x "
                "accumulation); use more records or a smaller batch")

    @property
    def model_info(self) -> dict:
        return {"arch": "hf", "path": self.cfg.model.path, "format": self.cfg.data.format}

    def memory_probe(self) -> Optional[MemoryProbe]:
        return None

    @property
    def tokenizer_path(self) -> Optional[Path]:
        return self.tokenizer_dir / TOKENIZER_FILE \
            if (self.tokenizer_dir / TOKENIZER_FILE).is_file() else None

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """A `from_pretrained` folder (safetensors) with the tokenizer's files copied as they
        are, written atomically like every output; with LoRA, the merged model there and the
        adapter alone in adapter/ next to it."""
        if self.lora:
            from .lora import ADAPTER_DIR, save_lora
            save_lora(self.build_model(), state, out_dir, out_dir.parent / ADAPTER_DIR,
                      self._copy_tokenizer)
            return
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            self._copy_tokenizer(tmp)

    def _copy_tokenizer(self, folder: Path) -> None:
        """The tokenizer's files as they are; a chat template given as a file goes next to them
        (transformers reads chat_template.jinja), so generation renders prompts the same way."""
        copy_tokenizer_files(self.tokenizer_dir, folder)
        template = Path(self.cfg.data.chat_template).expanduser()
        if self.cfg.data.chat_template not in ("auto", "none") and template.is_file():
            shutil.copyfile(template, folder / "chat_template.jinja")


def pretrained_tokenizer_dir(cfg: TrainConfig) -> Path:
    """data.tokenizer when it names a directory, else (auto) the model's own folder: the choice
    `config_checks.resolve_tokenizer` makes for every task."""
    return Path(resolve_tokenizer(cfg.data, cfg.model)).expanduser()


def read_records(cfg: TrainConfig, records: Optional[FinetuneRecords]
                 ) -> tuple[list, Optional[list]]:
    """(training rows, validation rows or None): the Python API's lists, else data.source and
    data.val_source read as records."""
    from .data.records import read_rows
    if records is not None:
        return records.train, records.val
    d = cfg.data
    if d.source == "stdlib":
        raise ConfigError(f"data.format={d.format} needs data.source: a .jsonl, .parquet or .csv "
                          "file (or a datasets folder) of records")
    train_rows = read_rows(d.source, what="data.source")
    return train_rows, read_rows(d.val_source, what="data.val_source") if d.val_source else None


def quiet_transformers() -> None:
    """transformers' own progress bars and length warnings would interleave with our log: the
    encoders report truncation themselves."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def check_causal_lm(path: Optional[str]) -> None:
    """Decoder-only models only: an encoder-decoder gets one line, not a stack trace."""
    import json
    cfg_file = Path(str(path)).expanduser() / "config.json"
    try:
        info = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return  # build_hf reports a missing or broken config
    if info.get("is_encoder_decoder"):
        raise ConfigError(f"model.path={path!r} is an encoder-decoder model "
                          f"({info.get('model_type', '?')}); fine-tuning supports decoder-only "
                          "causal LMs for now")
