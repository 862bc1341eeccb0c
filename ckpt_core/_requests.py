"""Asking an inference engine to pull an update (the stock ``/collective_rpc`` call)."""

from __future__ import annotations

from .errors import ConfigError, RemoteWorkerError, TransportError, UpdateTimeoutError


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
                                uds: str | None = None, *, method: str = "update_weights_from_ipc") -> None:
    """POST ``{"method": method, "args": [socket_paths]}`` to ``url`` (a vLLM ``/collective_rpc``).

    ``socket_paths`` maps device keys to ZeroMQ handles (``dict(handles)`` of
    ``req_func``). ``uds``: talk HTTP over that Unix socket. Raises a typed error on
    a transport failure, a timeout, or a non-2xx answer (with the server's text).
    """
    import httpx

    transport = httpx.HTTPTransport(uds=uds) if uds else None
    body = {"method": method, "args": [socket_paths], "timeout": timeout}
    try:
        with httpx.Client(transport=transport, timeout=httpx.Timeout(timeout, connect=10.0)) as client:
            resp = client.post(url, json=body)
    except httpx.TimeoutException as exc:
        raise UpdateTimeoutError(f"{url} did not answer within {timeout} s") from exc
    except httpx.HTTPError as exc:
        raise TransportError(f"cannot reach {url}: {exc}") from exc
    if resp.status_code // 100 != 2:
        raise RemoteWorkerError(f"{url} answered HTTP {resp.status_code}", remote_traceback=resp.text[:20000])
