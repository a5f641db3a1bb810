"""Two tensor-parallel styles torch does not have (parallel/tensor.py's plans use them).

Their base classes are torch's, whose import pulls in DTensor (~0.5 s of CPU): they live here,
imported when a plan is made, so a launcher that never splits a model does not pay for it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn


def _style_base() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle
    return ParallelStyle


class Replicated(_style_base()):  # type: ignore[misc]
    """The module's own parameters replicated over the TP mesh as DTensors, its tensor inputs
    marked replicated, its output kept a DTensor (or made local): a layer no plan splits still
    lives on the one mesh that FSDP, clipping and the optimizer expect."""

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import distribute_module
        return distribute_module(module, device_mesh, _replicate_own_parameters,
                                 _inputs_replicated, partial(_output, self.use_local_output))


def _replicate_own_parameters(name: str, module: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    for pname, param in list(module._parameters.items()):
        if param is not None and not isinstance(param.data, DTensor):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param.data, mesh, [Replicate()]),
                requires_grad=param.requires_grad))


def _inputs_replicated(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
    from torch.distributed.tensor import DTensor, Replicate
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x
                 for x in inputs)


def _output(use_local: bool, module: nn.Module, output: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return output.to_local() if use_local and isinstance(output, DTensor) else output


def _colwise_base() -> type:
    from torch.distributed.tensor.parallel import ColwiseParallel
    return ColwiseParallel


class FusedColwise(_colwise_base()):  # type: ignore[misc]
    """Column-wise for a projection that computes `parts` outputs at once (GPT's c_attn: q, k, v):
    the rows are split in `parts` strides (DTensor's strided shard), so rank r holds the r-th
    slice of each part and its local output is [q_r, k_r, v_r]; that output is used as it is."""

    def __init__(self, *, parts: int):
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, mesh: Any) -> None:
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard
        for pname, param in module.named_parameters():
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, mesh, [_StridedShard(0, split_factor=self.parts)],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                           outputs: Any, device_mesh: Any) -> Any:
        return outputs.to_local()
