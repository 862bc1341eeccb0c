"""vLLM 0.26's factories: lazy registries by name; the trainer's ``trainer_init(backend, config,
init_info, *, client, source)`` calls ``engine_cls.trainer_init(config=..., init_info=..., client=...,
source=...)``."""

from __future__ import annotations

import importlib


class _Registry:
    _registry: dict

    @classmethod
    def register_engine(cls, name: str, module: str, class_name: str) -> None:
        if name in cls._registry:
            raise ValueError(f"{name!r} is already registered")
        cls._registry[name] = lambda: getattr(importlib.import_module(module), class_name)


class WeightTransferEngineFactory(_Registry):
    _registry: dict = {}


class WeightTransferTrainerFactory(_Registry):
    _registry: dict = {}

    @classmethod
    def trainer_init(cls, backend: str, config, init_info, *, client, source):
        if backend not in cls._registry:
            raise ValueError(f"Invalid weight transfer backend: {backend}. Available trainer engines: "
                             f"{list(cls._registry)}")
        return cls._registry[backend]().trainer_init(config=config, init_info=init_info, client=client,
                                                     source=source)
