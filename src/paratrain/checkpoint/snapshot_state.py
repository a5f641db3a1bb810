"""What a snapshot holds of the training state besides the loop's own (runtime/loop_state.py):
the model and optimizer as DCP sees them, and every rank's RNG; and `Resumed`, what a resume hands
back. The Snapshotter (snapshotter.py) decides when these are saved and from where they are
loaded; `paratrain checkpoint export` reads the tensors the same way (`state_options`)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Resumed:
    """Where a run continues from: the snapshot's marker (`loop`), and `rank`, this rank's own
    part of it (runtime/loop_state.py); None when the snapshot was written by another world
    size."""
    url: str
    step: int
    loop: dict
    rank: Optional[dict]
    world_size: int


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Model and optimizer as DCP sees them: FQNs without wrapper prefixes, shards as DTensors
    under FSDP, so any strategy and world size can load them. Frozen parameters (LoRA's base)
    never change and are rebuilt from model.path on resume, so they are left out: a snapshot
    holds what training changes."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from ..parallel.tensor import storable
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_options(model))
    return storable({"model": model_sd, "optim": optim_sd})


def state_options(model: nn.Module) -> Any:
    """What a snapshot holds of `model`, for saving and loading alike (the run's resume, and
    `paratrain checkpoint export` of a fine-tuning run): trainable parameters only (and buffers)
    when some are frozen; then loading is not strict, since the frozen ones are absent by
    design."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def rng_state(device: torch.device) -> dict:
    """This rank's RNG state (JSON), so dropout continues where it was."""
    out = {"rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        out["cuda_rng"] = base64.b64encode(
            torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)
    torch.set_rng_state(tensor(state["rng"]))
    if device.type == "cuda" and state.get("cuda_rng"):
        torch.cuda.set_rng_state(tensor(state["cuda_rng"]), device)
