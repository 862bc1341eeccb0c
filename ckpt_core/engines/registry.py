"""Engines by name: the entry-point group ``ckpt_core.engines``, as ``ckpt_core.devices`` finds device kinds.

An engine package declares ``NAME = "package.module:Factory"`` in the group (a zero-argument
callable returning an :class:`~ckpt_core.engines.base.EngineKind`); ckpt-engine's own
pyproject.toml declares its two. The core imports no engine: a name is resolved, and its package
imported, only when a request or a driver asks for that engine.

Where the names come from, first found wins:

1. :func:`register_engine` (tests' fakes, or a program that builds its own);
2. the entry points of the installed distributions;
3. the ``ckpt_core.engines`` table of the pyproject.toml of the source tree ``ckpt_core`` was
   imported from, when that tree is ckpt-engine's: the project's own scripts and CI put the tree
   on ``PYTHONPATH`` rather than installing it, and an environment may hold an older install
   whose metadata predates an engine. The table is the same one an install would register.
"""

from __future__ import annotations

import threading
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Callable

from ckpt_core.engines.base import EngineKind
from ckpt_core.errors import ConfigError

__all__ = ["ENTRY_POINT_GROUP", "DEFAULT_ENGINE", "register_engine", "get_engine", "available_engines"]

ENTRY_POINT_GROUP = "ckpt_core.engines"
# The engine an update request that names none goes to: the reference's behaviour (the handles are
# posted to vLLM's /collective_rpc). A default, not a branch; it is resolved by name like any other.
DEFAULT_ENGINE = "vllm"
PROJECT = "ckpt-engine"
SOURCE_TREE = Path(__file__).resolve().parents[2]

_factories: dict[str, Callable[[], EngineKind]] = {}
_instances: dict[str, EngineKind] = {}
_lock = threading.Lock()
_found = False


def register_engine(name: str, factory: Callable[[], EngineKind]) -> None:
    """Add (or replace) an engine. Used by tests' fakes and programs that bring their own."""
    with _lock:
        _find()
        _factories[name] = factory
        _instances.pop(name, None)


def source_tree_entry_points(root: Path = SOURCE_TREE) -> list[EntryPoint]:
    """The group's entry points in ``root/pyproject.toml`` when ``root`` is ckpt-engine's source tree."""
    import tomllib

    try:
        with open(root / "pyproject.toml", "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, ValueError):
        return []
    if project.get("name") != PROJECT:
        return []
    table = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    return [EntryPoint(name, value, ENTRY_POINT_GROUP) for name, value in table.items()]


def _find() -> None:
    """Collect the names (once); nothing is imported until a name is asked for."""
    global _found
    if _found:
        return
    _found = True
    for ep in [*entry_points(group=ENTRY_POINT_GROUP), *source_tree_entry_points()]:
        _factories.setdefault(ep.name, _loader(ep))


def _loader(ep: EntryPoint) -> Callable[[], EngineKind]:
    def load() -> EngineKind:
        try:
            factory = ep.load()
        except Exception as exc:   # a missing or broken package: say which engine and where it was declared
            raise ConfigError(f"engine {ep.name!r} ({ep.value}, entry-point group {ENTRY_POINT_GROUP!r}) could not "
                              f"be loaded: {type(exc).__name__}: {exc}") from exc
        return factory()
    return load


def available_engines() -> list[str]:
    with _lock:
        _find()
        return sorted(_factories)


def get_engine(name: str) -> EngineKind:
    """The process-wide :class:`EngineKind` of ``name``; ``ConfigError`` naming the known engines otherwise."""
    with _lock:
        _find()
        if name not in _instances:
            if name not in _factories:
                raise ConfigError(f"unknown engine {str(name)[:100]!r}; known engines: {sorted(_factories)} "
                                  f"(an engine package adds itself to the entry-point group {ENTRY_POINT_GROUP!r})")
            kind = _factories[name]()
            if kind.name != name:
                raise ConfigError(f"the engine registered as {name!r} reports the name {kind.name!r}")
            _instances[name] = kind
        return _instances[name]
