"""Tensor parallelism for a Hugging Face model, by the model's own plan: transformers merges the
config's `base_model_tp_plan` with the model class's (`model.tp_plan`: module name patterns to
style names such as colwise / rowwise / embedding_rowwise) and applies it with its own DTensor
styles (`apply_tensor_parallelism`); nothing of the plan is re-typed here. Its plans keep the
residual stream replicated (no sequence parallelism); the layers it leaves whole (the norms) are
replicated over the TP mesh by parallel/tensor.py, so every parameter lives on one mesh."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..errors import ConfigError


def hf_plan(model: nn.Module) -> Callable[[nn.Module, Any], None]:
    """A function (model, tp_mesh) that splits `model` by its own TP plan; a ConfigError when
    the model has none, or this transformers cannot apply one."""
    try:
        from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError:
        raise ConfigError("trainer.tensor_parallel with model.arch=hf needs a transformers "
                          "release with DTensor tensor parallelism (transformers.distributed, "
                          "5.x); upgrade it or set trainer.tensor_parallel=1") from None
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(f"trainer.tensor_parallel: the Hugging Face model {name!r} carries no "
                          "tensor-parallel plan (its config has no base_model_tp_plan); use a "
                          "model family that has one (Llama, Mistral, Qwen2, ...) or "
                          "trainer.tensor_parallel=1")

    def apply(model: nn.Module, tp_mesh: Any) -> None:
        # one entry per concrete module and parameter, parameters first (what the function
        # expects): the plan's `layers.*.` patterns matched against the numbered names
        expanded: dict[str, str] = {}
        for name, module in model.named_modules():
            style = plan.get(replace_layer_number_by_wildcard(name))
            if style is None:
                continue
            for pname, _ in module.named_parameters(recurse=False):
                expanded[f"{name}.{pname}"] = style
            expanded[name] = style
        apply_tensor_parallelism(model, tp_mesh, expanded)
    return apply
