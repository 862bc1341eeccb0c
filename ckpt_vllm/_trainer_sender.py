"""Rank 0's side of a trainer round of the ``ckpt`` vLLM backend: its requests to the engine.

Runs inside the round's ``ParameterServer.update`` (in the update's request thread), so whatever
fails here reaches every trainer rank as the same error (see :mod:`ckpt_vllm.trainer`). Requests go
through the trainer's ``VLLMWeightSyncClient`` (vLLM's four routes) and, for what that protocol
lacks (prefix-cache reset, stage/commit, slice plans), through a :class:`ckpt_vllm.VllmClient`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from ckpt_core.engines.base import mixed_weight_version
from ckpt_core.errors import CkptError, RemoteWorkerError, TransportError, UpdateTimeoutError

__all__ = ["Sender", "endpoint_of", "own_http", "translated"]

log = logging.getLogger("ckpt_vllm")


def endpoint_of(info, client) -> str | None:
    return info.engine_url or getattr(client, "base_url", None)


def own_http(client):
    """The client's own ckpt_vllm.VllmClient (``VllmSyncClient.http``: also over a Unix socket), or None."""
    from .client import VllmClient

    own = getattr(client, "http", None)
    return own if isinstance(own, VllmClient) else None


class Sender:
    """Rank 0's requests to the engine, translated into ckpt-engine's errors.

    One round at a time: a round whose requests still wait for an answer (the engine froze) when
    the next begins makes the next wait for it, up to the round's timeout, then refuse. A round
    whose PS update already ended (``ended``: failed or timed out) posts nothing more; a weight
    update it opened meanwhile is finished, so the engine is left out of any session.
    """

    def __init__(self, info) -> None:
        self.info = info
        self._http: dict[str, Any] = {}   # endpoint -> ckpt_vllm.VllmClient (reset, stage, slices)
        self._initialized: list = []   # the clients that posted /init_weight_transfer_engine (kept: by identity)
        self._busy = threading.Lock()

    def http(self, client):
        """A VllmClient of the server (the routes vLLM's client protocol lacks), or None."""
        own = own_http(client)
        if own is not None and self.info.engine_url is None:
            return own
        endpoint = endpoint_of(self.info, client)
        if endpoint is not None and endpoint not in self._http:
            from .client import VllmClient

            self._http[endpoint] = VllmClient(endpoint, timeout=self.info.timeout_s)
        return self._http.get(endpoint) if endpoint is not None else None

    def round(self, client, handles, version: str, slices: str | None, ended: threading.Event,
              commit: bool = True) -> None:
        where = endpoint_of(self.info, client) or type(client).__name__
        if not self._busy.acquire(timeout=float(self.info.timeout_s)):
            raise TransportError(f"the previous round's requests to {where} still wait for an answer; no new "
                                 "round starts until they end (bounded by the client's own timeout)")
        try:
            calls = _Calls(client, where, ended)
            if self.info.stage:
                self._staged(client, handles, version, slices, commit)
            else:
                self._direct(calls, client, handles, version, slices)
        finally:
            self._busy.release()

    def _direct(self, calls: "_Calls", client, handles, version: str, slices: str | None) -> None:
        t = float(self.info.timeout_s)
        if not any(c is client for c in self._initialized):
            calls("init_weight_transfer_engine", client.init_weight_transfer_engine, {"timeout_s": t})
            self._initialized.append(client)
        info = {"zmq_handles": dict(handles), "timeout_s": t, "check_complete": True}
        if slices is not None:
            info["slices"] = slices
        calls("start_weight_update", client.start_weight_update)
        try:
            calls("update_weights", client.update_weights, info)
        except _Ended:   # opened after the update ended: close the session, post nothing else
            calls.cleanup("finish_weight_update", client.finish_weight_update)
            raise
        except Exception:   # posted: layers reloaded before the failure hold the new weights (a mix is assumed)
            http = self.http(client)
            if http is not None:   # vLLM's own weight version must not keep naming the old one
                calls.cleanup("weight_version", lambda: http.set_weight_version(mixed_weight_version(version)))
            raise
        # (vLLM's worker ends its session itself when /update_weights fails: no finish then)
        calls("finish_weight_update", client.finish_weight_update, *_version_arg(client.finish_weight_update, version))
        http = self.http(client)
        if self.info.reset_prefix_cache and http is not None:
            http.ensure_prefix_cache_reset()   # its KV blocks were computed with the old weights

    def _staged(self, client, handles, version: str, slices: str | None, commit: bool) -> None:
        self.http(client).stage(dict(handles), version, timeout=float(self.info.timeout_s), slices=slices)
        if commit:   # the engine kept generating while it staged; the pause is the reload alone
            self.commit(client, version)

    def commit(self, client, version: str):
        return self.http(client).commit(version, pause=self.info.commit_pause, timeout=float(self.info.timeout_s))

    def close(self) -> None:
        for http in self._http.values():
            http.close()
        self._http.clear()


def _version_arg(finish, version: str) -> tuple:
    """``(version,)`` for a client whose ``finish_weight_update`` takes the weight version (vLLM >= 0.28's
    clients, ours); ``()`` for vLLM 0.26's, whose ``finish_weight_update()`` takes nothing (called with
    the version it would fail with a TypeError after the weights were loaded)."""
    try:
        params = inspect.signature(finish).parameters.values()
    except (TypeError, ValueError):   # no signature to read (a C function, a proxy): pass it
        return (version,)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                  inspect.Parameter.VAR_POSITIONAL)
    return (version,) if any(p.kind in positional for p in params) else ()


class _Ended(TransportError):
    """The round's PS update ended while a request of it waited: nothing more is posted."""


class _Calls:
    """Calls of one round through the client: errors translated, none posted after the update ended."""

    def __init__(self, client, where: str, ended: threading.Event) -> None:
        self.client, self.where, self.ended = client, where, ended

    def __call__(self, what: str, fn, *args) -> Any:
        if self.ended.is_set():
            raise _Ended(f"the update ended before {what} was posted to {self.where}")
        try:
            return fn(*args)
        except CkptError:
            raise
        except Exception as exc:   # the client's transport is the caller's choice: translated here
            raise translated(what, self.where, exc) from exc

    def cleanup(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as exc:   # noqa: BLE001 - best effort: the round failed already
            log.warning("after a failed round, %s on %s failed too: %s: %s", what, self.where, type(exc).__name__, exc)


def translated(what: str, where: str, exc: Exception) -> CkptError:
    """A client's failure (``requests``, Ray, anything) as one of ckpt-engine's errors."""
    kind = type(exc).__name__
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        text = getattr(response, "text", "") or ""
        return RemoteWorkerError(f"{what} on {where} answered HTTP {status}: {text[:2000]}")
    if "Timeout" in kind or isinstance(exc, TimeoutError):
        return UpdateTimeoutError(f"{where} did not answer {what} in time ({kind}: {exc})")
    if "Connection" in kind or isinstance(exc, OSError):
        return TransportError(f"cannot reach {where} for {what} ({kind}: {exc})")
    return RemoteWorkerError(f"{what} on {where} failed: {kind}: {exc}")
