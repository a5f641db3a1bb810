"""Trainer()'s keyword arguments as config overrides: a value written as OmegaConf's dotlist
reads it back, and the line for a keyword Trainer does not take (Hugging Face's spellings and
the keys of other sections named with the overrides= spelling that works)."""

from __future__ import annotations

from typing import Any

from .tree import TrainConfig


# Hugging Face TrainingArguments' names for what Trainer() takes under its own
_HF_NAMES = {"learning_rate": "lr", "num_train_epochs": "epochs", "max_grad_norm": "grad_clip",
             "per_device_train_batch_size": "batch_size", "output_dir": "run_dir",
             "overwrite_output_dir": "overwrite", "lr_scheduler_type": "schedule",
             "optim": "optimizer"}


def unknown_keyword(name: str, value: Any, known: list[str]) -> str:
    """The line for a keyword Trainer does not take; when it names a key of another section
    (lora= is model.lora.r, pack= is data.pack), the overrides= spelling that works."""
    import difflib

    from ..formatting import flatten
    keys = flatten(TrainConfig().to_dict())
    ours = _HF_NAMES.get(name) or next(iter(difflib.get_close_matches(name, known, 1, 0.8)), None)
    if ours in known:
        return (f"Trainer() got an unknown argument {name!r}; did you mean {ours}=? it takes "
                f"trainer and optim keys by name: {', '.join(known)}")
    dotted = [k for k in keys if k.endswith("." + name)] or \
        [f"{k.rsplit('.', 1)[0]}.r" for k in keys if k.endswith(f".{name}.r")]
    hint = (f"; it is the config key {dotted[0]}: pass overrides=[\"{dotted[0]}="
            f"{dot_value(value)}\"]" if dotted else "")
    return (f"Trainer() got an unknown argument {name!r}{hint}; it takes trainer and optim keys "
            f"by name: {', '.join(known)}")


def dot_value(v: Any) -> str:
    """A Python value as OmegaConf's dotlist parser reads it back."""
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(dot_value(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)
