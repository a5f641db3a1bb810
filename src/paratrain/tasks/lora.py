"""LoRA adapters on a pretrained Hugging Face model, through `peft` (an optional extra).

The base weights are frozen (requires_grad False), so the optimizer, which takes only trainable
parameters, holds state for the adapters alone: that is the memory LoRA saves. Every wrapper
(single, DDP, FSDP2) sees an ordinary module. At the end the run writes both the merged model
(`model/`, a plain `from_pretrained` folder) and the adapter alone (`adapter/`, loadable with
`peft.PeftModel.from_pretrained`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch import nn

from ..errors import ConfigError
from ..fileio import atomic_dir

ADAPTER_DIR = "adapter"


def apply_lora(model: nn.Module, lora: Any, task_type: str = "CAUSAL_LM") -> nn.Module:
    """`model` with adapters on `lora.target_modules` (config.LoraConfig), base frozen.
    `task_type` "SEQ_CLS" (a classifier) also trains its new head in full (peft's
    modules_to_save: the head is not pretrained, so an adapter on it would learn nothing)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install "
                          "'paratrain[lora]'") from None
    targets = list(lora.target_modules)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not any(n == t or n.endswith("." + t) for n in names for t in targets):
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
        raise ConfigError(f"model.lora.target_modules={targets} matches no module of the model; "
                          f"its linear layers are named: {', '.join(leaves[:8])}")
    config = peft.LoraConfig(r=int(lora.r), lora_alpha=float(lora.alpha),
                             lora_dropout=float(lora.dropout), target_modules=targets,
                             task_type=task_type)
    return peft.get_peft_model(model, config)


def save_lora(fresh: nn.Module, state: dict, model_dir: Path, adapter_dir: Path,
              add_files: Callable[[Path], None]) -> None:
    """Rank 0: load the run's full state into `fresh` (a new CPU PeftModel of the same shape),
    then write the adapter alone and the merged model (plus `add_files`, e.g. the tokenizer),
    each atomically."""
    fresh.load_state_dict(state)
    with atomic_dir(adapter_dir) as tmp:
        fresh.save_pretrained(tmp, safe_serialization=True)  # adapter weights + config only
        add_files(tmp)
    merged = fresh.merge_and_unload()
    with atomic_dir(model_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        add_files(tmp)
