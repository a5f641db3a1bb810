"""What is being trained: the model, its data, its loss, and how the result is saved.

The loop is the same for every task; what differs lives behind `Task`, a typing.Protocol. The
tasks are found by `data.format` in the registry (config/registry.py): `LMTask` (pretraining.py, a
language model on a corpus), the fine-tuning tasks on a pretrained Hugging Face model (hf.py's
shared base; sft.py, classify.py), and, outside the registry, the user's own model and data
(`UserTask`, user.py) or any Task object handed to `Trainer(task=...)`.
The unit the loss counts (tokens, texts, samples) is called a *loss unit* everywhere: the loop
weights gradients by it, and throughput (`tokens_per_s` in the files, `unit_name` per second)
counts it, so pads are never counted.
A task may also count more than the loss at validation (optional, not in the protocol):
`eval_counts(model, batch, device, amp, frozen)` -> (loss sum, loss units, {name: count}) and
`eval_metrics({name: summed count})` -> figures reported with the validation loss; the loop sums
the counts over every validation sample once and over all ranks (classify.py: accuracy). A task
whose validation scores samples against each other sets `eval_block` (an int): its validation
batches are then blocks of that many consecutive samples, the same on any number of ranks
(embedding.py: retrieval).
Likewise while training: `train_counts(model, batch, device, amp, frozen)` -> (loss sum, loss
units, {name: count}) replaces `loss` when a task has it, and `train_metrics({name: summed
count})` -> figures logged with the loss; the loop sums the counts over micro-steps and ranks
exactly like the loss, and carries them through snapshots (preference.py: DPO's rewards).
A task may need models that are run but not trained (DPO's reference, a distillation teacher):
`build_frozen()` gives them by name; the run builds, places and shards them with the trained
model's parallelism, keeps them out of the optimizer and the snapshots, counts their memory, and
hands them to `loss` as `frozen`.
A task whose model a pipeline may cut into stages says how many blocks it has
(`pipeline_blocks`, pretraining.py: the built-in Llama / GPT of a spec with `pipelined`); without it
trainer.pipeline_parallel > 1 is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data.dataset import IGNORE_INDEX
from ..errors import ConfigError

Frozen = Mapping[str, nn.Module]  # models a task runs without training them, by name
NO_FROZEN: Frozen = {}


@dataclass(frozen=True)
class MemoryProbe:
    """What the memory plan needs to measure a model: how to build it (and the frozen models a
    task runs beside it), and one sample's shape."""
    build_model: Callable[[], nn.Module]
    seq_length: int
    vocab_size: int
    build_frozen: Optional[Callable[[], dict[str, nn.Module]]] = None
    cache: Any = None  # online RL's generation cache (rl/memory.GenerationCache), or None


@dataclass
class TaskRecords:
    """Records given in Python (`Trainer(model=DIR, train_input=..., train_output=...)`): lists
    of dicts, sent to the workers as they are, read by the task of data.format."""
    train: list
    val: Optional[list] = None


class Task(Protocol):
    """What the loop needs from a task."""
    train_ds: Any  # map-style datasets
    val_ds: Any
    fsdp_wrap: Sequence[type]  # module classes FSDP shards one by one (empty: the blocks)
    sample_name: str  # how the batch log line names one sample ("sequences of 256 tokens")
    unit_name: str  # what one loss unit is ("tokens", "texts", "samples"): throughput counts it
    perplexity: bool  # the loss is a per-token cross-entropy: exp(loss) is worth logging
    units_per_sample: Optional[int]  # loss units per sample when fixed; None: count per batch
    tokenizer_path: Optional[Path]
    data_fingerprint: Optional[str]

    @property
    def collate(self) -> Callable[[list], Any]: ...

    def build_model(self) -> nn.Module: ...

    def build_frozen(self) -> dict[str, nn.Module]:
        """Models run beside the trained one and never trained (empty for most tasks)."""

    def count_units(self, batch: Any) -> int:
        """Loss units in a collated batch."""

    def loss(self, model: nn.Module, batch: Any, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
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


class NoFrozenModels:
    """For tasks that train one model and run no other."""

    def build_frozen(self) -> dict[str, nn.Module]:
        return {}


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
    loss is summed over counted tokens, and those tokens are the loss unit. The task's
    `cfg.trainer.label_smoothing` applies while training; validation reports the plain
    cross-entropy (its perplexity stays meaningful and comparable between runs)."""
    unit_name = "tokens"
    cfg: Any  # the run's TrainConfig (a field of the task dataclass)

    def count_units(self, batch: dict) -> int:
        return int((batch["targets"] != IGNORE_INDEX).sum())

    def loss(self, model: nn.Module, batch: dict, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        return token_loss(model, batch, device, amp,
                          label_smoothing=training_smoothing(model, self.cfg))


def training_smoothing(model: nn.Module, cfg: Any) -> float:
    """trainer.label_smoothing while the model trains, 0 while it is evaluated."""
    return cfg.trainer.label_smoothing if model.training else 0.0


def token_loss(model: nn.Module, batch: dict, device: torch.device,
               amp: ContextManager, label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """(sum of token losses, counted tokens) for one micro-batch of next-token targets
    (IGNORE_INDEX where not counted: pads, prompts). `label_smoothing` as torch's (and HF
    Trainer's LabelSmoother): (1 - e) x NLL + e x the mean NLL over the vocabulary."""
    batch = to_device(batch, device)
    idx, targets = batch["input_ids"], batch["targets"]  # (B, T), (B, T)
    with amp:
        out = model(idx, **model_inputs(batch))
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V); HF returns an object
    return token_loss_sum(logits, targets, label_smoothing), int((targets != IGNORE_INDEX).sum())


def model_inputs(batch: dict) -> dict:
    """What a model reads besides the ids: the padding mask of padded rows, or the position ids
    of packed ones (restarting per example: data/packing.py), whichever the batch carries."""
    return {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy summed over the counted targets: logits (B, T, V), targets (B, T). The
    loop's micro-steps and a pipeline's last stage (parallel/pipeline.py) both use it."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum",
                           label_smoothing=label_smoothing)


def sequence_logps(model: nn.Module, batch: dict, amp: ContextManager) -> torch.Tensor:
    """(N,) each sequence's log-probability of its counted targets, summed (pads, prompts:
    IGNORE_INDEX targets count nothing): DPO's policy and reference scores. A sequence is a row,
    or, in packed rows, the tokens of one `seq_index` (preference/packed_pairs.py)."""
    targets = batch["targets"]  # (R, T)
    with amp:
        out = model(batch["input_ids"], **model_inputs(batch))
    logits = out.logits if hasattr(out, "logits") else out  # (R, T, V)
    per_token = -F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="none")  # (R*T,)
    return per_sequence(per_token.view(targets.shape), batch)  # (N,)


def per_sequence(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """(R, T) per-token values -> (N,) sums per sequence: per row, or for packed rows per
    `seq_index` (-1 on pads), N = `num_sequences`."""
    if "seq_index" not in batch:
        return values.sum(-1)  # (R,)
    index = batch["seq_index"]  # (R, T)
    keep = index >= 0
    out = values.new_zeros(int(batch["num_sequences"]))  # (N,)
    return out.index_add(0, index[keep], values[keep])


def check_picklable(**objects: Any) -> None:
    """Workers are spawned: what is handed to them must pickle. Say which argument does not,
    and what to do, before any process starts."""
    import pickle

    from ..formatting import first_line
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
