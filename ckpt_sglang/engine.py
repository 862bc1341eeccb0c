"""SGLang as the core finds it: the ``sglang`` entry of the ``ckpt_core.engines`` group (pyproject.toml).

The service names the engine ``sglang`` and gets :class:`SglangEngine`: an ``update_url`` is the
server's base URL (``http://host:port``, a trailing ``/update_weights_from_ipc`` accepted); the
PS must speak the stock wire (SGLang embeds the stock checkpoint-engine worker); a request may add
``weight_version`` and ``flush_cache`` to a whole update; a commit pauses ``retract`` (default) or
``in_place``.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from ckpt_core.engines.base import check_option_names
from ckpt_core.errors import ConfigError

from .client import COMMIT_PAUSE_MODES, SglangClient

__all__ = ["SglangEngine", "ROUTE", "base_url"]

ROUTE = "/update_weights_from_ipc"


def base_url(update_url: str) -> str:
    """The SGLang server's base URL from ``update_url`` (``http://host:port``, optionally with its route)."""
    parts = urlsplit(update_url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise ConfigError(f"update_url for engine='sglang' must be the server's URL (http://host:port), "
                          f"got {update_url[:200]!r}")
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix(ROUTE)}"


class SglangEngine:
    """The :class:`~ckpt_core.engines.base.EngineKind` of SGLang."""

    name = "sglang"
    routes: tuple[str, ...] = ("", ROUTE)
    commit_pauses: tuple[str, ...] = COMMIT_PAUSE_MODES
    options: tuple[str, ...] = ("weight_version", "flush_cache")

    def check_options(self, given: Mapping[str, Any], *, staged: bool) -> None:
        check_option_names(self, given)
        if staged and "weight_version" in given:
            raise ConfigError("a staged update's version is stage; POST /v1/commit sets it live")
        if staged and "flush_cache" in given:
            raise ConfigError("flush_cache applies to a whole update; a staged update's commit flushes the cache "
                              "(pause='retract') or keeps it (pause='in_place')")

    def check_wire(self, wire: str) -> None:
        if wire == "native":
            raise ConfigError("engine='sglang' needs a parameter server speaking the stock wire (SGLang embeds the "
                              "stock checkpoint-engine worker): start the service with "
                              "`ckpt-engine serve --wire stock` "
                              "(`--wire stock-0.3` for checkpoint-engine 0.2.1 - 0.3.4 in the server)")

    def client(self, update_url: str, *, uds: str | None = None, timeout: float = 600.0) -> SglangClient:
        return SglangClient(base_url(update_url), uds=uds, timeout=timeout)
