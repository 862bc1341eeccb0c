"""A terminal progress bar for ``ParameterServer.progress`` (tqdm; silent when not a TTY).

Usage::

    ps.progress = TerminalProgress(f"rank {ps.rank}")   # bars for updates and registrations, on a terminal only
"""

from __future__ import annotations

import sys
import threading

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
        self._bar = None
        self._key = None   # what the open bar counts: ("update",) or ("register", phase)
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
