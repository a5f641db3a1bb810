"""paratrain: train PyTorch models on many devices with data parallelism.

    from paratrain import Trainer, TrainConfig
    result = Trainer(TrainConfig.from_yaml("configs/llama-small.yaml")).fit()
"""

from .checkpoint import load_model
from .config import TrainConfig
from .dist import DistEnv
from .errors import ConfigError, DataError, ParatrainError, RunDirError, TrainingError
from .trainer import RunResult, Trainer

__all__ = ["Trainer", "TrainConfig", "RunResult", "DistEnv", "load_model", "ParatrainError",
           "ConfigError", "DataError", "RunDirError", "TrainingError"]
__version__ = "0.1.0"
