"""The configuration tree: typed dataclasses checked by OmegaConf, YAML plus dotted overrides.

Every check that can fail without starting a process lives here (or in `launch.parse_devices`),
so that a typo costs a second, not a launch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import ConfigError
from .formatting import first_line
from .models.presets import ARCHS, resolve_model_config
from .redact import redact_secrets

STRATEGIES = ("auto", "single", "ddp", "fsdp", "hsdp", "dp")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
FORMATS = ("packed", "padded", "pairs", "chat", "classify")
FINETUNE_FORMATS = ("pairs", "chat", "classify")  # records encoded with a pretrained tokenizer
TOKENIZERS = ("auto", "bpe", "char")
# Files any one of which makes a folder loadable by transformers' AutoTokenizer.from_pretrained.
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                     "spiece.model", "vocab.txt")
BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class RunConfig:
    name: str = "stdlib-llama"
    dir: Optional[str] = None  # default: runs/<name>
    overwrite: bool = False  # allow writing into a run dir that holds another run


@dataclass
class LoraConfig:
    """LoRA adapters (via peft) on a Hugging Face model: r=0 trains every weight."""
    r: int = 0  # rank of the adapters; 0: off (full fine-tuning)
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: List[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    arch: str = "llama"  # llama | gpt | hf (a local Hugging Face causal LM at model.path)
    path: Optional[str] = None  # hf: a directory with config.json (and optionally weights)
    preset: Optional[str] = "small"  # fills the unset sizes below; see models/presets.py
    hidden_size: Optional[int] = None
    num_layers: Optional[int] = None
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    intermediate_size: Optional[int] = None
    vocab_size: Optional[int] = None  # default: the tokenizer's
    max_seq_length: Optional[int] = None  # default: data.seq_length
    tie_embeddings: Optional[bool] = None
    dropout: float = 0.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    lora: LoraConfig = field(default_factory=LoraConfig)  # hf models: adapters instead of weights


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | file | directory | glob | *.jsonl | *.parquet
    text_field: str = "text"  # jsonl / parquet corpora; classify: the text to label
    label_field: str = "label"  # classify: the label (strings: ids in sorted order; or ints)
    seq_length: int = 256
    vocab_size: int = 4096  # BPE vocabulary to train
    tokenizer: str = "auto"  # auto: model.path's own for model.arch=hf, else bpe | bpe | char
    # (trained on the corpus) | DIR: a pretrained tokenizer; see resolve_tokenizer
    format: str = "packed"  # packed | padded | pairs (input->output) | chat (messages) |
    # classify (text -> label, a sequence-classification model)
    pack: bool = False  # pairs / chat: several examples per row (refused: see _check_data_format)
    padded_overflow: str = "truncate"  # padded: a document longer than seq_length is cut to
    # one row (truncate: the rest is dropped) or continues in as many rows as it needs (split)
    input_field: str = "input"  # pairs: the prompt's field (jsonl / parquet / csv / datasets)
    output_field: str = "output"  # pairs: the answer's field; the loss counts only its tokens
    messages_field: str = "messages"  # chat: [{role, content}, ...]; loss on assistant turns
    val_source: Optional[str] = None  # pairs / chat: a validation file (else val_fraction)
    max_length: int = 1024  # pairs / chat: tokens per example (the input is cut from the left)
    chat_template: str = "auto"  # auto (the tokenizer's, if any) | none | PATH to a jinja file
    system_prompt: Optional[str] = None  # pairs / chat rendered with a chat template
    val_fraction: float = 0.02
    max_bytes: Optional[int] = None  # read at most this much text (documents in sorted order)
    cache_dir: Optional[str] = None  # default: $XDG_CACHE_HOME/paratrain or ~/.cache/paratrain
    num_workers: int = 0  # DataLoader worker processes per rank


@dataclass
class TrainerConfig:
    devices: Any = "auto"  # auto | cpu:N | [0, 1] | cuda:0,1 | cuda | cpu
    strategy: str = "auto"
    precision: str = "fp32"
    batch_size: int = 8  # per device, per micro-step
    global_batch_size: Optional[int] = None  # derive gradient accumulation from this
    max_steps: Optional[int] = 200
    epochs: int = 1  # used when max_steps is null
    seed: int = 1337
    log_every: int = 10
    eval_every: int = 100
    eval_samples: Optional[int] = None  # evaluate on the first N validation windows (null: all)
    verbose: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    cpu_offload: bool = False  # fsdp: keep parameters, gradients and optimizer state in RAM
    reshard_after_forward: bool = True  # fsdp: free full parameters after forward (less memory)
    shard_group_size: Optional[int] = None  # hsdp: ranks per shard group (null: those of a node)
    progress_bar: bool = True
    early_stopping_patience: Optional[int] = None  # stop after N evaluations without improvement
    early_stopping_threshold: float = 0.0  # an improvement lowers the validation loss by more
    keep_best: bool = False  # the output is the weights of the best evaluation, not the last


@dataclass
class OptimConfig:
    lr: float = 2e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8
    warmup_steps: int = 20
    min_lr: float = 2e-4
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <run.dir>/checkpoints
    every_steps: int = 0  # 0: none; N: a snapshot after every N optimizer steps
    at_epoch_end: bool = False  # also one after each epoch's last step (every_steps=0: only then)
    keep_last: int = 2
    resume: str = "auto"  # auto | never | a snapshot folder (step-NNNNNNN)
    async_save: bool = True  # write in the background; false: the loop waits for the write
    record_samples: bool = False  # test aid: samples.jsonl lists each step's sample ids


@dataclass
class DistributedConfig:
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node only)
    nnodes: Any = 1  # N nodes, or MIN:MAX for elastic membership (torch's c10d rendezvous)
    node_rank: int = 0
    timeout_s: float = 300.0
    max_restarts: int = 0
    backend: str = "auto"
    rdzv: str = "static"  # static: node_rank fixes the order; c10d: torch's dynamic rendezvous
    requeue: bool = False  # under Slurm: after a stop signal's snapshot, scontrol requeue the job

    @property
    def min_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        """nnodes=MIN:MAX with MIN < MAX: nodes may leave and join (the job re-forms)."""
        low, high = parse_nnodes(self.nnodes)
        return low < high


def _quote_node_range(text: str, key: str) -> str:
    """YAML 1.1 reads an unquoted 2:3 as the base-60 number 123: quote a node range first."""
    return re.sub(key + r"(\d+:\d+)[ \t]*$", r"\g<1>'\g<2>'", text, flags=re.MULTILINE)


def parse_nnodes(value: Any) -> tuple[int, int]:
    """`distributed.nnodes` as (MIN, MAX): N is (N, N); "MIN:MAX" is an elastic range."""
    text = str(value).strip()
    m = re.fullmatch(r"(-?\d+)(?::(-?\d+))?", text)
    if m is None or isinstance(value, bool):
        raise ConfigError(f"distributed.nnodes={value!r} must be a number of nodes N or a range "
                          "MIN:MAX (for example 2:4)")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1:
        raise ConfigError(f"distributed.nnodes={text}: the number of nodes must be at least 1")
    if low > high:
        raise ConfigError(f"distributed.nnodes={text}: MIN ({low}) is larger than MAX ({high}); "
                          f"write {high}:{low}")
    return low, high


@dataclass
class LogConfig:
    """Run records besides metrics.jsonl; see loggers.py and report.py."""
    tensorboard: Optional[bool] = None  # <run dir>/tensorboard/; null: on when installed
    wandb: bool = False  # Weights & Biases (pip install wandb)
    mlflow: bool = False  # MLflow (pip install mlflow)
    project: Optional[str] = None  # wandb project / mlflow experiment (default: paratrain)
    report: bool = True  # report.png in the run dir at the end (needs matplotlib)


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log: LogConfig = field(default_factory=LogConfig)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: Optional[str | os.PathLike] = None,
                  overrides: Sequence[str] = ()) -> "TrainConfig":
        """Defaults, then the YAML file, then `key=value` overrides; validated."""
        layers = []
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file "
                                  "or no file for the defaults")
            try:
                loaded = OmegaConf.create(_quote_node_range(p.read_text(), r"^(\s*nnodes:\s*)"))
            except Exception as e:  # yaml.YAMLError and friends
                raise ConfigError(f"config file {str(path)!r} is not valid YAML: "
                                  f"{first_line(e)}") from None
            if not isinstance(loaded, DictConfig):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections "
                                  "(run:, model:, data:, trainer:, ...)")
            layers.append(loaded)
        for item in overrides:
            if "=" not in item or item.startswith("="):
                raise ConfigError(f"override {item!r} is not of the form key=value "
                                  "(for example trainer.max_steps=100)")
        if overrides:
            try:
                layers.append(OmegaConf.from_dotlist(
                    [_quote_node_range(o, r"^(distributed\.nnodes=)") for o in overrides]))
            except OmegaConfBaseException as e:
                raise ConfigError(f"cannot parse overrides: {first_line(e)}") from None
        return cls.from_layers(*layers)

    @classmethod
    def from_layers(cls, *layers: Any) -> "TrainConfig":
        schema = OmegaConf.structured(cls)
        try:
            merged = OmegaConf.merge(schema, *layers)
        except OmegaConfBaseException as e:
            raise ConfigError(_omegaconf_message(e)) from None
        cfg = OmegaConf.to_object(merged)
        assert isinstance(cfg, TrainConfig)
        validate(cfg)
        return cfg

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return cls.from_layers(OmegaConf.create(d))

    def with_overrides(self, overrides: Sequence[str]) -> "TrainConfig":
        return TrainConfig.from_layers(OmegaConf.structured(self),
                                       OmegaConf.from_dotlist(list(overrides)))

    def to_dict(self) -> dict:
        return OmegaConf.to_container(OmegaConf.structured(self), resolve=True)  # type: ignore

    def to_yaml(self, redact: bool = True) -> str:
        d = self.to_dict()
        return OmegaConf.to_yaml(redact_secrets(d) if redact else d)

    # ---- derived values -----------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name

    @property
    def corpus_data(self) -> DataConfig:
        """`data` with data.tokenizer resolved (`auto` decided): what a corpus's token cache is
        built from and keyed by."""
        return replace(self.data, tokenizer=resolve_tokenizer(self.data, self.model))

    @property
    def cache_dir(self) -> Path:
        if self.data.cache_dir:
            return Path(self.data.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "paratrain"


def resolve_tokenizer(data: DataConfig, model: Optional[ModelConfig] = None) -> str:
    """What data.tokenizer means, decided here and nowhere else: `bpe`, `char`, or a pretrained
    tokenizer's folder. `auto` (the default) is the model's own tokenizer, model.path's, for
    model.arch=hf (a pretrained model's embeddings are indexed by its own ids: nothing is
    retrained), and a BPE trained on the corpus for a model from scratch (or no model given)."""
    if data.tokenizer != "auto":
        return data.tokenizer
    if model is not None and model.arch == "hf" and model.path:
        return model.path
    return "bpe"


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """The folder holds a tokenizer saved with save_pretrained (one of TOKENIZER_MARKERS)."""
    p = Path(folder).expanduser()
    return p.is_dir() and any((p / name).is_file() for name in TOKENIZER_MARKERS)


def has_weights(folder: str | os.PathLike) -> bool:
    """A Hugging Face model folder with safetensors weights (else it is built from config)."""
    p = Path(folder).expanduser()
    return p.is_dir() and any((p / n).exists() for n in
                              ("model.safetensors", "model.safetensors.index.json"))


def validate(cfg: TrainConfig) -> None:
    """Checks that need no files and no processes. Raises ConfigError naming the key."""
    _choice("model.arch", cfg.model.arch, ARCHS + ("hf",))
    _choice("trainer.strategy", cfg.trainer.strategy, STRATEGIES)
    _choice("trainer.precision", cfg.trainer.precision, PRECISIONS)
    _choice("data.format", cfg.data.format, FORMATS)
    _choice("data.padded_overflow", cfg.data.padded_overflow, ("truncate", "split"))
    _check_data_format(cfg)
    _choice("distributed.backend", cfg.distributed.backend, BACKENDS)
    _choice("distributed.rdzv", cfg.distributed.rdzv, ("static", "c10d"))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", cfg.run.name):
        raise ConfigError(f"run.name={cfg.run.name!r} may hold only letters, digits, '.', '_' "
                          "and '-'")
    positive = {
        "data.seq_length": cfg.data.seq_length, "data.vocab_size": cfg.data.vocab_size,
        "trainer.batch_size": cfg.trainer.batch_size, "trainer.epochs": cfg.trainer.epochs,
        "trainer.log_every": cfg.trainer.log_every, "trainer.eval_every": cfg.trainer.eval_every,
        "distributed.timeout_s": cfg.distributed.timeout_s,
    }
    optional_positive = {
        "trainer.max_steps": cfg.trainer.max_steps,
        "trainer.global_batch_size": cfg.trainer.global_batch_size,
        "trainer.eval_samples": cfg.trainer.eval_samples,
        "trainer.early_stopping_patience": cfg.trainer.early_stopping_patience,
        "trainer.shard_group_size": cfg.trainer.shard_group_size,
        "data.max_bytes": cfg.data.max_bytes,
        "model.hidden_size": cfg.model.hidden_size, "model.num_layers": cfg.model.num_layers,
        "model.num_heads": cfg.model.num_heads, "model.num_kv_heads": cfg.model.num_kv_heads,
        "model.intermediate_size": cfg.model.intermediate_size,
        "model.vocab_size": cfg.model.vocab_size, "model.max_seq_length": cfg.model.max_seq_length,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    for key, value in optional_positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be positive (or null for the default)")
    if cfg.trainer.shard_group_size is not None and cfg.trainer.strategy not in ("hsdp", "auto"):
        raise ConfigError(f"trainer.shard_group_size sizes hsdp's shard groups; it does not "
                          f"apply to trainer.strategy={cfg.trainer.strategy} (use hsdp, or "
                          "leave it null)")
    if not 0.0 <= cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must be in [0, 1)")
    if not 0.0 <= cfg.model.dropout < 1.0:
        raise ConfigError(f"model.dropout={cfg.model.dropout} must be in [0, 1)")
    if resolve_tokenizer(cfg.data, cfg.model) == "bpe" and cfg.data.vocab_size < 260:
        raise ConfigError(f"data.vocab_size={cfg.data.vocab_size} is too small for a byte-level "
                          "BPE tokenizer (256 bytes + special tokens); use at least 260")
    if cfg.data.num_workers < 0:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers} must be >= 0")
    o = cfg.optim
    if o.lr <= 0 or o.min_lr < 0 or o.min_lr > o.lr:
        raise ConfigError(f"optim.lr={o.lr} must be positive and optim.min_lr={o.min_lr} "
                          "between 0 and optim.lr")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    if o.warmup_steps < 0 or o.weight_decay < 0 or o.grad_clip < 0:
        raise ConfigError("optim.warmup_steps, optim.weight_decay and optim.grad_clip "
                          "must be >= 0")
    if cfg.checkpoint.every_steps < 0 or cfg.checkpoint.keep_last < 1:
        raise ConfigError("checkpoint.every_steps must be >= 0 and checkpoint.keep_last >= 1")
    d = cfg.distributed
    parse_nnodes(d.nnodes)
    if not 0 <= d.master_port <= 65535:
        raise ConfigError(f"distributed.master_port={d.master_port} must be in 0..65535")
    if not 0 <= d.node_rank < d.max_nodes:
        raise ConfigError(f"distributed.node_rank={d.node_rank} must be in 0..nnodes-1 "
                          f"(nnodes={d.nnodes})")
    if d.elastic and cfg.trainer.global_batch_size is None:
        raise ConfigError(f"distributed.nnodes={d.nnodes} lets the world size change, so the "
                          "global batch must be fixed: set trainer.global_batch_size (a multiple "
                          "of trainer.batch_size x processes for every node count in the range)")
    if d.max_nodes > 1 and d.master_port == 0:
        raise ConfigError("distributed.master_port must be set (the same on every node) when "
                          "distributed.nnodes > 1")
    if d.max_restarts < 0:
        raise ConfigError(f"distributed.max_restarts={d.max_restarts} must be >= 0")
    if cfg.model.arch == "hf":
        p = cfg.model.path
        if not p or not (Path(p).expanduser() / "config.json").is_file() \
                and not Path(p).expanduser().is_file():
            raise ConfigError(f"model.arch=hf needs model.path, a local directory with a "
                              f"config.json (got {p!r}); nothing is downloaded")
        if cfg.data.format not in FINETUNE_FORMATS:
            _check_hf_corpus_tokenizer(cfg)
        return
    # Model shape checks need the preset applied; models.presets does them (ConfigError too).
    resolve_model_config(cfg.model, vocab_size=cfg.model.vocab_size or cfg.data.vocab_size,
                         seq_length=cfg.data.seq_length)


def _check_data_format(cfg: TrainConfig) -> None:
    """Fine-tuning formats need a pretrained model and its tokenizer; corpora a tokenizer kind."""
    d = cfg.data
    if d.pack:
        raise ConfigError(
            "data.pack=true is refused: packing several examples into one row lets attention "
            "cross from one example into the next unless the model takes a block-diagonal mask "
            "or per-example positions, which paratrain cannot guarantee for a Hugging Face "
            "model; leave data.pack=false (examples are padded to the longest of each "
            "micro-batch, which wastes little) or use data.format=packed for plain text"
            if d.format in FINETUNE_FORMATS else
            f"data.pack applies to data.format=pairs or chat; data.format={d.format} "
            + ("already packs documents into windows" if d.format == "packed" else
               "keeps one document per row"))
    if d.format in FINETUNE_FORMATS:
        if cfg.model.arch != "hf":
            raise ConfigError(f"data.format={d.format} fine-tunes a pretrained Hugging Face "
                              f"model: set model.arch=hf model.path=DIR (got model.arch="
                              f"{cfg.model.arch}); export one of ours with `paratrain "
                              "checkpoint export RUN_DIR OUT --format hf`")
        if d.format == "classify" and not (d.text_field and d.label_field):
            raise ConfigError("data.format=classify needs data.text_field and data.label_field, "
                              "the names of the text and label fields of the records")
        if cfg.model.lora.r < 0 or not cfg.model.lora.target_modules:
            raise ConfigError("model.lora.r must be >= 0 (0: off) and model.lora.target_modules "
                              "a non-empty list of module names")
        if d.max_length < 2:
            raise ConfigError(f"data.max_length={d.max_length} must be at least 2")
        if d.tokenizer != "auto" and not Path(d.tokenizer).expanduser().is_dir():
            raise ConfigError(f"data.tokenizer={d.tokenizer!r}" + (
                " trains a new tokenizer" if d.tokenizer in TOKENIZERS else
                " is not a directory") + f"; data.format={d.format} encodes with the pretrained "
                "model's own tokenizer: leave data.tokenizer unset (auto: model.path's) or pass "
                "a tokenizer folder saved with save_pretrained")
        return
    if cfg.model.lora.r:
        raise ConfigError("model.lora applies to a pretrained Hugging Face model being "
                          "fine-tuned: use model.arch=hf with data.format=pairs, chat or "
                          "classify")
    if d.tokenizer not in TOKENIZERS and not Path(d.tokenizer).expanduser().is_dir():
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not one of: "
                          f"{', '.join(TOKENIZERS)}, or a directory (a pretrained tokenizer "
                          "saved with save_pretrained)")


def _check_hf_corpus_tokenizer(cfg: TrainConfig) -> None:
    """A pretrained model on a corpus reads the ids of its own tokenizer (auto), or of a folder
    given; a tokenizer trained here (bpe) must at least fit in its embeddings."""
    d, path = cfg.data, cfg.model.path
    if d.tokenizer == "auto" and not has_tokenizer(path):
        raise ConfigError(
            f"model.path={path} has no tokenizer ({' / '.join(TOKENIZER_MARKERS[:2])}) and "
            "data.tokenizer=auto uses the model's own; pass data.tokenizer=DIR, the folder of "
            "the tokenizer it was trained with" + (
                "" if has_weights(path) else " (or data.tokenizer=bpe to train one on the "
                "corpus: the folder holds no weights, so nothing pretrained is lost)"))
    if d.tokenizer == "bpe":
        config = Path(path).expanduser()
        config = config / "config.json" if config.is_dir() else config
        try:
            model_vocab = json.loads(config.read_text()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            model_vocab = None  # models.hf says what is wrong with it
        if isinstance(model_vocab, int) and d.vocab_size > model_vocab:
            raise ConfigError(
                f"data.tokenizer=bpe trains a vocabulary of data.vocab_size={d.vocab_size}, more "
                f"than model.path's embeddings hold (vocab_size={model_vocab} in its "
                "config.json); lower data.vocab_size, or leave data.tokenizer unset to use the "
                "model's own tokenizer")


def _choice(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's messages are multi-line; keep the key and the fix on one line."""
    key = getattr(e, "full_key", None) or ""
    msg = first_line(e)
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return f"unknown config key {key!r}; run `paratrain config show` to list the keys"
    if key == "trainer.epochs" and "Incompatible value 'None'" in msg:
        return ("trainer.epochs cannot be null: to train by epochs pass trainer.max_steps=null "
                "trainer.epochs=N; to train by steps set trainer.max_steps=N (epochs is then "
                "unused)")
    if "Incompatible value 'None'" in msg:
        return f"{key} cannot be null; give it a value (`paratrain config show` lists defaults)"
    if "Value '" in msg and ("could not be converted" in msg or "is not a valid" in msg):
        value = getattr(e, "value", None)
        typ = getattr(e, "ref_type", None) or getattr(e, "object_type", None)
        tname = getattr(typ, "__name__", None) or str(typ)
        return f"{key}={value!r} has the wrong type: {msg}" if not tname else \
            f"{key}={value!r} has the wrong type ({msg})"
    return f"{key}: {msg}" if key else msg
