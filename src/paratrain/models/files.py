"""The trained model's files: `model/` = model.safetensors + config.json + tokenizer.json (with a
pretrained tokenizer, `data.tokenizer=DIR`: all its files, byte for byte).

Whatever the parallelism, the weights are gathered into one full state dict
(`Parallelism.full_state_dict`), written by global rank 0 into a temporary folder and renamed
into place, so a crash never leaves half a model. Loading uses safetensors, which holds tensors
only: nothing is unpickled from the run dir. (Training snapshots, which let a run continue, are
checkpoint/snapshotter.py and checkpoint/store.py.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from ..data.tokenizer import TOKENIZER_FILE, tokenizer_files
from ..errors import ParatrainError
from ..fileio import atomic_dir

MODEL_DIR = "model"
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
USER_ARCH = "user"  # model/config.json of a run of the user's own nn.Module


def save_model(out_dir: Path, state_dict: dict[str, torch.Tensor], model_args: dict,
               tokenizer_path: Optional[Path]) -> Path:
    """Write `out_dir` atomically. Tied weights are stored once."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if model_args.get("tie_embeddings"):
        tensors = drop_tied(tensors)
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "paratrain"})
        (tmp / MODEL_CONFIG).write_text(json.dumps(model_args, indent=2) + "\n")
        if tokenizer_path is not None:
            for name, f in tokenizer_files(tokenizer_path).items():
                shutil.copyfile(f, tmp / name)
    return out_dir


def drop_tied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses two names for one storage: keep the first name of each storage."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        if ptr in seen and v.numel() > 0:
            continue
        seen[ptr] = k
        out[k] = v
    return out


def model_dir_of(path: str | Path) -> Path:
    """A run dir or its model/ folder -> the model/ folder."""
    p = Path(path)
    if (p / WEIGHTS).is_file():
        return p
    if (p / MODEL_DIR / WEIGHTS).is_file():
        return p / MODEL_DIR
    raise ParatrainError(f"{str(path)!r} holds no trained model ({MODEL_DIR}/{WEIGHTS}); pass a "
                         "run dir of a finished `paratrain train`")


def model_config(path: str | Path) -> dict:
    """The model/config.json of a run dir or model folder."""
    return json.loads((model_dir_of(path) / MODEL_CONFIG).read_text())


def load_model(path: str | Path, device: str | torch.device = "cpu", *,
               model: Optional[Callable[[], nn.Module]] = None) -> Tuple[nn.Module, object]:
    """(model, tokenizer) from a run dir or its model/ folder, ready for generation or further
    training. A run of your own nn.Module: pass the same factory, `model=make_model`; it is
    called once and the trained weights are loaded into what it returns (tokenizer: None).
    A fine-tuning run (or a Hugging Face model trained on a corpus): the transformers model,
    by the class its config.json names (LoRA: the merged weights; the adapter alone is in
    the run's adapter/ for peft), and its tokenizer."""
    from safetensors.torch import load_file

    from ..data import Tokenizer
    from . import ModelArgs, build_model
    from .hf import is_hf_folder, load_hf
    mdir = model_dir_of(path)
    if is_hf_folder(mdir) and model is None:
        return load_hf(mdir, device)
    info = json.loads((mdir / MODEL_CONFIG).read_text())
    state = load_file(str(mdir / WEIGHTS), device="cpu")
    if model is not None:
        module = model()
        module.load_state_dict(state)
        return module.to(device).eval(), None
    if info.get("arch") == USER_ARCH:
        factory = info.get("factory") or "make_model"
        raise ParatrainError(f"{str(path)!r} holds your own model ({factory}), which paratrain "
                             "cannot rebuild or sample from by itself; load it in Python with "
                             f"`model, _ = load_model({str(path)!r}, model={factory})`, "
                             "passing the same factory you trained with")
    args = ModelArgs.from_dict(info)
    net = build_model(args)
    missing, unexpected = net.load_state_dict(state, strict=False)
    tied_ok = args.tie_embeddings and all("head" in k for k in missing)
    if unexpected or (missing and not tied_ok):
        raise ParatrainError(f"{mdir / WEIGHTS} does not match {mdir / MODEL_CONFIG}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    net.to(device).eval()
    tok_path = mdir / TOKENIZER_FILE
    tokenizer = Tokenizer.load(tok_path) if tok_path.is_file() else None
    return net, tokenizer
