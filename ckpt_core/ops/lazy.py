"""A package's public names imported on first read (PEP 562), so that importing it stays cheap.

``ckpt_core``, ``ckpt_core.engines`` and ``ckpt_core.planning`` each keep a table of name -> module
and take their module ``__getattr__`` and ``__dir__`` from :func:`lazy_exports`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, table: dict[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``table`` is imported from its module on
    first read and kept in ``namespace`` (the package's globals), so the next read is a plain attribute."""
    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
