"""The built-in language model (Llama / GPT from a preset, or a local Hugging Face causal LM) on
a tokenized corpus, packed into full windows or one document per padded row (data.format packed /
padded). The loss is a sum over tokens, so the loop weights every token equally across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

from torch import nn

from ..config.model_folder import check_embeddings, has_weights
from ..config.presets import ModelArgs
from ..config.tree import TrainConfig
from ..data.cache import PreparedData
from ..dist import DistEnv
from ..formatting import human_count
from ..models.hf import HFArgs
from .base import MemoryProbe, Task, TaskRecords, TokenLoss


@dataclass
class LMTask(TokenLoss, Task):
    """A language model on a tokenized corpus (the data cache built by data/cache.py)."""
    cfg: TrainConfig
    prepared: PreparedData
    args: Union[ModelArgs, HFArgs]
    train_ds: Any = None
    val_ds: Any = None
    fsdp_wrap: Sequence[type] = ()
    perplexity: bool = True
    reads_corpus: ClassVar[bool] = True  # its token cache: nodes that share it split the work

    @classmethod
    def prepare(cls, cfg: TrainConfig, env: DistEnv, records: Optional[TaskRecords],
                log: Callable[[str], None]) -> "LMTask":
        """Local rank 0 builds the token cache (a no-op when the launcher already did); the
        other ranks of the node wait for it; a node that shares the directory reuses it.
        (`records`: always None; a corpus is read from data.source.)"""
        from ..data import build_dataset, prepare_data, wait_for_data
        from ..models import resolve_model_config
        data = cfg.corpus_data  # data.tokenizer=auto decided for the model (config/defaults.py)
        if env.is_local_master:
            prepared = prepare_data(data, cfg.cache_dir, log=log, packed=cfg.task_spec.packed)
        else:
            prepared = wait_for_data(data, cfg.cache_dir, timeout_s=3600.0)
        if cfg.model.arch == "hf":
            log(hf_tokenizer_line(cfg, data.tokenizer, prepared.vocab_size))
            check_embeddings(cfg, prepared.vocab_size)  # in the launching process: before launch
        vocab = cfg.model.vocab_size or prepared.vocab_size  # the tokenizer's
        args = HFArgs.of(cfg.model, vocab) if cfg.model.arch == "hf" else \
            resolve_model_config(cfg.model, vocab_size=vocab, seq_length=cfg.data.seq_length)
        train = build_dataset(prepared, "train", cfg.data, packed=cfg.task_spec.packed)
        if not cfg.task_spec.packed:  # padded: what long documents become
            n, extra = train.overflow_summary()
            if n:
                log(f"data: {n} of {train.num_docs} training documents are longer than "
                    f"data.seq_length={cfg.data.seq_length}; " + (
                        f"data.padded_overflow=truncate drops their {extra:,} later tokens "
                        "(split keeps them as more rows)" if cfg.data.padded_overflow ==
                        "truncate" else f"split into {len(train)} rows in all"))
        val = build_dataset(prepared, "val", cfg.data, packed=cfg.task_spec.packed)
        return cls(cfg, prepared, args, train, val)

    @property
    def is_hf(self) -> bool:
        return self.cfg.model.arch == "hf"

    def build_model(self) -> nn.Module:
        from ..models import build_model, torch_default_init
        from ..models.hf import build_hf
        if self.is_hf:
            model = build_hf(self.args)
            if self.cfg.data.document_mask:  # it must keep the documents of a window apart
                from ..models.hf import check_packed_attention
                check_packed_attention(model)
            return model
        model = build_model(self.args)
        return torch_default_init(model) if self.cfg.model.init == "torch" else model

    @property
    def collate(self) -> Callable[[list], Any]:
        from ..data import collate
        if self.cfg.data.document_mask:  # positions restart per document: attention within it
            from ..data.packing import DocumentCollate
            return DocumentCollate(self.prepared.meta["eot_id"])
        return collate

    @property
    def sample_name(self) -> str:
        return f"sequences of {self.cfg.data.seq_length} tokens"

    @property
    def units_per_sample(self) -> Optional[int]:
        """Packed windows count every token; padded rows ignore their pads (count per batch)."""
        return self.cfg.data.seq_length if self.cfg.task_spec.packed else None

    @property
    def pipeline_blocks(self) -> Optional[int]:
        """The blocks a pipeline may cut into stages: the built-in model's, when its task
        pipelines (TaskSpec.pipelined, checked with the config); None: it cannot be cut."""
        return self.args.num_layers if self.cfg.task_spec.pipelined and not self.is_hf else None

    def describe(self, n_params: int) -> str:
        return f"model {self.args.arch}: {human_count(n_params)} parameters"

    def shortage_message(self, global_batch: int) -> str:
        d = self.cfg.data
        return (f"data.source={d.source!r} gives {len(self.train_ds)} training sequences of "
                f"data.seq_length={d.seq_length}, fewer than one global batch of {global_batch} "
                "(trainer.batch_size x workers x accumulation); use more text, a shorter "
                "data.seq_length or a smaller batch")

    @property
    def model_info(self) -> dict:
        return self.args.to_dict()

    def memory_probe(self) -> Optional[MemoryProbe]:
        if self.is_hf:
            return None
        return MemoryProbe(self.build_model, self.cfg.data.seq_length, self.args.vocab_size)

    @property
    def tokenizer_path(self) -> Optional[Path]:
        return self.prepared.tokenizer_path

    @property
    def data_fingerprint(self) -> Optional[str]:
        return self.prepared.meta.get("fingerprint")

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        from ..models.files import save_model
        from ..models.hf import save_hf
        if self.is_hf:
            save_hf(model, out_dir, state, self.tokenizer_path)
        else:
            save_model(out_dir, state, self.args.to_dict(), self.tokenizer_path)


def hf_tokenizer_line(cfg: TrainConfig, tokenizer: str, vocab_size: int) -> str:
    """One log line: which tokenizer a Hugging Face model reads the corpus with."""
    if cfg.data.tokenizer == "auto":
        return (f"tokenizer: the model's own, from model.path={cfg.model.path} ({vocab_size} "
                "tokens; nothing is trained)")
    if tokenizer not in ("bpe", "char"):
        return (f"tokenizer: data.tokenizer={tokenizer} ({vocab_size} tokens), instead of "
                "model.path's own")
    return (f"tokenizer: {tokenizer} trained on the corpus ({vocab_size} tokens)" + (
        f"; model.path={cfg.model.path}'s weights were trained on other ids, so its embeddings "
        "are relearned" if has_weights(cfg.model.path) else ""))
