"""A local Hugging Face causal LM (`model.arch=hf model.path=DIR`): built from its config, loaded
from safetensors only (nothing from the path is unpickled, nothing is downloaded), and saved as a
`from_pretrained` folder."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from torch import nn

from ..data.tokenizer import TOKENIZER_FILE
from ..errors import ConfigError
from ..fileio import atomic_dir


@dataclass(frozen=True)
class HFArgs:
    """`model.arch=hf`: a local Hugging Face causal LM (a directory with config.json, with or
    without weights). Nothing is downloaded: local files only."""
    path: str
    vocab_size: int
    arch: str = "hf"

    def to_dict(self) -> dict:
        return {"arch": self.arch, "path": self.path, "vocab_size": self.vocab_size}


def build_hf(args: HFArgs) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.arch=hf needs the transformers package: "
                          "pip install 'paratrain[hf]'") from None
    p = Path(args.path).expanduser()
    config = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    if getattr(config, "vocab_size", args.vocab_size) < args.vocab_size:
        raise ConfigError(f"model.path={args.path!r} has vocab_size={config.vocab_size}, smaller "
                          f"than the tokenizer's {args.vocab_size}; raise it in config.json or "
                          "lower data.vocab_size")
    weights = p.is_dir() and any((p / n).exists() for n in
                                 ("model.safetensors", "model.safetensors.index.json"))
    if weights:  # safetensors only: nothing from the path is unpickled
        return transformers.AutoModelForCausalLM.from_pretrained(p, local_files_only=True,
                                                                 use_safetensors=True)
    return transformers.AutoModelForCausalLM.from_config(config)


def save_hf(model: nn.Module, out_dir: Path, state: dict, tokenizer_path: Optional[Path]) -> None:
    """A `save_pretrained` folder (safetensors), written atomically like every output."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
