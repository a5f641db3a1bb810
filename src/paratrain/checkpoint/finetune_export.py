"""`paratrain checkpoint export` of a fine-tuning snapshot (model.arch=hf: full fine-tuning or
LoRA, any registered fine-tuning task): a folder `from_pretrained` loads, written the way the
run's own model/ (and adapter/) are.

The run's task is rebuilt from the snapshot's config without its records (`without_data`), its
model is built from model.path (the base), the snapshot's tensors are loaded into it with
torch.distributed.checkpoint (safe loading: nothing is unpickled; whatever world size and
strategy wrote it), and the task's own save writes the folder (one home for saving):
- full fine-tuning: the whole model, a `from_pretrained` folder;
- LoRA: the adapter alone (`peft.PeftModel.from_pretrained(base, OUT)`), or with `merge` the
  merged weights as a plain `from_pretrained` folder.
Each carries the tokenizer files the snapshot holds (those the run trained with, made readable by
transformers 4.x as model/'s are) and a chat template given as a file.

A LoRA snapshot holds the adapters, not the frozen base (it never changes), so the base must
still be at model.path; `model_path` names where the same base has moved.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Optional

from ..config.hub import resolve_folder
from ..config.tree import TrainConfig
from ..data.tokenizer import TOKENIZER_FILES
from ..errors import CheckpointError, ConfigError
from ..redact import redact_url
from . import integrity
from .export_target import check_out, export_target
from .store import load_model_weights, resolve, split, verify_snapshot


def find(path: str) -> Optional[tuple[str, dict]]:
    """(snapshot url, its marker) when PATH is a committed snapshot of a fine-tuning run, or a
    checkpoints folder / run dir whose newest usable snapshot is one; None otherwise (the
    other exports apply, and say what is wrong with PATH)."""
    try:
        url = resolve(path)
    except CheckpointError:
        return None
    store, _ = split(url)
    marker = store.marker(url)
    if marker and (marker.get("model") or {}).get("arch") == "hf":
        return url, marker
    return None


def export_finetuned(url: str, marker: dict, out: str | Path, *, merge: bool = False,
                     model_path: Optional[str] = None, overwrite: bool = False) -> Path:
    """Write OUT from the fine-tuning snapshot at `url` (see the module docstring). Every
    refusal is one ConfigError / CheckpointError line, before anything is written."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ..parallel.precision import prepare_model
    from .snapshot_state import state_options
    out = Path(out)
    config = marker.get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"snapshot {redact_url(url)!r} records no config; it cannot be "
                              "exported")
    base = model_path or (config.get("model") or {}).get("path")
    # a Hub id (--model-path org/name) or a cache snapshot from another machine: the local folder
    base = resolve_folder(base, None, "--model-path" if model_path else "model.path")
    _check_base(url, base, given=model_path is not None)
    _check_out(out, base, overwrite)
    store, _ = split(url)
    with tempfile.TemporaryDirectory() as tok:
        # the tokenizer the run trained with, as the snapshot carries it (model.path's may differ)
        carried = [n for n in TOKENIZER_FILES if store.get_file(url, n, Path(tok) / n)]
        data = dict(config.get("data") or {}, **({"tokenizer": tok} if carried else {}))
        # the snapshot holds the adapters alone: a quantized run's base is rebuilt in full
        # precision, so that the merge is onto the weights model.path holds
        cfg = TrainConfig.from_dict({**config, "model": {**config["model"], "path": str(base),
                                                         "quantize": None}, "data": data})
        if merge and not cfg.model.lora.r:
            raise ConfigError(f"--merge applies to LoRA snapshots; {redact_url(url)} is a full "
                              "fine-tune, whose export is the whole model already (leave --merge "
                              "out)")
        template = cfg.data.chat_template
        if template not in ("auto", "none") and not Path(template).expanduser().is_file():
            raise ConfigError(f"the run's chat template data.chat_template={template!r} is gone; "
                              "the export carries it as the run's model/ does: put it back")
        verify_snapshot(url)  # every file, the tokenizer's too, before any is used
        task = cfg.task_spec.load().without_data(cfg, marker["model"])
        torch.manual_seed(cfg.trainer.seed)  # as the run built it (the snapshot fills it all)
        model = prepare_model(task.build_model(), marker.get("precision") or "fp32")
        options = state_options(model)
        weights = get_model_state_dict(model, options=options)
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            weights = load_model_weights(url, weights, verified=True)
        except (CheckpointException, RuntimeError, ValueError) as e:  # (DCP's: BaseException)
            raise CheckpointError(
                f"snapshot {redact_url(url)} does not fit the model built from model.path="
                f"{str(base)!r} ({integrity.cause_line(e)[:300]}); pass the base model the run "
                "fine-tuned") from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            set_model_state_dict(model, weights, options=options)
        with export_target(out, overwrite=overwrite, source=_local(base)) as target:
            if task.lora:
                task.save_lora(model, merged=target if merge else None,
                               adapter=None if merge else target)
            else:
                task.save(model, target,
                          {k: v.detach().cpu() for k, v in model.state_dict().items()})
    return out


def _check_base(url: str, base: Optional[str], given: bool) -> None:
    """The base model (model.path, or --model-path) is still a model folder."""
    p = Path(str(base)).expanduser()
    if base and ((p / "config.json").is_file() or p.is_file()):
        return
    if given:
        raise ConfigError(f"--model-path {base!r} is not a model folder (no config.json); pass "
                          "the folder of the base model the run fine-tuned")
    raise ConfigError(f"snapshot {redact_url(url)} fine-tuned model.path={base!r}, which is gone "
                      "(no config.json there); the export rebuilds the model from it: put the "
                      "base model back, or pass --model-path DIR where it is now")


def _check_out(out: Path, base: Optional[str], overwrite: bool) -> None:
    if out.suffix == ".safetensors":
        raise ConfigError(f"OUT {str(out)!r}: a fine-tuning snapshot exports to a folder "
                          "(from_pretrained reads it); pass a folder path")
    if base and out.resolve() == Path(str(base)).expanduser().resolve():
        raise ConfigError(f"OUT {str(out)!r} is the base model's folder (model.path); choose "
                          "another folder")
    check_out(out, overwrite=overwrite, source=_local(base))


def _local(base: Optional[str]) -> Optional[Path]:
    return Path(str(base)).expanduser() if base else None
