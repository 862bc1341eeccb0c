"""vLLM as the core finds it: the ``vllm`` entry of the ``ckpt_core.engines`` group (pyproject.toml).

The service (``ckpt-engine serve``) and the drivers name the engine ``vllm`` and get
:class:`VllmEngine`: an ``update_url`` is the server's ``/collective_rpc`` URL; a request may add
``prepare`` (a staged update turned into the kernel format before its commit) and ``slices``
(each worker only what its loaders read, by a plan :meth:`VllmClient.slice_plan` records) and
``deltas`` (the workers keep the version as the base of later deltas, docs/deltas.md) and, in
``options``, ``direct`` (tensors of verbatim layers copied straight into the live model once the
workers recorded the plan, docs/vllm.md "Direct full updates"); a commit pauses ``keep``
(default), ``wait`` or ``abort``.
"""

from __future__ import annotations

from typing import Any, Mapping
from urllib.parse import urlsplit

from ckpt_core.engines.base import check_option_names
from ckpt_core.engines.requests import request_inference_to_update
from ckpt_core.errors import ConfigError

from .client import VllmClient

__all__ = ["VllmEngine", "ROUTE"]

ROUTE = "/collective_rpc"


class EngineVllmClient(VllmClient):
    """The client the service and drivers get for ``update_url`` (``.../collective_rpc``): a
    :class:`VllmClient` of that server whose :meth:`update` without options is the reference's
    call (``request_inference_to_update``: ``/collective_rpc``, then the prefix cache reset, a
    server without that route warned about once)."""

    def __init__(self, update_url: str, *, uds: str | None = None, timeout: float = 600.0):
        parts = urlsplit(update_url)
        super().__init__(f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix(ROUTE)}", uds=uds,
                         timeout=timeout)
        self.update_url = update_url

    def update(self, handles, **options):
        if options:   # our worker extension's own route (e.g. the plan's digest)
            return super().update(handles, **options)
        request_inference_to_update(self.update_url, dict(handles), timeout=self.timeout, uds=self.uds)
        return None


class VllmEngine:
    """The :class:`~ckpt_core.engines.base.EngineKind` of vLLM."""

    name = "vllm"
    routes: tuple[str, ...] = (ROUTE,)
    commit_pauses: tuple[str, ...] = ("keep", "wait", "abort")
    options: tuple[str, ...] = ("prepare", "slices", "deltas", "direct")

    def check_options(self, given: Mapping[str, Any], *, staged: bool) -> None:
        check_option_names(self, given)
        if given.get("prepare") and not staged:
            raise ConfigError("prepare applies to a staged update (give stage)")
        if given.get("deltas") and given.get("prepare"):
            raise ConfigError("prepare does not apply to a staged delta: its commit applies the changed elements "
                              "and reloads only the changed layers, there is no kernel format to prepare "
                              "(docs/deltas.md)")
        if given.get("direct") and (staged or given.get("slices") or given.get("deltas")):
            raise ConfigError("direct applies to a plain full update: not staged, sliced or a delta "
                              "(docs/vllm.md, Direct full updates)")

    def check_wire(self, wire: str) -> None:
        """Any: our worker extension speaks the native wire, the stock worker (checkpoint-engine's
        vLLM extension) the stock one."""

    def client(self, update_url: str, *, uds: str | None = None, timeout: float = 600.0) -> EngineVllmClient:
        return EngineVllmClient(update_url, uds=uds, timeout=timeout)

