"""Tensor parallelism: one layer's matrices split over the processes of a node (Megatron-style,
through torch.distributed.tensor.parallel), composed with data parallelism over the remaining
dimension of the run's mesh (parallel/dims.py).

In each block the projections that read the residual stream are split by columns (q, k, v; the
MLP's up/gate), so every rank computes whole heads and its slice of the hidden units with no
communication, and the projections that write back into the stream are split by rows (attention's
output, the MLP's down projection), whose partial sums are reduced once per sub-layer. With
sequence parallelism the stream between those regions (norms, dropout, residual adds) is split
along the sequence instead of replicated, so activations shrink by the TP degree too: the reduce
becomes a reduce-scatter and the entry of each region an all-gather (Korthikanti et al., 2022).
The token embedding is split by vocabulary rows and the output projection by vocabulary columns,
then gathered so the loss sees whole logits and the loop's token-weighted sum stays exact.

Every parameter ends up a DTensor on the TP mesh (a layer no plan splits is replicated over it),
so FSDP2 on the data-parallel submesh, gradient clipping, the optimizer and DCP all see one mesh.
Order, as torchtitan composes them: TP -> activation checkpointing -> compile -> FSDP.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..dist import DistEnv
from ..errors import ConfigError
from .dims import ParallelDims, check_tensor_parallel
from .strategies import FSDP, Parallelism, resolve_data


@dataclass(frozen=True)
class TensorParallel(FSDP):
    """`trainer.tensor_parallel=N`: TP over the `tp` dimension of `dims`, and data parallelism
    over the rest (`data`: ddp replicates, fsdp shards, hsdp both; single when there is none),
    through FSDP2 on the (dp_replicate, dp_shard) submesh: replicating is FSDP2 with shards of one
    (torchtitan does the same), which keeps mixed precision, accumulation (`no_sync`) and the
    gradient reductions FSDP's, one code path for every layout."""
    dims: ParallelDims = field(default_factory=ParallelDims)
    data: Parallelism = field(default_factory=Parallelism)  # over the data-parallel processes

    @property
    def name(self) -> str:  # type: ignore[override]
        """Every dimension above one, read from the sizes (dims.`layout_name`): tp, fsdp+tp,
        fsdp+tp+cp."""
        return self.dims.layout_name(self.data_name)

    @property
    def data_name(self) -> str:
        """What FSDP2 does over the (dp_replicate, dp_shard x cp) submesh, from its sizes: shards
        (fsdp), replicates shard groups (hsdp), or only replicates (ddp). A CP group is sharded
        over whichever strategy was asked."""
        shards, replicas = self.dims.dp_shard * self.dims.cp > 1, self.dims.dp_replicate > 1
        return "hsdp" if shards and replicas else "fsdp" if shards else \
            "ddp" if replicas else "single"

    @property
    def data_label(self) -> str:
        return self.data_name

    @property
    def sharded(self) -> bool:  # type: ignore[override]
        return self.dims.dp_shard * self.dims.cp > 1  # FSDP2 shards over dp_shard x cp

    @property
    def label(self) -> str:
        """e.g. tp2, fsdp+tp4+cp2: the degrees after their dimensions."""
        return self.dims.layout_name(self.data_label, degrees=True)

    def device_mesh(self, env: DistEnv) -> Any:
        return self.dims.build_mesh(env.device.type)

    def data_mesh(self, mesh: Any, dims: ParallelDims) -> Any:
        """Both data-parallel dimensions, whatever their sizes: FSDP2 over a 2-D mesh beside TP's
        (its replicas, then its shards)."""
        return dims.data_mesh(mesh, both=True)

    def full_state_dict(self, model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
        """As FSDP's; the gather of a parameter split by TP and then by FSDP takes one
        all-gather per dimension (DTensor cannot merge them in that order) and DTensor logs a
        warning for each: expected here, once per save."""
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            return super().full_state_dict(model, env)
        finally:
            quiet.setLevel(level)

    def state_numel(self, shape: torch.Size, world: int, rank: int = 0) -> int:
        raise NotImplementedError("a tensor-parallel share depends on the layer, not the shape: "
                                  "the memory plan reads it from the parallelized model "
                                  "(parallel/simulate.py)")

    def layout(self, world: int) -> ParallelDims:
        return self.dims


def resolve_tensor_parallel(requested: str, tp: int, *, world_size: int, local_world_size: int,
                            device: torch.device, reshard_after_forward: bool = True,
                            shard_group_size: Optional[int] = None, cp: int = 1
                            ) -> tuple[TensorParallel, str]:
    """(parallelism, why) for `trainer.tensor_parallel=tp` with `trainer.strategy=requested`
    over the other world / tp processes: the data-parallel part is resolved as
    `resolve_data` would for that many processes (`auto`: fsdp, which shards what TP
    leaves whole), then both are fixed in one ParallelDims (with `cp` of the data-parallel
    processes made context-parallel groups: parallel/context.py)."""
    check_tensor_parallel(tp, world=world_size, local_world=local_world_size,
                          shard_group=shard_group_size)
    base, data, why = resolve_data(
        "fsdp" if requested == "auto" else requested, world_size=world_size // tp,
        local_world_size=local_world_size // tp, device=device,
        reshard_after_forward=reshard_after_forward,
        shard_group_size=shard_group_size // tp if shard_group_size else None)
    dims = ParallelDims(base.dp_replicate, base.dp_shard, tp).with_context(cp)
    why = ("auto: fsdp over the data-parallel processes" if requested == "auto" and dims.dp > 1
           else why if dims.dp > 1 else "no data parallelism left")
    # with shards of one there is nothing to free after forward and gather again
    reshard = reshard_after_forward and dims.dp_shard * dims.cp > 1
    return (TensorParallel(dims=dims, data=data, reshard_after_forward=reshard),
            f"{why}; tensor parallel over {tp} processes of a node ({dims.label})")


# ---- the plans ----------------------------------------------------------------------------------
def split_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """The tensor-parallel step of `parallelize` (strategies.py), first of the fixed order: the
    model split over the `tp` dimension of the run's mesh by its plan."""
    apply_tensor_parallel(model, tp_mesh)
    # The logits come out of the gathered head as a view of the DTensor's local tensor;
    # FSDP2 warns about any view a root returns, for in-place ops the loop never does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view",
                            category=UserWarning)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Split `model` over the 1-D `tp_mesh` by its plan (ours, the Hugging Face model's own
    `base_model_tp_plan`, or a `tp_plan` the module gives), then replicate over the mesh every
    parameter the plan left alone. Tied weights stay tied. A ConfigError when there is no plan."""
    from torch.distributed.tensor.parallel import parallelize_module
    ties = _tied_parameters(model)
    plan = tp_plan_of(model)
    if isinstance(plan, dict):
        parallelize_module(model, tp_mesh, plan)
    else:
        plan(model, tp_mesh)  # a function of its own: the Hugging Face path
    _replicate_the_rest(model, tp_mesh)
    for owner, name, source_owner, source_name in ties:
        shared = getattr(source_owner, source_name)
        if getattr(owner, name).placements != shared.placements:
            raise ConfigError(f"trainer.tensor_parallel: {type(model).__name__} ties "
                              f"{name!r} to {source_name!r}, but its plan splits them "
                              "differently; untie them (e.g. model.tie_embeddings=false) or "
                              "train with trainer.tensor_parallel=1")
        setattr(owner, name, shared)


def tp_plan_of(model: nn.Module) -> Any:
    """The plan that splits this model: a dict of module name patterns to torch ParallelStyles,
    or a function (model, tp_mesh) that applies one. A ConfigError naming why when none."""
    builtin = builtin_plan(type(model))
    if builtin is not None:
        return builtin
    own = getattr(model, "tp_plan", None)  # a pipeline stage's too (pipeline.ModelPart)
    if isinstance(own, dict) and own and all(_is_style(s) for s in own.values()):
        return own  # a user's module that says how to split it
    if hasattr(model, "config") and hasattr(model, "base_model"):  # a transformers model
        from .tensor_hf import hf_plan
        return hf_plan(model)
    raise ConfigError(
        f"trainer.tensor_parallel needs a plan that says how to split {type(model).__name__}'s "
        "layers, and it has none; give the module a `tp_plan` attribute (a dict of submodule "
        "names to torch.distributed.tensor.parallel styles, e.g. ColwiseParallel()), or train "
        "it with trainer.tensor_parallel=1")


def builtin_plan(arch: type) -> Optional[dict]:
    """The plan of our Llama or GPT class (None for any other)."""
    from ..models.gpt import GPT
    from ..models.llama import Llama
    return llama_plan() if issubclass(arch, Llama) else gpt_plan() if issubclass(arch, GPT) \
        else None


def check_tp_plan(task: Any, tp: int) -> None:
    """Before any worker starts: the task's model (built on the meta device: no memory, no
    weights read) has a plan, and `tp` divides its heads. One ConfigError line when not."""
    from ..config.checks import check_tp_heads
    with torch.device("meta"):
        model = task.build_model()
    if any(not p.requires_grad for p in model.parameters()):  # LoRA: see docs/scale/tensor-parallel.md
        raise ConfigError(
            f"trainer.tensor_parallel={tp} with LoRA adapters is refused: peft replaces the "
            "projections the model's plan splits with adapter wrappers, which would need a plan "
            "of their own (A whole and B by columns beside a column-split layer, A by rows "
            "beside a row-split one); train LoRA with trainer.tensor_parallel=1 (fsdp shards "
            "the frozen base), or full fine-tuning (model.lora.r=0) with tensor parallelism")
    tp_plan_of(model)
    config = getattr(model, "config", None)  # a Hugging Face model's own head counts
    if config is not None:
        heads = getattr(config, "num_attention_heads", None)
        check_tp_heads(tp, heads, getattr(config, "num_key_value_heads", None) or heads,
                       names=("num_attention_heads", "num_key_value_heads (model.path's "
                              "config.json)"))


def _is_style(obj: Any) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle
    return isinstance(obj, ParallelStyle)


def llama_plan() -> dict:
    """Our Llama: vocab-split embedding whose output is the sequence-split stream; per block,
    the norms sequence-parallel, q/k/v and w1/w3 by columns, wo and w2 by rows (reduce-scattered
    back to the sequence split); the final norm sequence-parallel; the head by vocabulary, its
    logits gathered whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel
    return sequence_parallel_plan(
        embedding="tok_embeddings", block_norms=("attention_norm", "ffn_norm"),
        regions={"attention": 2, "feed_forward": 1},  # their inputs: (x, mask), (x,)
        columns={f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")} |
        {f"feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")},
        rows=("attention.wo", "feed_forward.w2"), final_norm="norm")


def gpt_plan() -> dict:
    """Our GPT: as Llama, with learned positions replicated (added to the sequence-split
    stream, each rank its own positions) and the fused q/k/v projection split in three strides,
    so a rank's slice holds its heads' rows of each of q, k and v."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from .tensor_styles import FusedColwise, Replicated
    return {"wpe": Replicated(use_local_output=False), **sequence_parallel_plan(
        embedding="wte", block_norms=("ln_1", "ln_2"), regions={"attn": 2, "mlp": 1},
        columns={"attn.c_attn": FusedColwise(parts=3), "mlp.c_fc": ColwiseParallel()},
        rows=("attn.c_proj", "mlp.c_proj"), final_norm="ln_f")}


def sequence_parallel_plan(*, embedding: str, block_norms: Sequence[str],
                           regions: dict[str, int], columns: dict[str, Any],
                           rows: Sequence[str], final_norm: str) -> dict:
    """The Megatron plan with sequence parallelism for a decoder whose blocks are
    `layers.<i>` and whose head is `lm_head`: the stream between the regions (`regions`: the
    attention and MLP modules, with how many positional inputs each takes) is split along the
    sequence; a region gathers it whole on entry, its `columns` projections split by output
    features (styles given), its `rows` projections by input features, their partial sums
    reduce-scattered back to the sequence split."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    plan: dict = {embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                             use_local_output=False)}
    for norm in block_norms:
        plan[f"layers.*.{norm}"] = SequenceParallel()
    for region, inputs in regions.items():  # (x, mask): only x is the stream
        rest = (None,) * (inputs - 1)
        plan[f"layers.*.{region}"] = PrepareModuleInput(
            input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))
    plan.update({f"layers.*.{name}": style for name, style in columns.items()})
    plan.update({f"layers.*.{name}": RowwiseParallel(output_layouts=Shard(1),
                                                     use_local_output=False) for name in rows})
    plan[final_norm] = SequenceParallel()
    plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plan


def _replicate_the_rest(model: nn.Module, tp_mesh: Any) -> None:
    """Every module whose own parameters the plan left plain gets them replicated (Replicated)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from .tensor_styles import Replicated
    for module in list(model.modules()):
        own = [p for p in module._parameters.values() if p is not None]
        if own and not all(isinstance(p.data, DTensor) for p in own):
            parallelize_module(module, tp_mesh, Replicated())


def _tied_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, name, first module, its name) for every parameter that is the same object as
    one met earlier (GPT's head and token embedding): splitting replaces parameters, so the tie
    is made again afterwards, which needs both to be split the same way."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) in first:
                ties.append((module, name, *first[id(p)]))
            else:
                first[id(p)] = (module, name)
    return ties


def storable(state: Any) -> Any:
    """`state` (nested dicts of tensors, as DCP saves and loads them) with every strided shard
    (FusedColwise: GPT's q/k/v under TP) gathered whole: DCP records each rank's shard as one
    box of the full tensor, which a strided shard is not. A replicated tensor is written once;
    loading copies it back into the strided parameter (a local slice, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard
    if isinstance(state, dict):
        return {k: storable(v) for k, v in state.items()}
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        return state.redistribute(placements=[Replicate()] * state.device_mesh.ndim)
    return state
