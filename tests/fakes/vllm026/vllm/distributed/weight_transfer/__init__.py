from .base import TrainerInitInfo, TrainerWeightTransferEngine, WeightTransferInitInfo
from .factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

__all__ = ["TrainerInitInfo", "TrainerWeightTransferEngine", "WeightTransferInitInfo", "WeightTransferEngineFactory",
           "WeightTransferTrainerFactory"]
