"""Every name a config accepts has an implementation, and every implementation has its name:
the objectives (the registry's specs and the Task classes under paratrain.tasks), DPO's loss
types and the embedding poolings (listed once, in config/preference.py and config/embedding.py,
torch-free; computed in the task's table)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from types import SimpleNamespace

import pytest
import torch

import paratrain.tasks
from paratrain.config import embedding, preference, registry
from paratrain.config.data_section import DataConfig
from paratrain.config.sections import ModelConfig
from paratrain.errors import ConfigError
from paratrain.tasks.base import Task

# Task classes that are shared bases, not tasks of their own: the fine-tuning base, the causal-LM
# base of sft / DPO / GRPO, and the user's own model (Trainer(model=...), outside the registry).
BASES = {"PretrainedTask", "CausalLMTask", "UserTask"}


def _task_classes() -> set[type]:
    """Every Task subclass defined in a module under paratrain.tasks."""
    found = set()
    for info in pkgutil.walk_packages(paratrain.tasks.__path__, "paratrain.tasks."):
        module = importlib.import_module(info.name)
        found |= {c for _, c in inspect.getmembers(module, inspect.isclass)
                  if issubclass(c, Task) and c is not Task and c.__module__ == module.__name__}
    return found


def test_every_objective_has_its_task_and_every_task_its_objective():
    loaded = {s.load() for s in registry.specs()}
    assert all(issubclass(c, Task) for c in loaded), loaded
    unregistered = {c.__name__ for c in _task_classes() - loaded} - BASES
    assert not unregistered, f"Task classes no registered objective trains: {unregistered}"


def test_every_dpo_loss_type_has_its_formula_and_every_formula_its_name():
    from paratrain.tasks.preference.dpo import DPO_LOSSES
    assert set(DPO_LOSSES) == set(preference.DPO_LOSSES)


def test_every_pooling_is_computed_and_every_computation_named():
    from paratrain.tasks.embedding.embedder import POOL, pool
    assert set(POOL) == set(embedding.POOLINGS)
    hidden = torch.arange(24, dtype=torch.float32).view(2, 3, 4)  # (N, T, H)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # (N, T)
    pooled = {name: pool(hidden, mask, name) for name in embedding.POOLINGS}
    assert all(v.shape == (2, 4) for v in pooled.values())
    assert len({tuple(v.flatten().tolist()) for v in pooled.values()}) == len(pooled)  # distinct


@pytest.mark.parametrize("section, key, check", [
    ("dpo", "loss", preference.check_dpo), ("embedding", "pooling", embedding.check_embedding)])
def test_a_name_outside_the_list_is_refused_naming_the_list(section, key, check):
    cls = {"dpo": preference.DPOConfig, "embedding": embedding.EmbeddingConfig}[section]
    cfg = SimpleNamespace(data=DataConfig(), model=ModelConfig(),
                          **{section: dataclasses.replace(cls(), **{key: "nope"})})
    accepted = {"dpo": preference.DPO_LOSSES, "embedding": embedding.POOLINGS}[section]
    with pytest.raises(ConfigError, match=f"{section}.{key}='nope' is not one of: "
                                          + ", ".join(accepted)):
        check(cfg)
