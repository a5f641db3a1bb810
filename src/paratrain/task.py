"""What is being trained: the model, its data, its loss, and how the result is saved.

The loop is the same for every task; what differs lives behind `Task`, a typing.Protocol:
- `LMTask` (here): the built-in Llama / GPT, or a local Hugging Face causal LM, on a tokenized
  corpus; the loss is a sum over tokens, so the loop weights every token equally across ranks.
- `UserTask` (user_task.py): any nn.Module factory, map-style dataset, collate and loss; the loss
  is the user's batch mean times the samples, so the same rule holds per sample.
The unit the loss counts (tokens, samples) is called a *loss unit* everywhere: the loop weights
gradients by it, and throughput (`tokens_per_s`) counts it, so pads are never counted.
A task may also count more than the loss at validation (optional, not in the protocol):
`eval_counts(model, batch, device, amp)` -> (loss sum, loss units, {name: count}) and
`eval_metrics({name: summed count})` -> figures reported with the validation loss; the loop sums
the counts over every validation sample once and over all ranks (classify_task.py: accuracy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .config_checks import has_weights
from .data.dataset import IGNORE_INDEX  # the pads' targets, skipped by the loss
from .dist import DistEnv
from .errors import ConfigError
from .formatting import human_count


@dataclass(frozen=True)
class MemoryProbe:
    """What the memory plan needs to measure a model: how to build it, and one sample's shape."""
    build_model: Callable[[], nn.Module]
    seq_length: int
    vocab_size: int


class Task(Protocol):
    """What the loop needs from a task."""
    train_ds: Any  # map-style datasets
    val_ds: Any
    fsdp_wrap: Sequence[type]  # module classes FSDP shards one by one (empty: the blocks)
    sample_name: str  # how the batch log line names one sample ("sequences of 256 tokens")
    perplexity: bool  # the loss is a per-token cross-entropy: exp(loss) is worth logging
    units_per_sample: Optional[int]  # loss units per sample when fixed; None: count per batch
    tokenizer_path: Optional[Path]
    data_fingerprint: Optional[str]

    @property
    def collate(self) -> Callable[[list], Any]: ...

    def build_model(self) -> nn.Module: ...

    def count_units(self, batch: Any) -> int:
        """Loss units in a collated batch."""

    def loss(self, model: nn.Module, batch: Any, device: torch.device,
             amp: ContextManager) -> tuple[torch.Tensor, int]:
        """(sum of the loss over loss units, loss units) for one micro-batch."""

    def describe(self, n_params: int) -> str: ...

    def shortage_message(self, global_batch: int) -> str:
        """One line for a training set smaller than one global batch."""

    @property
    def model_info(self) -> dict: ...

    def memory_probe(self) -> Optional[MemoryProbe]:
        """How the memory plan can measure this model; None: it cannot (auto picks ddp)."""

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """Write the trained model (the unwrapped module, the full state dict) to out_dir."""


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors anywhere inside dicts, lists and tuples, moved (asynchronously from pinned RAM)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class TokenLoss:
    """For tasks whose batches carry next-token `targets` (IGNORE_INDEX where not counted): the
    loss is summed over counted tokens, and those tokens are the loss unit."""

    def count_units(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager) -> tuple[torch.Tensor, int]:
        return token_loss(model, batch, device, amp)


@dataclass
class LMTask(TokenLoss):
    """A language model on a tokenized corpus (the data cache built by data/cache.py)."""
    cfg: TrainConfig
    prepared: Any  # data.PreparedData
    args: Any  # models.ModelArgs or models.hf.HFArgs
    train_ds: Any = None
    val_ds: Any = None
    fsdp_wrap: Sequence[type] = ()
    perplexity: bool = True

    @classmethod
    def prepare(cls, cfg: TrainConfig, env: DistEnv, log: Callable[[str], None]) -> "LMTask":
        """Local rank 0 builds the token cache (a no-op when the launcher already did); the
        other ranks of the node wait for it; a node that shares the directory reuses it."""
        from .data import build_dataset, prepare_data, wait_for_data
        from .models import resolve_model_config
        from .models.hf import HFArgs
        data = cfg.corpus_data  # data.tokenizer=auto decided for the model (config.py)
        if env.is_local_master:
            prepared = prepare_data(data, cfg.cache_dir, log=log)
        else:
            prepared = wait_for_data(data, cfg.cache_dir, timeout_s=3600.0)
        if cfg.model.arch == "hf":
            log(hf_tokenizer_line(cfg, data.tokenizer, prepared.vocab_size))
        vocab = cfg.model.vocab_size or prepared.vocab_size  # the tokenizer's
        args = HFArgs(cfg.model.path, vocab) if cfg.model.arch == "hf" else \
            resolve_model_config(cfg.model, vocab_size=vocab, seq_length=cfg.data.seq_length)
        train = build_dataset(prepared, "train", cfg.data)
        if cfg.data.format == "padded":  # say what long documents become, either way
            n, extra = train.overflow_summary()
            if n:
                log(f"data: {n} of {train.num_docs} training documents are longer than "
                    f"data.seq_length={cfg.data.seq_length}; " + (
                        f"data.padded_overflow=truncate drops their {extra:,} later tokens "
                        "(split keeps them as more rows)" if cfg.data.padded_overflow ==
                        "truncate" else f"split into {len(train)} rows in all"))
        return cls(cfg, prepared, args, train, build_dataset(prepared, "val", cfg.data))

    @property
    def is_hf(self) -> bool:
        return self.cfg.model.arch == "hf"

    def build_model(self) -> nn.Module:
        from .models import build_model
        from .models.hf import build_hf
        return build_hf(self.args) if self.is_hf else build_model(self.args)

    @property
    def collate(self) -> Callable[[list], Any]:
        from .data import collate
        return collate

    @property
    def sample_name(self) -> str:
        return f"sequences of {self.cfg.data.seq_length} tokens"

    @property
    def units_per_sample(self) -> Optional[int]:
        """Packed windows count every token; padded rows ignore their pads (count per batch)."""
        return self.cfg.data.seq_length if self.cfg.data.format == "packed" else None

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
        from .model_io import save_model
        from .models.hf import save_hf
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


def token_loss(model: nn.Module, batch: dict, device: torch.device,
               amp: ContextManager) -> tuple[torch.Tensor, int]:
    """(sum of token losses, counted tokens) for one micro-batch of next-token targets
    (IGNORE_INDEX where not counted: pads, prompts)."""
    batch = to_device(batch, device)
    idx, targets = batch["input_ids"], batch["targets"]  # (B, T), (B, T)
    with amp:
        out = model(idx, attention_mask=batch.get("attention_mask"))
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V); HF returns an object
    s = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                        ignore_index=IGNORE_INDEX, reduction="sum")
    return s, int((targets != IGNORE_INDEX).sum())


def check_picklable(**objects: Any) -> None:
    """Workers are spawned: what is handed to them must pickle. Say which argument does not,
    and what to do, before any process starts."""
    import pickle

    from .formatting import first_line
    for name, obj in objects.items():
        if obj is None:
            continue
        try:
            pickle.dumps(obj)
        except Exception as e:  # PicklingError, AttributeError (local objects), TypeError
            raise ConfigError(
                f"{name}= cannot be sent to the worker processes ({type(e).__name__}: "
                f"{first_line(e) if str(e) else ''}); define it at module level (not a "
                "lambda or a function inside another function), or run under torchrun") from None
