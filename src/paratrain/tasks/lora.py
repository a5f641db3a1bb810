"""LoRA adapters on a pretrained Hugging Face model, through `peft` (an optional extra).

The base weights are frozen (requires_grad False), so the optimizer, which takes only trainable
parameters, holds state for the adapters alone: that is the memory LoRA saves. Every wrapper
(single, DDP, FSDP2) sees an ordinary module. At the end the run writes both the merged model
(`model/`, a plain `from_pretrained` folder) and the adapter alone (`adapter/`, loadable with
`peft.PeftModel.from_pretrained`).

`model.lora.*` are peft's own LoraConfig options, passed through (`lora_config`); paratrain adds
one check peft does not make: every name in target_modules (and modules_to_save) must match a
module, so that a typo in a list is refused instead of silently training fewer adapters. The
check and a summary line (which modules got adapters, how many parameters train) run on a
meta-device copy of the model before any data is read (`PretrainedTask.prepare`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from ..config.defaults import lora_targets
from ..errors import ConfigError
from ..fileio import atomic_dir
from ..formatting import human_count

ADAPTER_DIR = "adapter"


def lora_config(lora: Any, task_type: str) -> Any:
    """peft.LoraConfig from model.lora.* (config.LoraConfig). `task_type` "SEQ_CLS" (a
    classifier) also trains its new head in full (peft's modules_to_save: the head is not
    pretrained, so an adapter on it would learn nothing)."""
    try:
        import peft
    except ImportError:
        raise ConfigError("model.lora needs the peft package: pip install "
                          "'paratrain[lora]'") from None
    init = lora.init_lora_weights
    return peft.LoraConfig(
        r=int(lora.r), lora_alpha=float(lora.alpha), lora_dropout=float(lora.dropout),
        target_modules=lora_targets(lora), bias=lora.bias,
        modules_to_save=list(lora.modules_to_save) if lora.modules_to_save else None,
        use_dora=bool(lora.use_dora), use_rslora=bool(lora.use_rslora),
        init_lora_weights=init if isinstance(init, (bool, str)) else bool(init),
        layers_to_transform=list(lora.layers_to_transform)
        if lora.layers_to_transform is not None else None, task_type=task_type)


def check_targets(model: nn.Module, lora: Any) -> None:
    """Every name in model.lora.target_modules and modules_to_save matches a module of `model`
    (its full name or its last parts), else one ConfigError line naming the ones that do not."""
    names = [n for n, _ in model.named_modules() if n]
    wanted = {"model.lora.target_modules": lora_targets(lora),
              "model.lora.modules_to_save": list(lora.modules_to_save or [])}
    for key, targets in wanted.items():
        if targets == "all-linear":
            continue
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, nn.Linear)})
            raise ConfigError(
                f"{key}={list(targets)}: {', '.join(map(repr, missing))} "
                f"match{'es' if len(missing) == 1 else ''} no module of the model; its linear "
                f"layers are named: {', '.join(linear[:12])} (or pass all-linear)")


def apply_lora(model: nn.Module, lora: Any, task_type: str = "CAUSAL_LM") -> nn.Module:
    """`model` with adapters per model.lora.* (config.LoraConfig), its base frozen."""
    import peft

    from ..models.hf import quiet_transformers
    quiet_transformers()  # peft asks the model a deprecated question: a FutureWarning per rank
    config = lora_config(lora, task_type)
    check_targets(model, lora)
    return peft.get_peft_model(model, config)


def describe_lora(model: nn.Module) -> str:
    """One line: which modules got adapters (by their last name, and how many), and how many
    parameters train, of how many. `model`: a PeftModel (a meta-device copy will do)."""
    adapted: dict[str, int] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and len(getattr(module, "lora_A")):
            leaf = name.rsplit(".", 1)[-1]
            adapted[leaf] = adapted.get(leaf, 0) + 1
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    where = ", ".join(f"{leaf} x{n}" for leaf, n in sorted(adapted.items()))
    return (f"LoRA: adapters on {sum(adapted.values())} modules ({where}); "
            f"{human_count(trainable)} of {human_count(total)} parameters train "
            f"({100.0 * trainable / max(total, 1):.2f}%)")


def save_lora(model: nn.Module, model_dir: Optional[Path], adapter_dir: Optional[Path],
              add_files: Callable[[Path], None]) -> None:
    """Rank 0: from `model`, a CPU PeftModel holding the trained weights, write the adapter alone
    to `adapter_dir` and the merged model to `model_dir` (plus `add_files`, e.g. the tokenizer),
    each atomically; either may be None. Merging changes `model` in place: the adapter first."""
    if adapter_dir is not None:
        with atomic_dir(adapter_dir) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)  # adapter weights + config only
            add_files(tmp)
    if model_dir is not None:
        merged = model.merge_and_unload()
        with atomic_dir(model_dir) as tmp:
            merged.save_pretrained(tmp, safe_serialization=True)
            add_files(tmp)


def adapters_of(model: nn.Module) -> nn.Module:
    """The peft model inside whatever wraps it (DDP's module; FSDP2 shards it in place)."""
    import peft
    return next(m for m in model.modules() if isinstance(m, peft.PeftModel))
