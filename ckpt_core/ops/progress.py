"""Progress of long operations for ``ParameterServer.progress``: a terminal bar (:class:`TerminalProgress`,
tqdm; silent when not a TTY) or log lines (:class:`LogProgress`, for stderr that is a file or a pipe).

Usage::

    ps.progress = TerminalProgress(f"rank {ps.rank}")   # bars for updates and registrations, on a terminal only
    ps.progress = LogProgress(f"ps rank {ps.rank}/{ps.world_size}")   # a start line, then one every 10 s
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

try:
    from tqdm import tqdm as _tqdm
except ImportError:   # optional (extra "server")
    _tqdm = None


class TerminalProgress:
    """Draws a bar per update (buckets handed to the engine) and per registration phase (bytes
    faulted in, pinned, copied or mapped); a no-op unless ``stream`` is a TTY."""

    def __init__(self, label: str, stream=None, *, force: bool = False):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _tqdm is not None and (force or bool(getattr(self.stream, "isatty", lambda: False)()))
        self.label = label
        self._bar: Any = None   # a tqdm bar while one is open
        self._key: tuple[str, ...] | None = None   # what the open bar counts: ("update",) or ("register", phase)
        self._lock = threading.Lock()

    def __call__(self, operation: str, phase: str, done: int | None, total: int | None) -> None:
        if not self.enabled:
            return
        with self._lock:
            key = (operation, phase) if operation == "register" else (operation,)
            if self._bar is not None and (key != self._key or phase in ("plan", "gather")):
                self._close()
            if total and self._bar is None:
                self._key = key
                if operation == "register":
                    self._bar = _tqdm(total=total, desc=f"{self.label} register: {phase}", unit="B",
                                      unit_scale=True, unit_divisor=1024, file=self.stream, leave=False,
                                      dynamic_ncols=True)
                else:
                    self._bar = _tqdm(total=total, desc=f"{self.label} {operation}", unit="bucket",
                                      file=self.stream, leave=False, dynamic_ncols=True)
            if self._bar is not None:
                if operation != "register":
                    self._bar.set_postfix_str(phase, refresh=False)
                if done is not None:
                    self._bar.update(done - self._bar.n)
                if phase in ("post-hook", "done"):
                    self._close()

    def _close(self) -> None:
        self._bar.close()
        self._bar, self._key = None, None


START_PHASES = ("validate", "plan")   # the first phase of a registration, of an update


class LogProgress:
    """Progress for production logs (stderr not a terminal): one INFO line when an operation starts
    (rank, phase, checkpoint and its bytes when known) and one every ``every_s`` seconds while it runs
    (done/total, rate), so that a ten-minute update is never silent. ``every_s`` defaults to
    ``CKPT_PROGRESS_LOG_S`` (10 s; 0 turns the periodic lines off, the start line stays).

    ``describe(operation)``: optional, returns ``(checkpoint, bytes)`` of the operation about to start
    (the service tells it); called once per operation, on the working thread.
    """

    def __init__(self, who: str, *, every_s: float | None = None, describe=None, clock=time.monotonic):
        from ckpt_core._settings import progress_log_s
        from ckpt_core.ops.log import rank_logger
        self.log = rank_logger(who)
        self.every_s = progress_log_s() if every_s is None else every_s
        self.describe, self.clock = describe, clock
        self._op: str | None = None       # the operation whose start was logged
        self._t0 = self._last = 0.0
        self._lock = threading.Lock()

    def begin(self, operation: str, checkpoint: str | None = None, nbytes: int | None = None) -> None:
        """Log the start of ``operation`` now (the service calls it before the work begins)."""
        with self._lock:
            self._op = operation
            self._t0 = self._last = self.clock()
        self.log.info("phase=%s checkpoint=%s outcome=started bytes=%s", operation, checkpoint,
                      nbytes if nbytes is not None else "-")

    def __call__(self, operation: str, phase: str, done: int | None, total: int | None) -> None:
        if phase == "done" or phase == "post-hook":
            with self._lock:
                self._op = None
            return
        if self._op != operation or phase in START_PHASES:
            checkpoint, nbytes = self.describe(operation) if self.describe is not None else (None, None)
            self.begin(operation, checkpoint, nbytes)
        now = self.clock()
        with self._lock:
            due = self.every_s > 0 and now - self._last >= self.every_s
            if due:
                self._last = now
        if due:
            where = f" {done}/{total}" if total else ""
            unit = " bytes" if operation == "register" else " buckets"
            self.log.info("phase=%s step=%s progress%s%s elapsed_s=%.1f", operation, phase, where,
                          unit if total else "", now - self._t0)
