"""What is being trained: the model, its data, its loss, and how it is saved.

The loop is the same for the built-in language models and for a user's own model and dataset;
what differs lives behind this small interface:
- `LMTask`: the built-in Llama / GPT (or a local Hugging Face causal LM) on a tokenized corpus;
  the loss is a sum over tokens, so the loop can weight every token equally across ranks.
- `UserTask`: any nn.Module factory, map-style dataset, collate and loss; the loss is the user's
  mean over a batch, weighted by the number of samples, so the same rule holds per sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .data.dataset import IGNORE_INDEX  # the pads' targets, skipped by the loss
from .dist import DistEnv
from .errors import ConfigError


def to_device(batch: Any, device: torch.device) -> Any:
    """Tensors anywhere inside dicts, lists and tuples, moved (asynchronously from pinned RAM)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_len(batch: Any) -> int:
    """Samples in a collated batch: the leading size of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    items = batch.values() if isinstance(batch, dict) else batch
    for v in items:
        if isinstance(v, torch.Tensor):
            return int(v.shape[0])
        if isinstance(v, (dict, list, tuple)):
            return batch_len(v)
    raise ConfigError("cannot tell the batch size of a batch without tensors; make collate_fn "
                      "return tensors (or dicts / tuples of tensors)")


@dataclass
class LMTask:
    """A language model on a tokenized corpus (the data cache built by data/cache.py)."""
    cfg: TrainConfig
    prepared: Any  # data.PreparedData
    args: Any  # models.ModelArgs
    train_ds: Any = None
    val_ds: Any = None
    fsdp_wrap: Sequence[type] = ()

    @classmethod
    def prepare(cls, cfg: TrainConfig, env: DistEnv, log: Callable[[str], None]) -> "LMTask":
        """Local rank 0 builds the token cache (a no-op when the launcher already did); the
        other ranks of the node wait for it; a node that shares the directory reuses it."""
        from .data import build_dataset, prepare_data, wait_for_data
        from .models import resolve_model_config
        if env.is_local_master:
            prepared = prepare_data(cfg.data, cfg.cache_dir, log=log)
        else:
            prepared = wait_for_data(cfg.data, cfg.cache_dir, timeout_s=3600.0)
        vocab = cfg.model.vocab_size or prepared.tokenizer().vocab_size
        args = HFArgs(cfg.model.path, vocab) if cfg.model.arch == "hf" else \
            resolve_model_config(cfg.model, vocab_size=vocab, seq_length=cfg.data.seq_length)
        return cls(cfg, prepared, args, build_dataset(prepared, "train", cfg.data),
                   build_dataset(prepared, "val", cfg.data))

    def build_model(self) -> nn.Module:
        from .models import build_model
        return build_hf(self.args) if isinstance(self.args, HFArgs) else build_model(self.args)

    @property
    def collate(self) -> Callable:
        from .data import collate
        return collate

    @property
    def units_per_sample(self) -> Optional[int]:
        """Counted units (tokens) per sample when every sample has the same number, else None:
        packed windows count every token; padded rows ignore their pads."""
        return self.cfg.data.seq_length if self.cfg.data.format == "packed" else None

    @property
    def tokens_per_sample(self) -> int:
        return self.cfg.data.seq_length

    def count(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager) -> tuple[torch.Tensor, int]:
        """(sum of token losses, counted tokens) for one micro-batch."""
        batch = to_device(batch, device)
        idx, targets = batch["input_ids"], batch["targets"]  # (B, T), (B, T)
        with amp:
            out = model(idx, attention_mask=batch.get("attention_mask"))
        logits = out.logits if hasattr(out, "logits") else out  # (B, T, V); HF returns an object
        s = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum")
        return s, int((targets != IGNORE_INDEX).sum())

    def describe(self, n_params: int) -> str:
        return f"model {self.args.arch}: {n_params / 1e6:.2f}M parameters"

    @property
    def model_info(self) -> dict:
        return self.args.to_dict()

    @property
    def tokenizer_path(self) -> Optional[Path]:
        return self.prepared.tokenizer_path

    @property
    def data_fingerprint(self) -> Optional[str]:
        return self.prepared.meta.get("fingerprint")

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        from .checkpoint import save_model
        from .strategies import unwrap
        if isinstance(self.args, HFArgs):
            save_hf(unwrap(model), out_dir, state, self.tokenizer_path)
        else:
            save_model(out_dir, state, self.args.to_dict(), self.tokenizer_path)


@dataclass
class UserTask:
    """The user's own model and data (see `Trainer(model=..., train_data=...)`)."""
    model_factory: Callable[[], nn.Module]
    train_ds: Any
    val_ds: Any = None
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
    collate_fn: Optional[Callable] = None
    fsdp_wrap: Sequence[type] = field(default_factory=tuple)
    units_per_sample: Optional[int] = 1  # samples are the unit the loss is averaged over
    tokens_per_sample: int = 1  # throughput is reported in samples/s
    tokenizer_path: Optional[Path] = None
    data_fingerprint: Optional[str] = None

    def build_model(self) -> nn.Module:
        model = self.model_factory()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model= must be a callable returning an nn.Module; it returned "
                              f"{type(model).__name__}")
        return model

    @property
    def collate(self) -> Callable:
        from torch.utils.data import default_collate
        return self.collate_fn or default_collate

    def count(self, batch: Any) -> int:
        return batch_len(batch)

    def loss(self, model: nn.Module, batch: Any, device: torch.device,
             amp: ContextManager) -> tuple[torch.Tensor, int]:
        """(loss x samples, samples): the user's batch mean turned back into a sum, so that
        micro-batches and ranks of different sizes weigh each sample equally."""
        batch = to_device(batch, device)
        n = batch_len(batch)
        with amp:
            if isinstance(batch, dict):
                out = model(**batch)
            elif isinstance(batch, (list, tuple)):
                out = model(batch[0])
            else:
                out = model(batch)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, batch)
        elif hasattr(out, "loss") and out.loss is not None:
            loss = out.loss
        elif isinstance(out, dict) and "loss" in out:
            loss = out["loss"]
        elif isinstance(out, torch.Tensor) and out.dim() == 0:
            loss = out
        else:
            raise ConfigError("the model did not return a loss; pass loss_fn=(output, batch) -> "
                              "loss to Trainer, or return a scalar (or an object with .loss)")
        return loss.float() * n, n

    def describe(self, n_params: int) -> str:
        return f"model {type(self.model_factory).__name__}: {n_params / 1e6:.2f}M parameters"

    @property
    def model_info(self) -> dict:
        return {"arch": "user", "factory": getattr(self.model_factory, "__qualname__", "?")}

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """Hugging Face models as a `from_pretrained` directory; any other module as
        model.safetensors (load it into a fresh model from your factory)."""
        from .checkpoint import save_model
        from .strategies import unwrap
        inner = unwrap(model)
        if hasattr(inner, "save_pretrained"):
            save_hf(inner, out_dir, state, self.tokenizer_path)
        else:
            save_model(out_dir, state, self.model_info, self.tokenizer_path)


def save_hf(model: nn.Module, out_dir: Path, state: dict, tokenizer_path: Optional[Path]) -> None:
    """A `save_pretrained` folder (safetensors), written atomically like every output."""
    import shutil

    from .checkpoint import TOKENIZER, atomic_dir
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)


def check_picklable(**objects: Any) -> None:
    """Workers are spawned: what is handed to them must pickle. Say which argument does not,
    and what to do, before any process starts."""
    import pickle
    for name, obj in objects.items():
        if obj is None:
            continue
        try:
            pickle.dumps(obj)
        except Exception as e:  # PicklingError, AttributeError (local objects), TypeError
            raise ConfigError(
                f"{name}= cannot be sent to the worker processes ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); define it at module level (not a "
                "lambda or a function inside another function), or run under torchrun") from None


@dataclass(frozen=True)
class HFArgs:
    """`model.arch=hf`: a local Hugging Face causal LM (a directory with config.json, with or
    without weights). Nothing is downloaded: local files only."""
    path: str
    vocab_size: int
    arch: str = "hf"

    def to_dict(self) -> dict:
        return {"arch": self.arch, "path": self.path, "vocab_size": self.vocab_size}


def build_hf(args: HFArgs) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.arch=hf needs the transformers package: "
                          "pip install 'paratrain[hf]'") from None
    p = Path(args.path).expanduser()
    config = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    if getattr(config, "vocab_size", args.vocab_size) < args.vocab_size:
        raise ConfigError(f"model.path={args.path!r} has vocab_size={config.vocab_size}, smaller "
                          f"than the tokenizer's {args.vocab_size}; raise it in config.json or "
                          "lower data.vocab_size")
    weights = p.is_dir() and any((p / n).exists() for n in
                                 ("model.safetensors", "model.safetensors.index.json"))
    if weights:  # safetensors only: nothing from the path is unpickled
        return transformers.AutoModelForCausalLM.from_pretrained(p, local_files_only=True,
                                                                 use_safetensors=True)
    return transformers.AutoModelForCausalLM.from_config(config)
