"""The configuration tree: `TrainConfig`, the sections of sections.py read from defaults, YAML
and dotted overrides, checked by OmegaConf.

Every check that can fail without starting a process runs when a config is built (the checks:
checks.py; devices: `launch.parse_devices`), so that a typo costs a second, not a launch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..errors import ConfigError
from ..formatting import first_line
from ..redact import redact_secrets
from .checks import validate
from .formats import resolve_format
from .hub import pin_sources
from .model_folder import resolve_models
from .defaults import default_run_name, resolve_max_length, resolve_tokenizer
from .docs import suggest_key, unknown_key_message
from .registry import TaskSpec, for_config
from .embedding import EmbeddingConfig
from .preference import DPOConfig, KTOConfig, ORPOConfig, SimPOConfig
from .rl import RLConfig
from .data_section import DataConfig
from .sections import (
    CheckpointConfig,
    DistributedConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    PlanConfig,
    RunConfig,
    TrainerConfig,
)


def _quote_node_range(text: str, key: str) -> str:
    """YAML 1.1 reads an unquoted 2:3 as the base-60 number 123: quote a node range first."""
    return re.sub(key + r"(\d+:\d+)[ \t]*$", r"\g<1>'\g<2>'", text, flags=re.MULTILINE)


@dataclass
class TrainConfig:
    """The whole configuration: YAML sections and dotted `key=value` overrides."""
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
    orpo: ORPOConfig = field(default_factory=ORPOConfig)
    simpo: SimPOConfig = field(default_factory=SimPOConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    log: LogConfig = field(default_factory=LogConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    # What data.format=auto chose and why (logged when the run starts); not a key: config.yaml
    # records the decided data.format itself.
    format_line: ClassVar[Optional[str]] = None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: Optional[str | os.PathLike] = None,
                  overrides: Sequence[str] = ()) -> "TrainConfig":
        """Defaults, then the YAML file, then `key=value` overrides; validated."""
        layers = []
        if path is not None:
            p = Path(path)
            if not p.is_file():
                key = suggest_key(TrainConfig, str(path)) if p.suffix not in (".yaml", ".yml") \
                    else None
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
        pin_sources(cfg)  # Hub datasets pinned to their commit, once, from the cache
        cfg.format_line = resolve_format(cfg)  # data.format=auto decided once, from the records
        if _epochs_set_last(layers):  # decided here, once: config.yaml shows max_steps: null
            cfg.trainer.max_steps = None
        if cfg.run.name is None:  # decided here, once: config.yaml shows it
            cfg.run.name = default_run_name(cfg)
        resolve_models(cfg)  # Hub ids -> cached snapshot folders, once, before the checks
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

    def to_yaml(self, redact: bool = True, record_task: bool = False) -> str:
        """`record_task`: trainer.objective as the task decided it (auto resolved), as a run's
        config.yaml records it, so that `paratrain generate` reads the task instead of deciding
        it again."""
        d = self.to_dict()
        if record_task:
            d["trainer"]["objective"] = self.task_spec.objective
        return OmegaConf.to_yaml(redact_secrets(d) if redact else d)

    # ---- derived values -----------------------------------------------------------------
    @cached_property
    def task_spec(self) -> TaskSpec:
        """The task this config trains (data.format, trainer.objective and model.path's kind:
        `registry.for_config`), decided once, when the config is built and checked, and carried
        with it: pickled to the workers with the config, read by the forkserver, the memory plan
        and export, never asked of the registry again."""
        return for_config(self)

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
        """data.max_length, or the model's own limit when unset (defaults.py)."""
        return resolve_max_length(self.data, self.model)

    @property
    def cache_dir(self) -> Path:
        if self.data.cache_dir:
            return Path(self.data.cache_dir).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return Path(base) / "paratrain"


_WANTED = {"bool": "true or false", "boolean": "true or false", "int": "a whole number",
           "integer": "a whole number", "float": "a number", "str": "text", "string": "text"}


def _epochs_set_last(layers: Sequence[Any]) -> bool:
    """Whether the last layer that sets trainer.epochs or trainer.max_steps sets epochs alone:
    the epochs a user wrote then win over max_steps' default (200), instead of being ignored
    without a word. Both in one layer: max_steps decides, as documented."""
    for layer in reversed(layers):
        trainer = layer.get("trainer") if isinstance(layer, DictConfig) else None
        keys = set(trainer.keys()) if isinstance(trainer, DictConfig) else set()
        if "max_steps" in keys:
            return False
        if "epochs" in keys:
            return True
    return False


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    """OmegaConf's messages are multi-line; keep the key and the fix on one line."""
    key = getattr(e, "full_key", None) or ""
    msg = first_line(e)
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return unknown_key_message(TrainConfig, key)
    if key == "trainer.epochs" and "Incompatible value 'None'" in msg:
        return ("trainer.epochs cannot be null: to train by epochs pass trainer.max_steps=null "
                "trainer.epochs=N; to train by steps set trainer.max_steps=N (epochs is then "
                "unused)")
    if "Incompatible value 'None'" in msg:
        return (f"{key} cannot be null; give it a value (`paratrain config show --all` lists "
                "defaults)")
    if "Value '" in msg and ("could not be converted" in msg or "is not a valid" in msg):
        value = getattr(e, "value", None)
        kind = re.search(r"(?:is not a valid|converted to) (\w+)", msg)
        wanted = _WANTED.get(kind.group(1).lower() if kind else "", "a value of another type")
        return f"{key}={value!r} is not {wanted}; `paratrain config show` lists each key's default"
    return f"{key}: {msg}" if key else msg
