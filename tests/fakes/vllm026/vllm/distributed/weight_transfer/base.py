"""vLLM 0.26's trainer-side bases: ``TrainerInitInfo`` (keyword-only ``rank``, no ``backend``) and a
``TrainerWeightTransferEngine`` whose constructor takes the backend's config first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class WeightTransferInitInfo(ABC):  # noqa: B024 - as in vLLM: a marker base
    pass


@dataclass
class TrainerInitInfo(WeightTransferInitInfo):
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine(ABC):
    def __init__(self, config, *, client, source, is_sender: bool = True) -> None:
        self.config, self.client, self.source, self.is_sender = config, client, source, is_sender

    @classmethod
    @abstractmethod
    def trainer_init(cls, config, init_info, *, client, source):
        raise NotImplementedError

    @abstractmethod
    def send_weights(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
