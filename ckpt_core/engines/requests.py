"""Asking an inference engine to pull an update (the stock ``/collective_rpc`` call)."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from ckpt_core.engines.http import HttpTransport
from ckpt_core.errors import ConfigError, RemoteWorkerError

log = logging.getLogger("ckpt_core.requests")
_WORKER_TIMEOUT_S = 600.0   # ckpt_core.wire.worker.DEFAULT_TIMEOUT_S (a layer above this one)


def group_handles(handles: list[tuple[str, str]], rank: int, inference_parallel_size: int | None = None
                  ) -> list[tuple[str, str]] | None:
    """What ``rank``'s ``req_func`` should post, or None when another rank posts for its engine.

    ``req_func`` runs on every rank with the handles of all ranks. The reference's convention
    (its examples/update.py, SGLang's launcher): consecutive groups of
    ``inference_parallel_size`` ranks feed one engine each, and the first rank of a group
    (``rank // ips * ips``) posts that group's handles to its own engine. ``None``: one engine
    fed by every rank, posted by rank 0.
    """
    ips = len(handles) if inference_parallel_size is None else int(inference_parallel_size)
    if ips <= 0 or len(handles) % ips:
        raise ConfigError(f"{len(handles)} ranks cannot form inference groups of {inference_parallel_size}")
    if not 0 <= rank < len(handles):
        raise ConfigError(f"rank {rank} is not one of the {len(handles)} ranks of the update")
    return list(handles[rank: rank + ips]) if rank % ips == 0 else None


def request_inference_to_update(url: str, socket_paths: dict[str, str], timeout: float = 300.0,
                                uds: str | None = None, *, method: str = "update_weights_from_ipc",
                                reset_prefix_cache: bool = True) -> None:
    """POST ``{"method": method, "args": [socket_paths]}`` to ``url`` (a vLLM ``/collective_rpc``).

    ``socket_paths`` maps device keys to ZeroMQ handles (``dict(handles)`` of
    ``req_func``). ``uds``: talk HTTP over that Unix socket. Then, unless
    ``reset_prefix_cache=False``, ``POST /reset_prefix_cache?reset_running_requests=true`` on the
    same server: KV blocks cached before the update were computed with the old weights, and a
    prompt that hits them would answer from those. An engine that has no such route (404 or 405:
    vLLM serves it only with ``VLLM_SERVER_DEV_MODE=1``, other engines may not at all) gets a
    warning, not a failed update: its weights were loaded. Raises a typed error on a transport
    failure, a timeout, a non-2xx answer of the update (with the server's text), or a reset the
    engine answered and refused.
    """
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ConfigError(f"url must be absolute (http://host:port/collective_rpc), got {url!r}")
    # vLLM's executor leaves the replies it did not read by its deadline to answer the next call: its
    # deadline outlasts the workers' own receive deadline (this call names none: the default).
    body = {"method": method, "args": [socket_paths], "timeout": max(timeout, _WORKER_TIMEOUT_S) + 60.0}
    with HttpTransport(f"{parts.scheme}://{parts.netloc}", uds=uds, timeout=timeout + 30.0) as http:
        http.raise_for_status(http.request("POST", parts.path or "/", json=body))
        if reset_prefix_cache:
            _reset_prefix_cache(http)


NO_ROUTE = (404, 405)   # the engine does not serve POST /reset_prefix_cache
_told_no_route: set[str] = set()   # engines already warned about (one line each, then debug)


def _reset_prefix_cache(http: HttpTransport) -> None:
    resp = http.request("POST", "/reset_prefix_cache", timeout=60.0, params={"reset_running_requests": "true"})
    if resp.status_code in NO_ROUTE:
        level = logging.DEBUG if http.where in _told_no_route else logging.WARNING
        _told_no_route.add(http.where)
        log.log(level, "%s answered HTTP %d to POST /reset_prefix_cache after the update: the weights are "
                "loaded, but a prefix cache it keeps may still answer cached prompts from the old weights (pass "
                "reset_prefix_cache=False where the engine has no such cache)", http.where, resp.status_code)
        return
    http.raise_for_status(resp)
    try:
        verdict = resp.json() if resp.content else {}
    except ValueError:   # a 2xx without JSON: no verdict to read
        verdict = {}
    if isinstance(verdict, dict) and verdict.get("success") is False:
        raise RemoteWorkerError(f"{http.where} refused to reset its prefix cache after the update: "
                                "cached prompts would answer from the old weights")
