"""The configuration tree: typed dataclasses checked by OmegaConf, YAML plus dotted overrides.

Every check that can fail without starting a process runs when a config is built (the checks:
config_checks.py; devices: `launch.parse_devices`), so that a typo costs a second, not a launch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .config_checks import default_run_name, parse_nnodes, resolve_tokenizer, validate
from .errors import ConfigError
from .formatting import first_line
from .model_folder import resolve_max_length
from .redact import redact_secrets


@dataclass
class RunConfig:
    name: Optional[str] = None  # null: stdlib-llama, or for fine-tuning <model folder>-<format>
    dir: Optional[str] = None  # default: runs/<name>
    overwrite: bool = False  # allow writing into a run dir that holds another run


@dataclass
class LoraConfig:
    """LoRA adapters (via peft) on a Hugging Face model: r=0 trains every weight."""
    r: int = 0  # rank of the adapters; 0: off (full fine-tuning)
    alpha: float = 16.0
    dropout: float = 0.0
    # module names (a bare name is a list of one) or "all-linear"; each name must match a module
    target_modules: Any = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # passed to peft's LoraConfig as they are:
    bias: str = "none"  # none | all | lora_only: which biases are trained
    modules_to_save: Optional[List[str]] = None  # modules trained in full beside the adapters
    use_dora: bool = False  # weight-decomposed LoRA
    use_rslora: bool = False  # scale by alpha/sqrt(r) instead of alpha/r
    init_lora_weights: Any = True  # true | false | gaussian | pissa | olora | loftq | ...
    layers_to_transform: Optional[List[int]] = None  # only these layer indices get adapters


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
    rope_theta: Optional[float] = None  # RoPE base; null: the preset's, else 10000
    norm_eps: float = 1e-5
    init: str = "gpt2"  # llama / gpt: gpt2 (N(0, 0.02), scaled residual projections) | torch
    # (each layer's own default, as a model written with plain nn.Linear / nn.Embedding gets)
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
    prompt_field: str = "prompt"  # preference: the prompt (text, or chat messages)
    chosen_field: str = "chosen"  # preference: the preferred response
    rejected_field: str = "rejected"  # preference: the other response
    margin_field: Optional[str] = None  # preference, reward: a field with each pair's margin
    val_source: Optional[str] = None  # pairs / chat: a validation file (else val_fraction)
    # pairs / chat / classify: tokens per example (pairs: the input is cut from the left); null:
    # the model's max_position_embeddings (see model_folder.resolve_max_length)
    max_length: Optional[int] = None
    chat_template: str = "auto"  # auto (the tokenizer's, if any) | none | PATH to a jinja file
    system_prompt: Optional[str] = None  # pairs / chat rendered with a chat template
    val_fraction: float = 0.02
    max_bytes: Optional[int] = None  # read at most this much text (documents in sorted order)
    cache_dir: Optional[str] = None  # default: $XDG_CACHE_HOME/paratrain or ~/.cache/paratrain
    num_workers: int = 0  # DataLoader worker processes per rank
    shuffle: bool = True  # a new seeded order every epoch; false: the data's own order
    drop_last: bool = True  # false: an epoch's last, short global batch is a step of its own


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
    tensor_parallel: int = 1  # processes of a node that split each layer's matrices (1: off)
    pipeline_parallel: int = 1  # stages: consecutive blocks on different processes (1: off)
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved-1f1b | zero-bubble (the last
    # two: 2 stages per process)
    pipeline_split: Optional[List[int]] = None  # blocks per stage, in order (null: even)
    progress_bar: bool = True
    early_stopping_patience: Optional[int] = None  # stop after N evaluations without improvement
    early_stopping_threshold: float = 0.0  # an improvement lowers the validation loss by more
    keep_best: bool = False  # the output is the weights of the best evaluation, not the last
    label_smoothing: float = 0.0  # token / text cross-entropy while training (not validation)
    neftune_noise_alpha: Optional[float] = None  # fine-tuning: NEFTune noise on the embeddings
    objective: str = "auto"  # what data.format trains: auto (the format's first) | lm | sft |
    # classify | dpo | reward (preference data) | seq2seq (pairs on an encoder-decoder model)


@dataclass
class OptimConfig:
    """The optimizer and the learning-rate schedule (runtime/optim.py)."""
    name: str = "adamw"  # adamw | adafactor | sgd | adamw-8bit (needs bitsandbytes)
    lr: float = 2e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = False  # false: weight decay on matrices only (>= 2-D)
    eps: float = 1e-8
    momentum: float = 0.0  # sgd only
    fused: Optional[bool] = None  # adamw: null: fused on CUDA, foreach elsewhere
    schedule: str = "cosine"  # cosine | linear | constant | wsd (warmup, stable, decay)
    warmup_steps: int = 20
    warmup_ratio: Optional[float] = None  # set: warmup = this fraction of the run's steps
    warmup_start_factor: Optional[float] = None  # warmup from lr x this to lr (torch's
    # LinearLR; 0: HF Trainer's); null: step k of W uses lr x (k+1)/W
    decay_ratio: float = 0.1  # wsd: the fraction of the run's steps spent decaying at the end
    min_lr: Optional[float] = None  # where the decay ends; null: lr / 10
    grad_clip: float = 1.0  # 0 disables clipping

    @property
    def floor_lr(self) -> float:
        """min_lr, or lr / 10 when unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


@dataclass
class DPOConfig:
    """Direct preference optimization (trainer.objective=dpo); see tasks/preference.py."""
    beta: float = 0.1  # how far the policy may move from the reference
    loss: str = "sigmoid"  # sigmoid (the DPO paper) | ipo | hinge
    label_smoothing: float = 0.0  # sigmoid: the assumed share of flipped labels (cDPO)
    reference: Optional[str] = None  # a model folder; default: the policy's start (with LoRA:
    # the policy with its adapters off)
    precompute_reference: bool = False  # reference log-probs once, before training (cached)


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <run.dir>/checkpoints
    every_steps: int = 0  # 0: none; N: a snapshot after every N optimizer steps
    at_epoch_end: bool = False  # also one after each epoch's last step (every_steps=0: only then)
    keep_last: int = 2
    resume: str = "auto"  # auto | never | a snapshot folder (step-NNNNNNN)
    async_save: bool = True  # write in the background; false: the loop waits for the write
    max_failed_saves: int = 3  # snapshots that cannot be written in a row before the run stops
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


@dataclass
class LogConfig:
    """Run records besides metrics.jsonl; see loggers.py and report.py."""
    tensorboard: Optional[bool] = None  # <run dir>/tensorboard/; null: on when installed
    wandb: bool = False  # Weights & Biases (pip install wandb)
    mlflow: bool = False  # MLflow (pip install mlflow)
    project: Optional[str] = None  # wandb project / mlflow experiment (default: paratrain)
    report: bool = True  # report.png in the run dir at the end (needs matplotlib)


@dataclass
class PlanConfig:
    """`paratrain plan`'s target layout, simulated without processes (null: this machine's)."""
    nodes: Optional[int] = None  # nodes in the job
    devices_per_node: Optional[int] = None  # processes (GPUs) per node
    device_memory_gb: Optional[float] = None  # memory of one device, GB (10^9 bytes)


@dataclass
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log: LogConfig = field(default_factory=LogConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: Optional[str | os.PathLike] = None,
                  overrides: Sequence[str] = ()) -> "TrainConfig":
        """Defaults, then the YAML file, then `key=value` overrides; validated."""
        layers = []
        if path is not None:
            p = Path(path)
            if not p.is_file():
                key = suggest_key(str(path)) if p.suffix not in (".yaml", ".yml") else None
                raise ConfigError(
                    f"{str(path)!r} is read as a config file, which does not exist; " +
                    (f"to set {key}, write {key}=VALUE (one word: no spaces around '=')" if key
                     else "pass a YAML file or no file for the defaults"))
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
        if cfg.run.name is None:  # decided here, once: config.yaml shows it
            cfg.run.name = default_run_name(cfg)
        validate(cfg)
        return cfg

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return cls.from_layers(OmegaConf.create(d))

    def with_overrides(self, overrides: Sequence[str]) -> "TrainConfig":
        base = OmegaConf.structured(self)
        if self.run.name == default_run_name(self):  # a derived name follows the new keys
            base.run.name = None
        return TrainConfig.from_layers(base, OmegaConf.from_dotlist(list(overrides)))

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
    def max_length(self) -> int:
        """data.max_length, or the model's own limit when unset (config_checks)."""
        return resolve_max_length(self.data, self.model)

    @property
    def cache_dir(self) -> Path:
        if self.data.cache_dir:
            return Path(self.data.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "paratrain"


def suggest_key(name: str) -> Optional[str]:
    """The config key a misspelt or section-less `name` most likely means ("max_steps" ->
    trainer.max_steps, "trainer.max_step" -> trainer.max_steps), or None."""
    import difflib

    from .formatting import flatten
    keys = list(flatten(TrainConfig().to_dict()))
    if name in keys:
        return name
    ending = [k for k in keys if k.endswith("." + name)]
    if len(ending) == 1:
        return ending[0]
    near = difflib.get_close_matches(name, keys, n=1, cutoff=0.8)
    return near[0] if near else None


_WANTED = {"bool": "true or false", "boolean": "true or false", "int": "a whole number",
           "integer": "a whole number", "float": "a number", "str": "text", "string": "text"}


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's messages are multi-line; keep the key and the fix on one line."""
    key = getattr(e, "full_key", None) or ""
    msg = first_line(e)
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        near = suggest_key(key)
        return (f"unknown config key {key!r}; " + (f"did you mean {near}? " if near else "")
                + "run `paratrain config show` to list the keys")
    if key == "trainer.epochs" and "Incompatible value 'None'" in msg:
        return ("trainer.epochs cannot be null: to train by epochs pass trainer.max_steps=null "
                "trainer.epochs=N; to train by steps set trainer.max_steps=N (epochs is then "
                "unused)")
    if "Incompatible value 'None'" in msg:
        return f"{key} cannot be null; give it a value (`paratrain config show` lists defaults)"
    if "Value '" in msg and ("could not be converted" in msg or "is not a valid" in msg):
        value = getattr(e, "value", None)
        kind = re.search(r"(?:is not a valid|converted to) (\w+)", msg)
        wanted = _WANTED.get(kind.group(1).lower() if kind else "", "a value of another type")
        return f"{key}={value!r} is not {wanted}; `paratrain config show` lists each key's default"
    return f"{key}: {msg}" if key else msg
