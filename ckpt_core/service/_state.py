"""What the service knows between requests: the one long operation running, the last results.

Long operations (register, unregister, gather, update, load metas) run one at a time on a
single worker thread, never on the event loop, so ``/v1/healthz``, ``/v1/status`` and
``/metrics`` answer while they run. A second long operation while one runs is refused with
:class:`Busy` (HTTP 409): the ``ParameterServer`` is not meant to be driven from two threads,
and its collectives must be issued in the same order on every rank.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ckpt_core.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    CkptError,
    ClosedError,
    ConfigError,
    RemoteWorkerError,
    UpdateTimeoutError,
)
from ckpt_core.ops.log import rank_logger

from ._agree import ValidationError
from ._policy import Forbidden

# Bounds of what an answer (and /v1/status, which keeps the last error) may carry: a request naming
# 100,000 files must not come back as a 20 MB error, nor make every later status that large.
MAX_MESSAGE_CHARS = 2000
MAX_TRACEBACK_CHARS = 8000
_TRACEBACK_MARK = "\n--- remote traceback ---\n"   # how RemoteWorkerError appends it to its message

# Most specific first: UpdateTimeoutError is a TransportError, Forbidden and ValidationError (an agreed 422,
# _agree.py) ConfigErrors, ConfigError a ValueError.
_STATUS = ((UpdateTimeoutError, 504), (RemoteWorkerError, 502), (ClosedError, 503), (CheckpointNotFoundError, 404),
           (CheckpointFormatError, 422), (Forbidden, 403), (ValidationError, 422), (ConfigError, 400))
COLLECTIVE = ("gather", "update")   # operations every rank's service must be asked for


def status_of(exc: BaseException) -> int:
    """The HTTP status of an error: 4xx for the client's mistakes, 5xx for ours or a peer's."""
    if isinstance(exc, Busy):
        return 409
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return 500


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters cut]"


class Busy(Exception):
    """A long operation was asked for while another one runs."""

    def __init__(self, running: dict):
        super().__init__(f"{running['operation']} of {running.get('checkpoint')!r} is running "
                         f"(phase {running['phase']}, {time.time() - running['started_unix']:.1f} s so far); "
                         "try again when it has finished")
        self.running = running


def error_fields(exc: BaseException) -> dict:
    """The JSON form of an error, bounded: its class, message, and rank/device/traceback when it has them.
    A remote traceback is in ``remote_traceback`` only (the message is the error's first part)."""
    message = str(exc) if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"
    if getattr(exc, "remote_traceback", None):
        message = message.split(_TRACEBACK_MARK, 1)[0]
    out = {"type": type(exc).__name__ if isinstance(exc, CkptError) else "InternalError", "message": clip(message)}
    for key in ("rank", "device_key", "remote_traceback"):
        value = getattr(exc, key, None)
        if value is not None:
            out[key] = clip(value, MAX_TRACEBACK_CHARS) if isinstance(value, str) else value
    return out


class ServiceState:
    """Owns the worker thread and the bookkeeping of one rank's service. ``close()`` is idempotent."""

    def __init__(self, ps, metrics=None):
        self.ps, self.metrics = ps, metrics
        self.log = rank_logger(f"service rank {ps.rank}/{ps.world_size}")
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckpt-service-r{ps.rank}")
        self._lock = threading.Lock()
        self.running: dict | None = None
        self.updates = self.failures = 0
        self.last_error: dict | None = None   # cleared by the next operation that succeeds
        self.last_success: dict[str, float] = {}   # operation -> unix time it last succeeded
        self.closed = False
        self.liveness = None   # a _liveness.Liveness on a world of several ranks (serve starts it)

    def snapshot(self) -> dict | None:
        with self._lock:
            if self.running is None:
                return None
            return dict(self.running, elapsed_s=time.time() - self.running["started_unix"])

    def set_phase(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        """Progress of the running operation (called from the worker thread)."""
        with self._lock:
            if self.running is not None:
                self.running.update(phase=phase, done=done, total=total)

    async def run(self, operation: str, checkpoint: str | None, fn: Callable[[], Any], nbytes: int | None = None,
                  weight_version: str | None = None) -> Any:
        """Run ``fn`` on the worker thread as ``operation``; raise :class:`Busy` if one is running.

        The bookkeeping is cleared by the thread itself when ``fn`` returns, so a client that
        disconnects mid-update does not free the slot while the update still runs.
        """
        with self._lock:
            if self.running is not None:
                raise Busy(dict(self.running))
            self.running = {"operation": operation, "checkpoint": checkpoint, "phase": operation,
                            "started_unix": time.time(), "done": None, "total": None, "bytes": nbytes,
                            "waiting_for": None, "weight_version": weight_version}
        if self.metrics is not None:
            self.metrics.started()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, operation, checkpoint, fn)
        except RuntimeError:
            if self.closed:   # the executor refused: the service is shutting down
                with self._lock:
                    self.running = None
            raise

    def describe(self, operation: str) -> tuple[str | None, int | None]:
        """(checkpoint, bytes) of the running operation: for a progress log's start line."""
        running = self.snapshot() or {}
        return running.get("checkpoint"), running.get("bytes")

    def set_waiting(self, ranks: list[int] | None) -> None:
        """Peers that have not joined the running collective (the liveness thread tells)."""
        with self._lock:
            if self.running is not None:
                self.running["waiting_for"] = ranks

    def _call(self, operation: str, checkpoint: str | None, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
        except BaseException as exc:
            self._failed(operation, checkpoint, exc, time.perf_counter() - t0)
            raise
        else:
            seconds = time.perf_counter() - t0
            self._record(operation, checkpoint, result, seconds)
            return result
        finally:
            with self._lock:
                self.running = None

    def _failed(self, operation: str, checkpoint: str | None, exc: BaseException, seconds: float) -> None:
        """A client's mistake (4xx: bad name, bad file, misuse) is a rejection, logged at WARNING and not
        counted as a failure; anything else (5xx) is a failure, logged at ERROR."""
        rejected = status_of(exc) < 500
        with self._lock:
            self.failures += operation == "update" and not rejected
            self.last_error = dict(error_fields(exc), operation=operation, checkpoint=checkpoint,
                                   status=status_of(exc), at_unix=time.time())
        if self.metrics is not None:
            self.metrics.failed(operation, type(exc).__name__, seconds, rejected=rejected)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        (self.log.warning if rejected else self.log.error)(
            "phase=%s checkpoint=%s outcome=%s error=%s seconds=%.3f: %s", operation, checkpoint,
            "rejected" if rejected else "error", type(exc).__name__, seconds, clip(first, 500))
        try:   # a mark on any exception, ours or not: the route's error answer need not be logged again (_app.py)
            setattr(exc, "ckpt_logged", True)
        except AttributeError:   # one that takes no attributes (__slots__) is logged twice
            pass

    def _record(self, operation: str, checkpoint: str | None, result: Any, seconds: float) -> None:
        if operation == "register":   # register_checkpoint returns nothing: its figures are in last_register
            result = getattr(self.ps, "last_register", None)
        nbytes = result.get("bytes") if isinstance(result, dict) else None
        with self._lock:
            self.updates += operation == "update"
            self.last_error = None
            self.last_success[operation] = time.time()
        if self.metrics is not None:
            self.metrics.succeeded(operation, seconds, nbytes, result if operation == "update" else None,
                                   weight_version=(self.running or {}).get("weight_version"))
        rate = f" gbps={nbytes / max(seconds, 1e-9) / 1e9:.2f}" if nbytes else ""
        self.log.info("phase=%s checkpoint=%s outcome=ok bytes=%s seconds=%.3f%s", operation, checkpoint,
                      nbytes if nbytes is not None else "-", seconds, rate)

    def close(self, timeout: float = 10.0) -> bool:
        """Refuse new operations; wait up to ``timeout`` s for a running one. True when idle.

        A collective whose peers are gone can run until its own timeout: the caller decides what
        to do with a rank that is still busy (``ckpt-engine serve`` exits without waiting).
        """
        if not self.closed:
            self.closed = True
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.liveness is not None:
                self.liveness.close()
        deadline = time.monotonic() + timeout
        while self.snapshot() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        running = self.snapshot()
        if running is not None:
            self.log.warning("phase=stop %s of %r still running after %.0f s", running["operation"],
                             running.get("checkpoint"), timeout)
        return running is None
