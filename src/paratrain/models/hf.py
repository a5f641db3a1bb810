"""A local Hugging Face model (`model.arch=hf model.path=DIR`; a causal LM unless the task loads
it with another auto class): built from its config, loaded from safetensors only (nothing from
the path is unpickled, nothing is downloaded), and saved as a `from_pretrained` folder."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from torch import nn

from ..data.tokenizer import tokenizer_files
from ..errors import ConfigError
from ..fileio import atomic_dir


@dataclass(frozen=True)
class HFArgs:
    """`model.arch=hf`: a local Hugging Face causal LM (a directory with config.json, with or
    without weights). Nothing is downloaded: local files only."""
    path: str
    vocab_size: int
    arch: str = "hf"
    auto_class: str = "AutoModelForCausalLM"  # the transformers class the task loads with

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
    from ..config_checks import has_weights
    auto = getattr(transformers, args.auto_class)
    if has_weights(p):  # safetensors only: nothing from the path is unpickled
        return auto.from_pretrained(p, local_files_only=True, use_safetensors=True)
    return auto.from_config(config)


def save_hf(model: nn.Module, out_dir: Path, state: dict, tokenizer_path: Optional[Path]) -> None:
    """A `save_pretrained` folder (safetensors), written atomically like every output."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if tokenizer_path is not None:
            for name, f in tokenizer_files(tokenizer_path).items():
                shutil.copyfile(f, tmp / name)


def is_hf_folder(model_dir: Path) -> bool:
    """A `from_pretrained` folder (its config.json names a model_type), not one of ours."""
    import json
    try:
        return "model_type" in json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_for_prompt(model_dir: Path, auto_class: str, prompt: str, device: str
                    ) -> tuple[Any, nn.Module, Any]:
    """(tokenizer, model in eval mode on `device`, the prompt encoded as tensors) for a trained
    folder (local safetensors only), loaded with the transformers class `auto_class`; a prompt
    with no tokens is one ConfigError line."""
    import transformers
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = getattr(transformers, auto_class).from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True).to(device).eval()
    ids = tokenizer(prompt, return_tensors="pt").to(device)
    if ids["input_ids"].numel() == 0:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    return tokenizer, model, ids


def generate_hf_chat(model_dir: Path, prompt: str, opts: Any) -> str:
    """A chat run: the prompt is a user turn rendered with its chat template."""
    return generate_hf(model_dir, prompt, opts, chat=True)


def generate_hf(model_dir: Path, prompt: str, opts: Any, chat: bool = False) -> str:
    """Continue `prompt` with a fine-tuned Hugging Face model (local files only). `chat`: the
    run trained on chat data, so the prompt is a user turn rendered with its chat template.
    `opts`: generate.GenerateOptions."""
    import torch
    import transformers
    device, temperature, top_k = opts.device, opts.temperature, opts.top_k
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, use_safetensors=True).to(device).eval()
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError("--prompt encodes to no tokens; give some text")
    torch.manual_seed(opts.seed)
    idx = torch.tensor([ids], device=device)  # (1, T0)
    sample = temperature > 0
    out = model.generate(idx, attention_mask=torch.ones_like(idx),
                         max_new_tokens=opts.max_new_tokens,
                         do_sample=sample, temperature=temperature if sample else None,
                         top_k=top_k if sample else None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return prompt + tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
