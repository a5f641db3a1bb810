"""Fine-tuning, shared: what every task on a pretrained Hugging Face model has in common
(`PretrainedTask`): the model's own tokenizer (nothing is retrained), the records (files or the
Python API's lists), the held-out validation split, LoRA, pad-to-longest or packed batches
(data.pack), and a `from_pretrained` output folder that carries the tokenizer files byte for
byte. A task (sft.py, classify.py, seq2seq.py, the families' folders) adds its encoder, the
transformers auto class it loads, and its loss. (models/hf.py loads and saves Hugging Face
models; this module is the fine-tuning task around one.)

The records are encoded once, by the launcher, into a cache keyed by everything that changes them
(data/encoded.py): the workers, and the next run on the same data, map it instead of loading the
tokenizer and encoding again; they need only the config, or the Python API's lists, to find it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import nn

from ..config.defaults import resolve_tokenizer
from ..config.model_folder import check_embeddings
from ..config.tree import TrainConfig
from ..data.encoded import Encoded, fingerprint, load_or_encode
from ..data.tokenizer import TOKENIZER_FILE, copy_tokenizer_files
from ..dist import DistEnv
from ..errors import ConfigError
from ..fileio import atomic_dir
from ..formatting import human_count
from ..models.hf import hf_config, make_portable, quiet_transformers, remote_code
from .base import MemoryProbe, Task, TaskRecords
from .neftune import PackedNEFTune, neftune_noise  # noqa: F401 (imported from here too)


class Encoder:
    """Turns records into examples for one task; may learn from the training rows what the
    validation rows need (a classifier's label ids), and hand it to the task (`task_fields`)."""

    def __call__(self, rows: list, source_name: str) -> list: ...

    def task_fields(self) -> dict:
        return {}


@dataclass
class PretrainedTask(Task):
    """A pretrained Hugging Face model on encoded records (see module docstring)."""
    cfg: TrainConfig
    tokenizer: Any  # transformers' PreTrainedTokenizerBase
    train_ds: Any
    val_ds: Any
    tokenizer_dir: Path
    fsdp_wrap: Sequence[type] = ()
    data_fingerprint: Optional[str] = None
    # what differs per task (class attributes)
    sample_name: ClassVar[str] = "examples"  # one sample, in log lines
    perplexity: ClassVar[bool] = True  # a per-token cross-entropy (not a classifier's)
    units_per_sample: ClassVar[Optional[int]] = None  # answers differ in length: per batch
    lora_task_type: ClassVar[str] = "CAUSAL_LM"  # peft's task_type
    auto_class: ClassVar[str] = "AutoModelForCausalLM"  # transformers' class of the model
    row_capacity_key: ClassVar[str] = "data.max_length"  # a packed row's size, in log lines

    @classmethod
    def prepare(cls, cfg: TrainConfig, env: DistEnv, records: Optional[TaskRecords],
                log: Callable[[str], None]) -> "PretrainedTask":
        """The encoded records (reused from the cache, or encoded and cached: data/encoded.py;
        a task whose examples have a dataset of its own encodes in every process) and the
        validation split; each note is logged."""
        from ..data.examples import validation_rows
        d = cfg.data
        tokenizer_dir = Path(resolve_tokenizer(cfg.data, cfg.model)).expanduser()
        cls.check_model(cfg)
        train_src, val_src = record_sources(cfg, records)
        names = {"train": "the training records given to Trainer()" if records else str(d.source),
                 "val": "the validation records given to Trainer()" if records else
                 str(d.val_source),
                 "tokenizer": str(tokenizer_dir)}
        if cls.dataset.__func__ is PretrainedTask.dataset.__func__:  # arrays: cached, mapped
            key = fingerprint(cfg, f"{cls.__module__}.{cls.__qualname__}", train_src, val_src,
                              tokenizer_dir)
            encoded = load_or_encode(cfg.cache_dir, key, tokenizer_dir, names,
                                     lambda: cls.encode_records(cfg, tokenizer_dir, train_src,
                                                                val_src, names), log,
                                     check_reused=lambda e: cls.check_fits(cfg, e.tokenizer))
        else:
            encoded = cls.encode_records(cfg, tokenizer_dir, train_src, val_src, names,
                                         split=True)
            for line in encoded.notes:
                log(line)
        train, val = encoded.train, encoded.val
        held_out = val_src is None and d.val_fraction > 0  # no validation records: a split
        if held_out and val is None:  # (the cached examples are split here, as they load)
            train_rows, val_rows = validation_rows(len(train), d.val_fraction, cfg.trainer.seed)
            train, val = train.select(train_rows), train.select(val_rows)
        if held_out:
            log(f"validation: {len(val)} of {len(train) + len(val)} {cls.sample_name} held out "
                f"(data.val_fraction={d.val_fraction}); data.val_source=FILE gives a set of its "
                "own")
        task = cls(cfg, encoded.tokenizer, train, val, tokenizer_dir,
                   data_fingerprint=encoded.fingerprint, **encoded.task_fields)
        task.attach(env, log)
        task.arrange(log)
        if task.lora:
            log(task.lora_line())
        return task

    def attach(self, env: DistEnv, log: Callable[[str], None]) -> None:
        """Columns joined to the examples once they are encoded, before packing (DPO: the
        precomputed reference's log-probs)."""

    def arrange(self, log: Callable[[str], None]) -> None:
        """data.pack=true: the examples into rows of data.max_length tokens (data/packing.py),
        made here from the lengths and the seed, before the data is dealt to workers, so 1 and N
        workers train the same rows. Then the share of computed tokens that are pads, said in
        the log (with what cuts it) and kept for summary.json."""
        from ..data.packing import PackedRows, padding_line, padding_share
        if self.train_ds is None:
            return
        seed = self.cfg.trainer.seed
        lengths = self.token_lengths(self.train_ds)  # (N,), None: not a padded sequence task
        if lengths is None:
            if self.cfg.data.group_by_length:
                raise ConfigError(f"data.group_by_length=true: data.format="
                                  f"{self.cfg.data.format}'s samples have no one length to "
                                  "group by; leave it false")
            return
        if self.cfg.data.pack:
            capacity = self.row_capacity()
            self.train_ds = PackedRows(self.train_ds, lengths, capacity, seed)
            log(self.train_ds.describe(self.sample_name, self.row_capacity_key))
            if self.val_ds is not None:
                self.val_ds = PackedRows(self.val_ds, self.token_lengths(self.val_ds), capacity,
                                         seed)
            self.sample_name = f"packed rows (~{capacity} tokens)"  # what a batch counts
            lengths = self.train_ds.fill  # (R,)
        self.padding_share = padding_share(lengths, self.cfg.trainer.batch_size, seed,
                                           grouped=self.cfg.data.group_by_length)
        line = padding_line(self.padding_share, self.cfg.data.pack)
        if line:
            log(line)

    def sample_lengths(self) -> Any:
        """(N,) each training sample's tokens (a packed row's fill): data.group_by_length's key."""
        return self.train_ds.fill if self.cfg.data.pack else self.token_lengths(self.train_ds)

    @classmethod
    def token_lengths(cls, ds: Any) -> Any:
        """(N,) the tokens each sample puts in a row: packing's sizes, the padding estimate,
        data.group_by_length's key; None for samples that are not one padded sequence."""
        from ..data.examples import FinetuneDataset
        if not isinstance(ds, FinetuneDataset):
            return None
        return ds.lengths if ds.rows is None else ds.lengths[ds.rows]

    def row_capacity(self) -> int:
        """Tokens per packed row: data.max_length (the model's positions when unset)."""
        return int(self.cfg.max_length)

    @classmethod
    def without_data(cls, cfg: TrainConfig, model_info: dict) -> "PretrainedTask":
        """The task of a run, without its records: enough to build its model and save it
        (`paratrain checkpoint export` of a snapshot). `model_info`: what the run's snapshots
        recorded of its model (`model_info`)."""
        from ..data.hf_tokenizer import load_tokenizer
        quiet_transformers()
        tokenizer_dir = Path(resolve_tokenizer(cfg.data, cfg.model)).expanduser()
        tokenizer, _ = load_tokenizer(tokenizer_dir)
        return cls(cfg, tokenizer, None, None, tokenizer_dir, **cls.recorded_fields(model_info))

    @classmethod
    def recorded_fields(cls, model_info: dict) -> dict:
        """The task's own fields, from what `model_info` recorded (a classifier: its labels)."""
        return {}

    @classmethod
    def encode_records(cls, cfg: TrainConfig, tokenizer_dir: Path, train_src: Any, val_src: Any,
                       names: dict, split: bool = False) -> Encoded:
        """Load the tokenizer, read the records and encode them with the task's encoder
        (`split`: hold out data.val_fraction of the examples here, when there are no validation
        records; the cached path splits at load time instead, with the same rows)."""
        from ..data.examples import split_validation
        from ..data.hf_tokenizer import load_tokenizer
        from ..data.record_formats import to_native
        from ..data.rows import read_rows
        quiet_transformers()
        tokenizer, note = load_tokenizer(tokenizer_dir)
        cls.check_fits(cfg, tokenizer)  # before the data is read: a typo costs a second
        notes = [note] if note else []
        encode = cls.encoder(cfg, tokenizer, notes)
        what = ("train", "validation") if isinstance(train_src, list) else \
            ("data.source", "data.val_source")
        d = cfg.data
        rows = lambda src, w, split: to_native(  # noqa: E731
            read_rows(src, what=w, subset=d.subset, split=split, notes=notes), d.records, w)
        train = encode(rows(train_src, what[0], d.split), names["train"])
        val = encode(rows(val_src, what[1], d.val_split), names["val"]) \
            if val_src is not None else None
        if val is None and split and cfg.data.val_fraction > 0:  # uncached: split the examples
            train, val = split_validation(train, cfg.data.val_fraction, seed=cfg.trainer.seed)
        return Encoded(cls.dataset(train), cls.dataset(val) if val else None, notes,
                       encode.task_fields(), tokenizer)

    @classmethod
    def dataset(cls, examples: list) -> Any:
        """The map-style dataset over the encoder's examples (preference pairs have their own)."""
        from ..data.examples import FinetuneDataset
        return FinetuneDataset(examples)

    @classmethod
    def encoder(cls, cfg: TrainConfig, tokenizer: Any, notes: list) -> Encoder:
        """The task's encoder; it appends one note per source it encodes."""
        raise NotImplementedError

    @classmethod
    def check_model(cls, cfg: TrainConfig) -> None:
        """Refuse, in one line, a model.path this task cannot train (before any encoding)."""

    @classmethod
    def check_fits(cls, cfg: TrainConfig, tokenizer: Any) -> None:
        """Before the data is read: the tokenizer's ids fit the model's embeddings, and every
        LoRA target names a module (on a meta-device copy: nothing loaded)."""
        check_embeddings(cfg, len(tokenizer))
        if cfg.model.lora.r:
            from .lora import check_targets
            model = cls.meta_model(cfg)
            if model is not None:
                check_targets(model, cfg.model.lora)

    @classmethod
    def meta_model(cls, cfg: TrainConfig, **config_changes: Any) -> Optional[nn.Module]:
        """The model's shape on the meta device (no weights read, no memory), for checks before
        a worker starts; None when transformers cannot build it (loading then says why)."""
        import transformers
        try:
            config = hf_config(cfg.model.path, cfg.model.trust_remote_code, **config_changes)
            with torch.device("meta"):
                return getattr(transformers, cls.auto_class).from_config(
                    config, **remote_code(cfg.model.trust_remote_code))
        except (OSError, ValueError):
            return None

    def lora_line(self) -> str:
        """Which modules get adapters and how many parameters train (one log line)."""
        from .lora import apply_lora, describe_lora
        model = self.meta_model(self.cfg, **self.head_config())
        if model is None:
            return f"LoRA: r={self.cfg.model.lora.r} on {self.cfg.model.lora.target_modules}"
        return describe_lora(apply_lora(model, self.cfg.model.lora, self.lora_task_type))

    def head_config(self) -> dict:
        """Config changes the task's model is built with (a classifier: its labels)."""
        return {}

    def load_pretrained(self) -> nn.Module:
        """The pretrained model, loaded with the task's transformers auto class."""
        raise NotImplementedError

    @property
    def collate(self) -> Callable[[list], Any]:
        from ..data.examples import PadCollate
        from ..data.packing import PackCollate
        if self.cfg.data.pack:
            return PackCollate(self.tokenizer.pad_token_id)
        return PadCollate(self.tokenizer.pad_token_id)

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora.r > 0

    def build_model(self) -> nn.Module:
        """The pretrained model (with LoRA adapters and its base frozen, when asked; with NEFTune
        noise on its input embeddings while training, when trainer.neftune_noise_alpha)."""
        from .lora import apply_lora
        quiet_transformers()
        model = self.load_pretrained()
        if self.cfg.data.pack:  # packed rows: the model must keep examples apart (or be refused)
            from ..models.hf import check_packed_attention, use_packed_attention
            use_packed_attention(model)
            check_packed_attention(model)
        body = model.base_model  # the decoder the position ids reach (peft wraps the model)
        if self.lora:
            model = apply_lora(model, self.cfg.model.lora, task_type=self.lora_task_type)
        alpha = self.cfg.trainer.neftune_noise_alpha
        if alpha and self.cfg.data.pack:  # each example's own length bounds its noise
            PackedNEFTune(alpha).attach(body, model.get_input_embeddings())
        elif alpha:
            model.get_input_embeddings().register_forward_hook(partial(neftune_noise, alpha))
        return model

    def full_precision_model(self) -> nn.Module:
        """A quantized run's model with its base in full precision, as model.path holds it: what
        its trained adapters are merged onto for model/ (a merge onto 4-bit weights would
        round the sum to 4 bits again)."""
        from ..models.hf import HFArgs, build_hf
        from .lora import apply_lora
        base = build_hf(HFArgs.of(self.cfg.model, len(self.tokenizer),
                                  auto_class=self.auto_class, quantized=False))
        return apply_lora(base, self.cfg.model.lora, task_type=self.lora_task_type)

    def describe(self, n_params: int) -> str:
        return (f"model hf ({self.cfg.model.path}): {human_count(n_params)} parameters; "
                f"tokenizer {self.tokenizer_dir} ({len(self.tokenizer)} tokens)")

    def shortage_message(self, global_batch: int) -> str:
        return (f"{self.cfg.data.source!r} gives {len(self.train_ds)} training "
                f"{self.sample_name}, fewer than one global batch of {global_batch} "
                "(trainer.batch_size x workers x accumulation); use more records or a smaller "
                "batch")

    @property
    def model_info(self) -> dict:
        return {"arch": "hf", "path": self.cfg.model.path, "format": self.cfg.data.format,
                "objective": self.cfg.task_spec.objective}  # the registry's, decided once

    def memory_probe(self) -> Optional[MemoryProbe]:
        return None

    @property
    def tokenizer_path(self) -> Optional[Path]:
        path = self.tokenizer_dir / TOKENIZER_FILE
        return path if path.is_file() else None

    def save(self, model: nn.Module, out_dir: Path, state: dict) -> None:
        """A `from_pretrained` folder (safetensors) with the tokenizer's files copied as they
        are, written atomically like every output; with LoRA, the merged model there and the
        adapter alone in adapter/ next to it."""
        if self.lora:
            from .lora import ADAPTER_DIR
            if self.cfg.model.quantize:  # the adapters merged onto the full-precision base
                fresh = self.full_precision_model()
                fresh.load_state_dict({k: v for k, v in state.items() if ".lora_" in k},
                                      strict=False)
            else:
                fresh = self.build_model()  # a CPU PeftModel of the same shape, for the state
                fresh.load_state_dict(state)
            self.save_lora(fresh, merged=out_dir, adapter=out_dir.parent / ADAPTER_DIR)
            return
        with atomic_dir(out_dir) as tmp:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
            self.add_files(tmp)

    def save_lora(self, model: nn.Module, *, merged: Optional[Path],
                  adapter: Optional[Path]) -> None:
        """A LoRA run's outputs from `model` (a CPU PeftModel holding the weights): the merged
        `from_pretrained` folder and/or the adapter alone (peft's), each with add_files."""
        from .lora import save_lora
        save_lora(model, merged, adapter, self.add_files)

    def add_files(self, folder: Path) -> None:
        """What goes next to the weights: the tokenizer's files, as they are but for a class
        name transformers 4.x does not know, and a config.json 4.x reads too."""
        copy_tokenizer_files(self.tokenizer_dir, folder)
        make_portable(folder)
        if self.cfg.data.pack:  # training switched the cache off (packed rows); generation wants it
            restore_use_cache(folder, self.cfg.model.path)


def record_sources(cfg: TrainConfig, records: Optional[TaskRecords]) -> tuple[Any, Any]:
    """(training records, validation records or None): the Python API's lists, else the paths
    data.source and data.val_source."""
    if records is not None:
        return records.train, records.val
    d = cfg.data
    if d.source == "stdlib":
        raise ConfigError(f"data.format={d.format} needs data.source: a .jsonl, .parquet or .csv "
                          "file (or a datasets folder) of records")
    return d.source, d.val_source or None


def restore_use_cache(folder: Path, base: Any) -> None:
    """config.json's use_cache as the base model's (packed training turned it off)."""
    import json

    from ..config.model_folder import model_config
    from ..fileio import atomic_write_text
    path = folder / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    config["use_cache"] = model_config(base).get("use_cache", True)
    atomic_write_text(path, json.dumps(config, indent=2) + "\n")
