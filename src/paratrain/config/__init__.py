"""What a run is asked to do, read and checked before any worker starts, torch-free: the
configuration tree (`tree`: `TrainConfig` of the `sections`), its checks (`checks`, `finetune_checks`), the model folder reader
(`model_folder`), the model sizes (`presets`) and the task table (`registry`).

`from paratrain.config import TrainConfig` (and the other sections of the tree) is the public
spelling; the package's own modules import from `config.tree` and `config.sections`.
"""

from .data_section import DataConfig
from .sections import (
    CheckpointConfig,
    DistributedConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    PlanConfig,
    RunConfig,
    TrainerConfig,
)
from .embedding import EmbeddingConfig
from .preference import DPOConfig, KTOConfig
from .rl import RLConfig
from .tree import TrainConfig

__all__ = ["CheckpointConfig", "DataConfig", "DistributedConfig", "DPOConfig", "EmbeddingConfig",
           "KTOConfig", "LogConfig", "LoraConfig", "ModelConfig", "OptimConfig", "PlanConfig",
           "RLConfig", "RunConfig", "TrainConfig", "TrainerConfig"]
