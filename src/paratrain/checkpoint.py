"""The trained model on disk: `model/` = model.safetensors + config.json + tokenizer.json.

Whatever the strategy, the weights are gathered into one full state dict (the torch.distributed
`get_model_state_dict` API knows DDP and FSDP alike), written by global rank 0 into a temporary
folder and renamed into place, so a crash never leaves half a model. Loading uses safetensors,
which holds tensors only: nothing is unpickled from the run dir.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn

from .dist import DistEnv
from .metrics import _umask
from .errors import ParatrainError
from .strategies import unwrap

MODEL_DIR = "model"
WEIGHTS = "model.safetensors"
MODEL_CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def full_state_dict(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full, unsharded CPU tensors on global rank 0 (an empty dict on the other ranks).
    Collective: every rank must call it."""
    if not env.distributed:
        return {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    return sd if env.is_master else {}


def save_model(out_dir: Path, state_dict: dict[str, torch.Tensor], model_args: dict,
               tokenizer_path: Optional[Path]) -> Path:
    """Write `out_dir` atomically (temp folder, then rename). Tied weights are stored once."""
    from safetensors.torch import save_file
    out_dir = Path(out_dir)
    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    if model_args.get("tie_embeddings"):
        tensors = _drop_tied(tensors)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes 0700; a model is for sharing
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt", "producer": "paratrain"})
        (tmp / MODEL_CONFIG).write_text(json.dumps(model_args, indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
        old = out_dir.with_name(f".{out_dir.name}.old")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _drop_tied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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


def load_model(path: str | Path, device: str | torch.device = "cpu") -> Tuple[nn.Module, object]:
    """(model, tokenizer) from a run dir or its model/ folder, ready for generation or for
    further training."""
    from safetensors.torch import load_file

    from .data import Tokenizer
    from .models import ModelArgs, build_model
    mdir = model_dir_of(path)
    args = ModelArgs.from_dict(json.loads((mdir / MODEL_CONFIG).read_text()))
    model = build_model(args)
    state = load_file(str(mdir / WEIGHTS), device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_ok = args.tie_embeddings and all("head" in k for k in missing)
    if unexpected or (missing and not tied_ok):
        raise ParatrainError(f"{mdir / WEIGHTS} does not match {mdir / MODEL_CONFIG}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.to(device).eval()
    tok_path = mdir / TOKENIZER
    tokenizer = Tokenizer.load(tok_path) if tok_path.is_file() else None
    return model, tokenizer
