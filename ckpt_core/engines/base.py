"""The engine seam: what the service and the drivers call on an engine, and the HTTP requester base.

An engine package (``ckpt_vllm``, ``ckpt_sglang``, a third party's) plugs in with two objects:

- an :class:`EngineKind`, found by name through the entry-point group ``ckpt_core.engines``
  (``registry.py``): the routes an ``update_url`` may name (the service's policy), the request
  options it takes and validates, the commit pauses it knows, the wire its workers speak, and
  a factory of clients;
- an :class:`EngineClient`, one per engine server: ``update``, ``stage``, ``commit``, ``close``,
  and optionally ``slice_plan`` (engines whose workers record what their loaders read) and
  ``precheck`` (a refusal asked on every rank before anything moves).

:class:`Requester` holds the HTTP plumbing every client repeats (one transport, ``where``,
``close`` and the context manager, a 404 read as a route the server does not serve, JSON posts,
readiness polling, the last report); a client adds its routes. :class:`UpdateReport` is what
every engine call returns. :class:`Prechecked` is a ``req_func`` that carries its engine's ``precheck``.

Nothing here imports an engine: the core finds them by name, never by import.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Mapping, Optional, Protocol, Self, TypeGuard, TypeVar, runtime_checkable

import httpx

from ckpt_core.engines.http import HttpTransport, cleanup_after, error_text
from ckpt_core.errors import ConfigError, TransportError, UpdateTimeoutError

__all__ = ["UpdateReport", "EngineClient", "EngineKind", "Requester", "Prechecked", "check_option_names",
           "supports_slices", "mixed_weight_version"]

R = TypeVar("R")


def mixed_weight_version(version: str) -> str:
    """The engine's own weight version (the one it reports on its outputs) after an update or commit to
    ``version`` failed once a worker had begun writing: its weights may be a mix of two versions, and
    what it generates until the next full update must not carry the old version's name."""
    return f"mixed: the update to {version!r} failed part-way (push a full update)"


@dataclass
class UpdateReport:
    """What one engine call cost on the engine side.

    ``path``: how it went (vLLM: ``extension``, ``backend``, ``stage``, ``commit``; empty where an
    engine has one way); ``seconds``: per phase, as the requester saw it; ``workers``: what each
    worker (or TP rank) answered, where the engine reports it; ``message``: the server's text;
    ``busy``: the cache flush had to wait for a pause (SGLang).
    """

    path: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    workers: list = field(default_factory=list)
    message: str = ""
    busy: bool = False


@runtime_checkable
class EngineClient(Protocol):
    """The requester of one engine server, as the service and the drivers call it.

    ``handles``: ``[(device_key, zmq_handle)]`` (or a dict) of the ranks feeding this engine.
    Engine-specific keyword options (validated by the engine's :class:`EngineKind`) follow the
    common ones. Optional methods: ``slice_plan(tensors, *, reuse=None) -> SlicePlan`` (engines
    whose workers record what their loaders read, for sliced updates) and ``precheck()`` (a
    ``CkptError`` when the engine cannot take the update at all, asked before anything moves).
    A client is its own context manager: leaving it closes it.

    ``stage`` takes ``timeout`` and ``device_bytes`` beside its engine's options. Written
    ``*args: Any, **options: Any``, the options are whatever keywords the engine's client declares
    (mypy reads that tail as "any further parameters"): its :class:`EngineKind` validates them.
    """

    def update(self, handles, *args: Any, **options: Any) -> Optional[UpdateReport]: ...

    def stage(self, handles, version: str, *args: Any, **options: Any) -> UpdateReport: ...

    def commit(self, version: str, *, pause: str, timeout: float | None = None) -> UpdateReport: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


class SlicingClient(EngineClient, Protocol):
    """An :class:`EngineClient` whose engine's workers record what their loaders read (:func:`supports_slices`).
    ``slice_plan`` returns a ``planning.slices.SlicePlan`` (``reuse``: the one it returned before), which
    this seam only passes on: typed ``object`` here, since the engine seam imports no other leaf."""

    def slice_plan(self, tensors: dict, *, reuse: object = None) -> object: ...


class EngineKind(Protocol):
    """One kind of inference engine, found by ``name`` (``registry.get_engine``).

    ``routes``: the URL paths an ``update_url`` may end in (``""``: the server's base URL), which
    the service's policy allows. ``commit_pauses``: the pauses a commit may take, the first the
    default. ``options``: the request fields beyond the common ones that this engine takes.
    """

    name: str
    routes: tuple[str, ...]
    commit_pauses: tuple[str, ...]
    options: tuple[str, ...]

    def check_options(self, given: Mapping[str, Any], *, staged: bool) -> None:
        """``ConfigError`` naming an option (of ``given``, the options a request set) this engine
        does not take, or takes only in another kind of update (``staged``: a staged update)."""

    def check_wire(self, wire: str) -> None:
        """``ConfigError`` unless this engine's workers speak ``wire`` (the PS's: native, stock, ...)."""

    def client(self, update_url: str, *, uds: str | None, timeout: float) -> EngineClient:
        """The client of the engine at ``update_url`` (already allowed by the service's policy)."""


def check_option_names(kind: EngineKind, given: Mapping[str, Any]) -> None:
    """``ConfigError`` naming the options of ``given`` that ``kind`` does not take (``kind.options``)."""
    unknown = sorted(set(given) - set(kind.options))
    if unknown:
        raise ConfigError(f"{' and '.join(unknown)} {'does' if len(unknown) == 1 else 'do'} not apply to "
                          f"engine={kind.name!r} (its options: {', '.join(kind.options) or 'none'})")


class Prechecked(Generic[R]):
    """A ``req_func`` (``fn``) that carries its engine's ``precheck`` (None: it has none), which
    ``ParameterServer.update`` asks on every rank before anything moves: a ``CkptError`` it raises
    refuses the update on every rank at once (``transfer/prechecks.req_precheck``)."""

    def __init__(self, fn: Callable[[list[tuple[str, str]]], R], precheck: Callable[[], object] | None) -> None:
        self.fn, self.precheck = fn, precheck

    def __call__(self, handles: list[tuple[str, str]]) -> R:
        return self.fn(handles)


def supports_slices(client: EngineClient) -> TypeGuard[SlicingClient]:
    """Whether ``client``'s engine records slice plans (``slice_plan``)."""
    return callable(getattr(client, "slice_plan", None))


class Requester:
    """The HTTP plumbing of an engine's requester. Thread-safe; ``close()`` is idempotent.

    Subclasses set ``READY_ROUTE`` (polled by :meth:`wait_ready`) and may override
    :meth:`not_served` (the hint of a 404). ``http`` is the :class:`HttpTransport`;
    ``last_report`` the last :class:`UpdateReport` recorded with :meth:`_record`.
    """

    READY_ROUTE = "/health"

    def __init__(self, endpoint: str, *, uds: str | None = None, timeout: float = 600.0,
                 connect_timeout: float = 10.0):
        self.http = HttpTransport(endpoint, uds=uds, timeout=timeout, connect_timeout=connect_timeout)
        self.endpoint, self.uds = self.http.endpoint, uds
        self.timeout, self.connect_timeout = self.http.timeout, self.http.connect_timeout
        self._lock = threading.Lock()
        self.last_report: UpdateReport | None = None

    @property
    def where(self) -> str:
        return self.http.where

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def not_served(self, path: str) -> str:
        """What to say after "``path`` is not served by ... (HTTP 404)": how to make the server serve it."""
        return ""

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw) -> httpx.Response:
        """One request; a 404 is a ``ConfigError`` (the server does not serve ``path``), any other
        non-2xx a ``RemoteWorkerError`` with the server's text."""
        resp = self.http.request(method, path, timeout=timeout, **kw)
        if resp.status_code == 404:
            hint = self.not_served(path)
            raise ConfigError(f"{path} is not served by {self.where} (HTTP 404){': ' + hint if hint else ''}")
        return self.http.raise_for_status(resp)

    def _post(self, path: str, body: dict | None = None, *, timeout: float | None = None, **kw) -> Any:
        """POST ``body`` as JSON; the answer's JSON (None when it is empty)."""
        resp = self._request("POST", path, json=body, timeout=timeout, **kw)
        return resp.json() if resp.content else None

    def _cleanup(self, exc: BaseException, what: str, fn: Callable[[], Any]) -> None:
        cleanup_after(exc, what, self.where, fn)

    def _record(self, report: UpdateReport) -> UpdateReport:
        with self._lock:
            self.last_report = report
        return report

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5,
                   alive: Callable[[], bool] | None = None) -> float:
        """Poll ``GET READY_ROUTE`` until it answers 200; returns the seconds waited.

        ``alive()`` (e.g. "the server process has not exited") stops the wait early.
        """
        t0 = time.monotonic()
        last = "no answer yet"
        while True:
            try:
                resp = self.http.request("GET", self.READY_ROUTE, timeout=min(5.0, timeout))
                if resp.status_code == 200:
                    return time.monotonic() - t0
                last = f"HTTP {resp.status_code}: {error_text(resp)[:200]}"
            except (TransportError, UpdateTimeoutError) as exc:
                last = str(exc)
            if alive is not None and not alive():
                raise TransportError(f"{self.where} went away while waiting for it to be ready ({last})")
            if time.monotonic() - t0 > timeout:
                raise UpdateTimeoutError(f"{self.where} was not ready within {timeout:g} s (GET {self.READY_ROUTE}; "
                                         f"last: {last})")
            time.sleep(interval)
