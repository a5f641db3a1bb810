"""Fine-tuning a pretrained encoder-decoder model (T5, BART: AutoModelForSeq2SeqLM) on
input->output pairs (`data.format=pairs` with such a model.path; trainer.objective=seq2seq): the
input goes to the encoder, and the loss is the decoder's cross-entropy on the target tokens only.

The loss unit is a target token, as for a causal LM's answers, so 1 and N workers give the same
run; pads of the input are masked out of attention (changing them changes nothing) and pads of
the target are IGNORE_INDEX. FSDP shards every block of both stacks (the model names them in
`_no_split_modules`; parallel/blocks.find_block_lists finds encoder.block and decoder.block).
LoRA adapters go on T5's attention projections by their own names: model.lora.target_modules=
[q,v]. model/ is a `from_pretrained` folder with the tokenizer, and `paratrain generate` prints
the model's output for a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from ..data.dataset import IGNORE_INDEX
from ..errors import ConfigError
from ..formatting import human_count
from .base import NO_FROZEN, Frozen, TokenLoss, to_device
from .finetuning import Encoder, PretrainedTask


@dataclass
class Seq2SeqTask(TokenLoss, PretrainedTask):
    """Input->output pairs on an encoder-decoder model (module docstring)."""
    lora_task_type: ClassVar[str] = "SEQ_2_SEQ_LM"

    @classmethod
    def encoder(cls, cfg: Any, tokenizer: Any, notes: list) -> Encoder:
        return _EncodeSeq2Seq(cfg, tokenizer, notes)

    @classmethod
    def dataset(cls, examples: list) -> Any:
        from ..data.seq2seq import seq2seq_dataset
        return seq2seq_dataset(examples)

    @classmethod
    def token_lengths(cls, ds: Any) -> Any:
        """(N,) an example's encoder and decoder tokens: the padding estimate's and
        data.group_by_length's key (both sides are padded to their longest)."""
        return ds.lengths("input_ids") + ds.lengths("targets")

    @property
    def collate(self) -> Callable[[list], Any]:
        from ..data.seq2seq import Seq2SeqCollate
        return Seq2SeqCollate(self.tokenizer.pad_token_id)

    def load_pretrained(self) -> nn.Module:
        from ..models.hf import HFArgs, build_hf
        model = build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer),
                                   auto_class="AutoModelForSeq2SeqLM"))
        if getattr(model.config, "decoder_start_token_id", None) is None:
            raise ConfigError(f"model.path={self.cfg.model.path!r} has no "
                              "decoder_start_token_id in its config.json; set it (T5: the pad "
                              "id) so the decoder knows how to start")
        return model

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        """(sum of the target tokens' losses, target tokens)."""
        batch = to_device(batch, device)
        targets = batch["targets"]  # (B, L)
        with amp:  # the model shifts the targets right into its decoder inputs
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=targets)
        s = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum")  # logits (B, L, V)
        return s, int((targets != IGNORE_INDEX).sum())

    def describe(self, n_params: int) -> str:
        return (f"seq2seq model hf ({self.cfg.model.path}): {human_count(n_params)} parameters; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")


class _EncodeSeq2Seq(Encoder):
    def __init__(self, cfg: Any, tokenizer: Any, notes: list):
        self.data, self.tokenizer, self.notes = cfg.data, tokenizer, notes
        self.max_length = cfg.max_length  # data.max_length, or the model's limit

    def __call__(self, rows: list, source_name: str) -> list:
        from ..data.seq2seq import encode_seq2seq
        d = self.data
        examples, stats = encode_seq2seq(rows, self.tokenizer, input_field=d.input_field,
                                         output_field=d.output_field, max_length=self.max_length,
                                         source_name=source_name)
        self.notes.append(stats.summary())
        return examples


def generate_seq2seq(model_dir: Path, prompt: str, opts: Any) -> str:
    """`paratrain generate` on a seq2seq run: the model's output for --prompt (the encoder's
    input), not a continuation of it. `opts`: models.generate.GenerateOptions."""
    from ..models.hf import load_for_prompt
    tokenizer, model, ids = load_for_prompt(model_dir, "AutoModelForSeq2SeqLM", prompt,
                                            opts.device)
    torch.manual_seed(opts.seed)
    sample = opts.temperature > 0
    out = model.generate(**ids, max_new_tokens=opts.max_new_tokens, do_sample=sample,
                         temperature=opts.temperature if sample else None,
                         top_k=opts.top_k if sample else None)
    return tokenizer.decode(out[0].tolist(), skip_special_tokens=True)
