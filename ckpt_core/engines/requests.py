"""Asking an inference engine to pull an update (the stock ``/collective_rpc`` call)."""

from __future__ import annotations

from urllib.parse import urlsplit

from ckpt_core.engines.http import HttpTransport
from ckpt_core.errors import ConfigError, RemoteWorkerError


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
    prompt that hits them would answer from those. Raises a typed error on a transport failure,
    a timeout, a non-2xx answer (with the server's text), or a refused reset.
    """
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        raise ConfigError(f"url must be absolute (http://host:port/collective_rpc), got {url!r}")
    body = {"method": method, "args": [socket_paths], "timeout": timeout}
    with HttpTransport(f"{parts.scheme}://{parts.netloc}", uds=uds, timeout=timeout + 30.0) as http:
        http.raise_for_status(http.request("POST", parts.path or "/", json=body))
        if reset_prefix_cache:
            resp = http.raise_for_status(http.request("POST", "/reset_prefix_cache", timeout=60.0,
                                                      params={"reset_running_requests": "true"}))
            if resp.content and resp.json().get("success") is False:
                raise RemoteWorkerError(f"{http.where} refused to reset its prefix cache after the update: "
                                        "cached prompts would answer from the old weights")
