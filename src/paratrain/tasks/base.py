"""What is being trained: the model, its data, its loss, and how the result is saved.

The loop is the same for every task; what differs lives behind `Task`, the base class every task
extends: its required members and its optional seams, each with a default, are the one contract
the loop, validation, the run plan, the memory plan and the launcher read (nothing else asks a
task whether it has something). The tasks are found by `data.format` and `trainer.objective` in
the registry (config/registry.py): `LMTask` (pretraining.py, a language model on a corpus), the
tasks on a pretrained Hugging Face model (finetuning.py's shared base; sft.py, classify.py,
seq2seq.py and the families in preference/, embedding/, rl/), and, outside the registry, the
user's own model and data (`UserTask`, user.py) or any Task subclass handed to
`Trainer(task=...)`.
The unit the loss counts (tokens, texts, samples) is called a *loss unit* everywhere: the loop
weights gradients by it, and throughput (`tokens_per_s` in the files, `unit_name` per second)
counts it, so pads are never counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Mapping, Optional, Sequence

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
    # (the model cut to its first n blocks, how many it has): the plan then measures activations
    # on 1 and 2 blocks and extrapolates (tasks/probe.py), never building it whole
    shallow: Optional[tuple[Callable[[int], nn.Module], int]] = None


@dataclass
class TaskRecords:
    """Records given in Python (`Trainer(model=DIR, train_input=..., train_output=...)`): lists
    of dicts, sent to the workers as they are, read by the task of data.format."""
    train: list
    val: Optional[list] = None


class Task:
    """What the loop needs from a task: the members every task gives, then the optional seams,
    each with the default the run relies on when a task leaves it out. A task is a subclass (the
    built-in ones are dataclasses; a mixin that overrides a seam goes before `Task` in the
    bases). Nothing outside this class asks a task whether it has a member.

    Every task gives:
      `train_ds`, `val_ds` (map-style datasets; `val_ds` None: no validation), `collate`,
      `build_model()`, `count_units(batch)`, `loss(...)`, `describe(n_params)`,
      `shortage_message(global_batch)`, `model_info`, `save(model, out_dir, state)`; the
      registered ones also a classmethod `prepare(cfg, env, records, log)`.
    Optional, with their defaults below:
      what the logs say (`sample_name`, `unit_name`, `perplexity`, `units_per_sample`), what the
      model files and snapshots carry (`tokenizer_path`, `data_fingerprint`), FSDP's units
      (`fsdp_wrap`); models run but not trained (`build_frozen`); figures counted beside the
      loss (`train_counts` / `train_metrics`, `eval_counts` / `eval_metrics`, `eval_block`,
      `progress_keys`); learning from its own samples (`rollout`); the memory plan
      (`memory_probe`); a pipeline (`pipeline_blocks`); a multi-node data share
      (`reads_corpus`)."""
    train_ds: Any  # map-style datasets
    val_ds: Any
    fsdp_wrap: Sequence[type] = ()  # module classes FSDP shards one by one (empty: the blocks)
    sample_name: str = "samples"  # one sample in the batch log line ("sequences of 256 tokens")
    unit_name: str = "samples"  # one loss unit ("tokens", "texts", "pairs"): throughput counts it
    perplexity: bool = False  # the loss is a per-token cross-entropy: exp(loss) is worth logging
    units_per_sample: Optional[int] = None  # loss units per sample when fixed; None: per batch
    tokenizer_path: Optional[Path] = None  # the tokenizer file copied into model/
    data_fingerprint: Optional[str] = None  # what the data was, recorded in snapshots
    # A task whose validation scores samples against each other (embedding/: retrieval): its
    # validation batches are blocks of this many consecutive samples, the same on any world size.
    eval_block: ClassVar[Optional[int]] = None
    # Keys of the logged figures also shown on the progress bar (online RL: reward and times).
    progress_keys: ClassVar[tuple[str, ...]] = ()
    # It reads the token cache of a corpus (pretraining.py): nodes that share data.cache_dir
    # build it together before any task is prepared (trainer.py).
    reads_corpus: ClassVar[bool] = False
    # The blocks a pipeline may cut into stages (pretraining.py: the built-in Llama / GPT of a
    # spec with `pipelined`); None: trainer.pipeline_parallel > 1 is refused in one line.
    pipeline_blocks: Optional[int] = None
    # Optimizer steps trained on each batch of data (online RL's rl.num_iterations: the data
    # advances one batch per that many steps).
    steps_per_batch: int = 1
    # Fine-tuning: the share of the tokens a step computes that are pads (data/packing.py), said
    # in the log, summary.json and `paratrain plan`; None: not measured (a corpus has none).
    padding_share: Optional[float] = None

    @property
    def collate(self) -> Callable[[list], Any]:
        raise NotImplementedError(f"{type(self).__name__} gives no collate")

    def build_model(self) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} gives no build_model")

    def count_units(self, batch: Any) -> int:
        """Loss units in a collated batch."""
        raise NotImplementedError(f"{type(self).__name__} gives no count_units")

    def loss(self, model: nn.Module, batch: Any, device: torch.device,
             amp: ContextManager, frozen: Frozen = NO_FROZEN) -> tuple[torch.Tensor, int]:
        """(sum of the loss over loss units, loss units) for one micro-batch."""
        raise NotImplementedError(f"{type(self).__name__} gives no loss")

    def describe(self, n_params: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} gives no describe")

    def shortage_message(self, global_batch: int) -> str:
        """One line for a training set smaller than one global batch."""
        raise NotImplementedError(f"{type(self).__name__} gives no shortage_message")

    @property
    def model_info(self) -> dict:
        """What the snapshots and model/ record of the model (its arch, path, objective)."""
        raise NotImplementedError(f"{type(self).__name__} gives no model_info")

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """Write the trained model (the unwrapped module, the full state dict) to out_dir."""
        raise NotImplementedError(f"{type(self).__name__} gives no save")

    def build_frozen(self) -> dict[str, nn.Module]:
        """Models run beside the trained one and never trained, by name (DPO's reference, a
        teacher): the run builds, places and shards them with the trained model's parallelism,
        keeps them out of the optimizer and the snapshots, counts their memory, and hands them
        to `loss` as `frozen`. None by default."""
        return {}

    def sample_lengths(self) -> Any:
        """(N,) each training sample's tokens: data.group_by_length's key
        (tasks/finetuning.py); None: its samples have no single length (the config refuses
        group_by_length for them)."""
        return None

    def memory_probe(self) -> Optional[MemoryProbe]:
        """How the memory plan (`paratrain plan`, strategy=auto) can measure this model; None:
        it cannot (auto picks ddp)."""
        return None

    def train_counts(self, model: nn.Module, batch: Any, device: torch.device,
                     amp: ContextManager, frozen: Frozen = NO_FROZEN
                     ) -> tuple[torch.Tensor, int, dict]:
        """(loss sum, loss units, {name: count}) for one training micro-batch: the loop sums the
        counts over micro-steps and ranks exactly like the loss, carries them through snapshots
        and logs `train_metrics` of them (preference/dpo.py: the rewards). By default the loss
        alone."""
        return (*self.loss(model, batch, device, amp, frozen), {})

    def train_metrics(self, counts: dict) -> dict:
        """The logged figures of `train_counts`' sums (called when there are counts)."""
        return {}

    def eval_counts(self, model: nn.Module, batch: Any, device: torch.device,
                    amp: ContextManager, frozen: Frozen = NO_FROZEN
                    ) -> tuple[torch.Tensor, int, dict]:
        """As `train_counts`, at validation: summed over every validation sample once and over
        all ranks (classify.py: right predictions). By default the loss alone."""
        return (*self.loss(model, batch, device, amp, frozen), {})

    def eval_metrics(self, counts: dict) -> dict:
        """The figures reported with the validation loss, from `eval_counts`' sums (called when
        there are counts: classify.py's accuracy)."""
        return {}

    def rollout(self, model: nn.Module, micro: list, step: int, env: Any, amp: ContextManager,
                frozen: Frozen = NO_FROZEN) -> tuple[list, dict]:
        """(the micro-batches the step trains on, {name: figure} summed like the counts): a
        step's micro-batches seen whole before any is trained on. Online RL generates and scores
        completions here (tasks/rl/), the contrastive loss caches the gradient of the step's
        embeddings (GradCache, tasks/embedding/grad_cache.py), KTO estimates its KL over the
        step. By default the micro-batches as read."""
        return micro, {}


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
    units = int((batch["targets"] != IGNORE_INDEX).sum())  # counted on the host: no GPU sync
    batch = to_device(batch, device)
    idx, targets = batch["input_ids"], batch["targets"]  # (B, T), (B, T)
    with amp:
        out = model(idx, **model_inputs(batch))
    logits = out.logits if hasattr(out, "logits") else out  # (B, T, V); HF returns an object
    return token_loss_sum(logits, targets, label_smoothing), units


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
