"""Input->output pairs for an encoder-decoder model (T5, BART): the input goes to the encoder,
the output is the decoder's target, and only the target's tokens are scored.

The input is tokenized with the tokenizer's own special tokens (T5 ends it with EOS) and cut from
the right at data.max_length (the tokenizer keeps its special tokens when it truncates); the
target ends with EOS, so the model learns where to stop, and a target longer than data.max_length
is dropped (counted), never cut.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

from .dataset import IGNORE_INDEX
from .finetune import TOKENIZE_BATCH, EncodeStats, check_inputs, row_text
from .hf_tokenizer import eos_id
from .ragged import RaggedDataset, pad_rows

# {"input_ids": [ids] for the encoder, "targets": [ids] for the decoder}
Seq2SeqExample = Dict[str, List[int]]


def encode_seq2seq(rows: Sequence[Dict[str, Any]], tokenizer: Any, *, input_field: str = "input",
                   output_field: str = "output", max_length: int, source_name: str = "data"
                   ) -> Tuple[List[Seq2SeqExample], EncodeStats]:
    """Rows -> encoder inputs and decoder targets (module docstring)."""
    check_inputs(rows, max_length, source_name)
    inputs = [row_text(row, input_field, "data.input_field", source_name, i)
              for i, row in enumerate(rows, start=1)]
    outputs = [row_text(row, output_field, "data.output_field", source_name, i)
               for i, row in enumerate(rows, start=1)]
    eos = eos_id(tokenizer)
    stats = EncodeStats(source_name, rows=len(rows))
    examples: List[Seq2SeqExample] = []
    for start in range(0, len(rows), TOKENIZE_BATCH):
        chunk = slice(start, start + TOKENIZE_BATCH)
        sources = tokenizer(inputs[chunk], add_special_tokens=True)["input_ids"]
        targets = tokenizer(outputs[chunk], add_special_tokens=True)["input_ids"]
        for text, source, target in zip(inputs[chunk], sources, targets):
            target = list(target) if target and target[-1] == eos else list(target) + [eos]
            stats._see(len(source) + len(target), len(target))
            if len(target) > max_length:
                stats.dropped += 1
                continue
            cut = len(source) > max_length
            if cut:
                source = tokenizer(text, add_special_tokens=True, truncation=True,
                                   max_length=max_length)["input_ids"]
            if not source:
                stats.skipped += 1
                continue
            examples.append({"input_ids": list(source), "targets": target})
            stats.kept += 1
            stats.truncated += cut
            stats.longest = max(stats.longest, len(source), len(target))
    stats._check_some_kept(max_length, "examples")
    return examples, stats


def seq2seq_dataset(examples: Sequence[Seq2SeqExample]) -> RaggedDataset:
    return RaggedDataset(examples, what="input->output pairs")


class Seq2SeqCollate:
    """list of examples -> input_ids / attention_mask (B, S) for the encoder, right-padded, and
    targets (B, L), IGNORE_INDEX after each target's end (the model shifts them right into its
    decoder inputs, pads for IGNORE_INDEX)."""

    def __init__(self, pad_id: int):
        self.pad_id = int(pad_id)

    def __call__(self, batch: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        input_ids, attention_mask = pad_rows([ex["input_ids"] for ex in batch], self.pad_id)
        targets, _ = pad_rows([ex["targets"] for ex in batch], IGNORE_INDEX)  # (B, L)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "targets": targets}
