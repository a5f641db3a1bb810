"""The task registry: what each `data.format` trains, in one table.

Every question that depends on the format is answered here, once: which Task class prepares it
(imported only when a run needs it, so config checks and `--help` stay free of torch), whether
it fine-tunes a pretrained Hugging Face model, the record fields the Python API recognises, the
config checks of its own, and what `paratrain generate` does with a finished run. Nothing else
compares `data.format` to a string.

Adding a task is one module (its Task class) plus one `register(TaskSpec(...))` line below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import ConfigError


@dataclass(frozen=True)
class TaskSpec:
    """One registered task. `task` and `generate` are "module:attribute" paths, imported on use."""
    name: str  # the data.format value
    task: str  # the Task class: a classmethod `prepare(cfg, env, records, say)` builds it
    summary: str  # one line for listings and errors
    pretrained: bool = False  # fine-tunes model.path (model.arch=hf) with its own tokenizer
    packed: bool = False  # a corpus cut into full windows (no pads): every token counts
    record_fields: tuple[str, ...] = ()  # fields of its records (the Python API's lists)
    checks: tuple[Callable[[Any], None], ...] = field(default=())  # on a TrainConfig
    generate: str = "paratrain.models.generate:generate_from_run"  # (model_dir, prompt, opts)

    def load(self) -> Any:
        """The Task class."""
        return _resolve(self.task)

    def generator(self) -> Callable[..., str]:
        """What `paratrain generate` calls: (model_dir, prompt, GenerateOptions) -> text."""
        return _resolve(self.generate)


_TASKS: dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> TaskSpec:
    if spec.name in _TASKS:
        raise ValueError(f"a task named {spec.name!r} is registered already")
    _TASKS[spec.name] = spec
    return spec


def names(pretrained: Optional[bool] = None) -> tuple[str, ...]:
    """Registered names in registration order (only those that do / do not fine-tune)."""
    return tuple(n for n, s in _TASKS.items() if pretrained is None or s.pretrained == pretrained)


def get(name: str, key: str = "data.format") -> TaskSpec:
    """The spec of `name`, or one ConfigError line listing what is registered."""
    spec = _TASKS.get(name)
    if spec is None:
        raise ConfigError(f"{key}={name!r} is not one of: {', '.join(_TASKS)}")
    return spec


DEFAULT_RECORDS = "pairs"  # what the Python API's records are when nothing else matches


def recognize(record: dict) -> TaskSpec:
    """The fine-tuning task whose fields a record carries (Trainer(model=DIR, train_data=[...])),
    in registration order; pairs when no other matches (its encoder names what is missing)."""
    for spec in _TASKS.values():
        if spec.pretrained and spec.name != DEFAULT_RECORDS and spec.record_fields and \
                set(spec.record_fields) <= set(record):
            return spec
    return _TASKS[DEFAULT_RECORDS]


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_classify(cfg: Any) -> None:
    d = cfg.data
    if not (d.text_field and d.label_field):
        raise ConfigError("data.format=classify needs data.text_field and data.label_field, the "
                          "names of the text and label fields of the records")


register(TaskSpec(
    "packed", "paratrain.tasks.lm:LMTask", packed=True,
    summary="a language model on a corpus cut into full windows of data.seq_length tokens"))
register(TaskSpec(
    "padded", "paratrain.tasks.lm:LMTask",
    summary="a language model on a corpus, one document per padded row"))
register(TaskSpec(
    "pairs", "paratrain.tasks.causal_lm:PairsTask", pretrained=True,
    record_fields=("input", "output"), generate="paratrain.models.hf:generate_hf_reply",
    summary="a pretrained causal LM on input->output pairs, the loss on the outputs"))
register(TaskSpec(
    "chat", "paratrain.tasks.causal_lm:ChatTask", pretrained=True,
    record_fields=("messages",), generate="paratrain.models.hf:generate_hf_chat",
    summary="a pretrained causal LM on conversations, the loss on the assistant turns"))
register(TaskSpec(
    "classify", "paratrain.tasks.classify:ClassifyTask", pretrained=True,
    record_fields=("text", "label"), checks=(_check_classify,),
    generate="paratrain.tasks.classify:generate_label",
    summary="a pretrained model with a sequence-classification head on labelled texts"))
