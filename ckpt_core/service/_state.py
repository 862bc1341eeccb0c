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

from ckpt_core.errors import CkptError
from ckpt_core.ops.log import rank_logger


class Busy(Exception):
    """A long operation was asked for while another one runs."""

    def __init__(self, running: dict):
        super().__init__(f"{running['operation']} of {running.get('checkpoint')!r} is running "
                         f"(phase {running['phase']}, {time.time() - running['started_unix']:.1f} s so far); "
                         "try again when it has finished")
        self.running = running


def error_fields(exc: BaseException) -> dict:
    """The JSON form of an error: its class, message, and rank/device/traceback when it has them."""
    out = {"type": type(exc).__name__ if isinstance(exc, CkptError) else "InternalError",
           "message": str(exc) if isinstance(exc, CkptError) else f"{type(exc).__name__}: {exc}"}
    for key in ("rank", "device_key", "remote_traceback"):
        value = getattr(exc, key, None)
        if value is not None:
            out[key] = value
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
        self.last_error: dict | None = None
        self.closed = False

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

    async def run(self, operation: str, checkpoint: str | None, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread as ``operation``; raise :class:`Busy` if one is running.

        The bookkeeping is cleared by the thread itself when ``fn`` returns, so a client that
        disconnects mid-update does not free the slot while the update still runs.
        """
        with self._lock:
            if self.running is not None:
                raise Busy(dict(self.running))
            self.running = {"operation": operation, "checkpoint": checkpoint, "phase": operation,
                            "started_unix": time.time(), "done": None, "total": None}
        if self.metrics is not None:
            self.metrics.started()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, operation, checkpoint, fn)
        except RuntimeError:
            if self.closed:   # the executor refused: the service is shutting down
                with self._lock:
                    self.running = None
            raise

    def _call(self, operation: str, checkpoint: str | None, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
        except BaseException as exc:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.failures += operation == "update"
                self.last_error = dict(error_fields(exc), operation=operation, checkpoint=checkpoint)
            if self.metrics is not None:
                self.metrics.failed(operation, type(exc).__name__, seconds)
            self.log.error("phase=%s checkpoint=%s outcome=error error=%s seconds=%.3f", operation, checkpoint,
                           type(exc).__name__, seconds)
            raise
        else:
            seconds = time.perf_counter() - t0
            self._record(operation, checkpoint, result, seconds)
            return result
        finally:
            with self._lock:
                self.running = None

    def _record(self, operation: str, checkpoint: str | None, result: Any, seconds: float) -> None:
        nbytes = result.get("bytes") if isinstance(result, dict) else None
        if operation == "update":
            with self._lock:
                self.updates += 1
        if self.metrics is not None:
            self.metrics.succeeded(operation, seconds, nbytes, result if operation == "update" else None)
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
        deadline = time.monotonic() + timeout
        while self.snapshot() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        running = self.snapshot()
        if running is not None:
            self.log.warning("phase=stop %s of %r still running after %.0f s", running["operation"],
                             running.get("checkpoint"), timeout)
        return running is None
