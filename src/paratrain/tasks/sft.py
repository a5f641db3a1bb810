"""Fine-tuning a pretrained Hugging Face causal LM (AutoModelForCausalLM) on input->output pairs
(`PairsTask`) or chat records (`ChatTask`), with the loss on the answers only.

Sequences are padded to the longest of each micro-batch, or packed several to a row
(data.pack=true: data/packing.py, each example with its own positions and attention); pads and
prompts are IGNORE_INDEX targets, so the loop's token weighting makes 1 and N workers, and packed
and padded batches, the same run. With a chat template
given as a file, model/ carries it as chat_template.jinja, so generation renders prompts the way
training did.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from torch import nn

from ..config.model_folder import refuse_encoder_decoder
from ..config.tree import TrainConfig
from .base import MemoryProbe, TokenLoss
from .finetuning import Encoder, PretrainedTask


@dataclass
class CausalLMTask(TokenLoss, PretrainedTask):
    """A pretrained causal LM on encoded records; the loss unit is an answer token."""
    encode_with: ClassVar[str]  # the subclass's encoder in data/finetune.py
    record_keys: ClassVar[tuple[str, ...]]  # the data.* keys naming its record fields

    @classmethod
    def check_model(cls, cfg: TrainConfig) -> None:
        """Decoder-only models only: an encoder-decoder gets one line, not a stack trace."""
        refuse_encoder_decoder(cfg.model.path, "fine-tuning supports decoder-only causal LMs "
                                               "for now")

    @classmethod
    def encoder(cls, cfg: TrainConfig, tokenizer: Any, notes: list) -> Encoder:
        """The format's encoder from data/finetune.py with its record fields (the subclass's
        `encode_with`, `record_keys`) and the options every causal format shares."""
        from ..data import finetune
        d = cfg.data
        return _Encode(getattr(finetune, cls.encode_with), tokenizer, notes,
                       max_length=cfg.max_length, chat_template=d.chat_template,
                       system_prompt=d.system_prompt, **{k: getattr(d, k) for k in cls.record_keys})

    def memory_probe(self) -> Optional[MemoryProbe]:
        """The model (with its adapters, under LoRA) on a sample of the longest row a batch can
        hold: the longest example, or a packed row's capacity. None for a quantized base: the
        plan would count its weights at full precision."""
        if self.cfg.model.quantize:
            return None
        from .probe import causal_probe
        longest = self.row_capacity() if self.cfg.data.pack else \
            int(self.token_lengths(self.train_ds).max())
        return causal_probe(self.cfg, longest, len(self.tokenizer))

    def load_pretrained(self) -> nn.Module:
        from ..models.hf import HFArgs, build_hf
        model = build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer)))
        if getattr(model.config, "pad_token_id", None) is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def add_files(self, folder: Path) -> None:
        """The tokenizer's files as they are; a chat template given as a file goes next to them
        (transformers reads chat_template.jinja)."""
        super().add_files(folder)
        template = Path(self.cfg.data.chat_template).expanduser()
        if self.cfg.data.chat_template not in ("auto", "none") and template.is_file():
            shutil.copyfile(template, folder / "chat_template.jinja")


class _Encode(Encoder):
    def __init__(self, encode: Any, tokenizer: Any, notes: list, **options: Any):
        self.encode, self.tokenizer, self.notes, self.options = encode, tokenizer, notes, options

    def __call__(self, rows: list, source_name: str) -> list:
        examples, stats = self.encode(rows, self.tokenizer, source_name=source_name,
                                      **self.options)
        self.notes.append(stats.summary())
        return examples


@dataclass
class PairsTask(CausalLMTask):
    """input -> output records; the loss counts the output tokens (and EOS)."""
    encode_with: ClassVar[str] = "encode_pairs"  # in data/finetune.py
    record_keys: ClassVar[tuple[str, ...]] = ("input_field", "output_field")  # data.* keys


@dataclass
class ChatTask(CausalLMTask):
    """Conversations rendered with the chat template; the loss counts the assistant turns."""
    encode_with: ClassVar[str] = "encode_chat"
    record_keys: ClassVar[tuple[str, ...]] = ("messages_field",)
