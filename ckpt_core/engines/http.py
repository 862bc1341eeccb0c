"""Engine-agnostic HTTP transport for requesters (TCP or a Unix socket), with typed errors.

Engine adapters (``ckpt_vllm``, ``ckpt_sglang``) build their requesters on :class:`HttpTransport`
and add their routes and their reading of status codes. The contract:

- ``request()`` returns the response whatever its status; it raises ``UpdateTimeoutError`` when
  no connection is made within ``connect_timeout`` or no answer comes within the request's
  timeout (both name the call), ``TransportError`` for any other transport failure, and
  ``ClosedError`` after ``close()``.
- A request that fails because a *pooled* keep-alive connection was reset or closed by the
  server before any response arrived (a server closes the connection after an error answer,
  or after its idle timeout) is sent once more, on a fresh connection. Nothing else is retried:
  a request that reached the server on a fresh connection is never sent twice.
- ``raise_for_status()`` turns a non-2xx answer into ``RemoteWorkerError`` with the server's text.
- :class:`Phases` times the named phases of one operation (requester-side seconds).

Example::

    with HttpTransport("http://127.0.0.1:30000", timeout=600) as http:
        phases = Phases()
        resp = phases.run("update", http.request, "POST", "/update", json={...})
        http.raise_for_status(resp)
        print(phases.seconds)   # {"update": 0.41}
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import httpx

from ckpt_core.errors import ClosedError, ConfigError, RemoteWorkerError, TransportError, UpdateTimeoutError

__all__ = ["HttpTransport", "Phases", "error_text", "cleanup_after"]

log = logging.getLogger("ckpt_core.http")

# Errors a server-side close of an idle pooled connection shows up as.
_RESET_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
_CONNECT_EVENTS = ("connection.connect_tcp.started", "connection.connect_unix_socket.started")


class HttpTransport:
    """HTTP/1.1 client of one server, over TCP or a Unix socket. Thread-safe; ``close()`` is idempotent.

    ``endpoint``: base URL (with ``uds`` only its host matters); ``timeout``: default seconds a
    request may take to be answered; ``connect_timeout``: seconds to establish a connection.
    """

    def __init__(self, endpoint: str = "http://localhost", *, uds: str | None = None,
                 timeout: float = 600.0, connect_timeout: float = 10.0):
        if timeout <= 0 or connect_timeout <= 0:
            raise ConfigError(f"timeouts must be positive, got timeout={timeout}, connect_timeout={connect_timeout}")
        self.endpoint = endpoint.rstrip("/") if endpoint else "http://localhost"
        self.uds, self.timeout, self.connect_timeout = uds, float(timeout), float(connect_timeout)
        self._http = self._new_client()
        self._closed = False
        self._lock = threading.Lock()
        self.retries = 0   # requests re-sent after a pooled connection was found dead (for tests/logs)

    @property
    def where(self) -> str:
        return f"{self.endpoint} (unix socket {self.uds})" if self.uds else self.endpoint

    def _new_client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        # never follow a redirect: the service checks the endpoint it posts to (service/_policy.py),
        # and an engine's 3xx must not lead the update elsewhere
        return httpx.Client(base_url=self.endpoint, transport=transport, follow_redirects=False,
                            timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._http.close()

    def __enter__(self) -> "HttpTransport":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, *, timeout: float | None = None, **kw) -> httpx.Response:
        """Send one request; ``timeout`` (seconds to the answer) defaults to the transport's.

        Other keyword arguments go to ``httpx.Client.request`` (``json``, ``params``, ...).
        """
        if self._closed:
            raise ClosedError(f"this HTTP client of {self.where} is closed")
        wait = self.timeout if timeout is None else float(timeout)
        limits = httpx.Timeout(wait, connect=self.connect_timeout)
        events: list[str] = []
        try:
            try:
                return self._http.request(method, path, timeout=limits,
                                          extensions={"trace": lambda name, info: events.append(name)}, **kw)
            except _RESET_ERRORS as exc:
                reused = not any(e in _CONNECT_EVENTS for e in events)
                answered = "http11.receive_response_headers.complete" in events
                if not reused or answered:
                    raise
                self.retries += 1
                log.info("%s %s on %s: the pooled connection was closed by the server (%s); "
                         "sending again on a fresh connection", method, path, self.where, type(exc).__name__)
                with self._new_client() as fresh:
                    return fresh.request(method, path, timeout=limits, **kw)
        except httpx.ConnectTimeout as exc:
            raise UpdateTimeoutError(f"{method} {path} on {self.where}: no connection within "
                                     f"{self.connect_timeout:g} s (connect_timeout)") from exc
        except httpx.TimeoutException as exc:
            raise UpdateTimeoutError(f"{method} {path} on {self.where}: no answer within {wait:g} s") from exc
        except httpx.HTTPError as exc:
            raise TransportError(f"{method} {path} on {self.where}: {type(exc).__name__}: {exc}") from exc

    def raise_for_status(self, resp: httpx.Response) -> httpx.Response:
        """``resp`` if its status is 2xx, else ``RemoteWorkerError`` naming the call, with the server's text."""
        if resp.status_code // 100 != 2:
            req = resp.request
            raise RemoteWorkerError(f"{req.method} {req.url.path} on {self.where} answered HTTP {resp.status_code}: "
                                    f"{error_text(resp)}", remote_traceback=resp.text[-20000:])
        return resp


class Phases:
    """Seconds spent in each named phase of one operation, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Call ``fn(*args, **kwargs)``, add its duration to ``seconds[name]`` (also when it raises)."""
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def error_text(resp: httpx.Response) -> str:
    """The message of an error answer: ``{"error": {"message"}}``, ``{"detail"}``, ``{"message"}`` or the text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:2000]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:4000]
    return str(body)[:2000]


def cleanup_after(exc: BaseException, what: str, where: str, fn) -> None:
    """Run a cleanup step after ``exc``; its own failure is noted on ``exc``, never raised."""
    try:
        fn()
    except Exception as cleanup:   # noqa: BLE001 - the original error is the one to raise
        exc.add_note(f"cleanup: {what} on {where} failed too: {type(cleanup).__name__}: {cleanup}")
