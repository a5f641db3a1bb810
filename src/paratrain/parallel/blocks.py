"""The repeated blocks of a model: the units FSDP shards one by one, and what activation
checkpointing and compile wrap block by block (strategies.py). Ours name them `layers`; a Hugging
Face model names its block classes in `_no_split_modules` (an encoder-decoder: both stacks)."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..errors import ConfigError


def shard_units(model: nn.Module, wrap: Sequence[type]) -> list[nn.Module]:
    """The modules a sharding wraps one by one: instances of the `wrap` classes if given, else
    the transformer blocks (ours, or those a Hugging Face model names in `_no_split_modules`:
    an encoder-decoder's blocks of both stacks)."""
    if wrap:
        return [m for m in model.modules() if isinstance(m, tuple(wrap)) and m is not model]
    return [block for layers in find_block_lists(model) for block in layers.children()]


def find_block_lists(model: nn.Module) -> list[nn.Module]:
    """Every list of repeated blocks: our models' `layers` (a dict in a pipeline stage); in a
    Hugging Face model, each ModuleList whose modules are all blocks it names in
    `_no_split_modules` (model.model.layers, transformer.h, encoder.block, decoder.block, ...)."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return [layers]
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) and
            all(type(b).__name__ in names for b in m)]


def block_lists(model: nn.Module) -> list[nn.Module]:
    """The lists of blocks activation checkpointing and compile wrap one by one; a model with
    none is refused."""
    lists = find_block_lists(model)
    if not lists:
        raise ConfigError(f"{type(model).__name__} has no list of blocks (a `layers` ModuleList) "
                          "for activation checkpointing or compile to wrap block by block")
    return lists
