"""paratrain: train PyTorch models on many devices with data parallelism.

    from paratrain import Trainer
    from paratrain import TrainConfig
    result = Trainer(TrainConfig.from_yaml("configs/llama-small.yaml")).fit()

The names below are imported on first use, so `paratrain --help` and config errors answer
without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ParatrainError,
    RunDirError,
    TrainingError,
)

_LAZY = {"Trainer": "trainer", "RunResult": "trainer", "TrainConfig": "config.tree",
         "DistEnv": "dist", "load_model": "models.files", "Task": "tasks.base",
         "UserTask": "tasks.user"}

__all__ = ["Trainer", "TrainConfig", "RunResult", "Task", "UserTask", "DistEnv", "load_model",
           "ParatrainError", "ConfigError", "DataError", "RunDirError", "TrainingError", "CheckpointError"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'paratrain' has no attribute {name!r}")
