"""How the ranks of one update learn, without a collective, that they should stop waiting.

``req_func`` runs in a thread on every rank; a rank whose worker or whose
``req_func`` failed publishes that in the rendezvous store. Every rank's waits poll ``StopSignal.should_stop``
so that nobody waits for its own worker until the deadline once the update is
lost anyway. The final verdict is still the ranks' status exchange (``_agree``).
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Callable

from ckpt_core.wire.link import Failure

STORE_CHECK_INTERVAL_S = 0.02   # a store round trip per poll would tax every bucket


def is_echo(f: Failure) -> bool:
    """A failure caused by another rank's failure (the cause is reported instead)."""
    return f.message.startswith("stopped while") or f.message.startswith("req_func raised")


def causes(failed: list[Failure]) -> list[Failure]:
    """The failures to report: engine workers' own failures first; else the ranks whose
    req_func raised (rather than the ranks that merely stopped because of them); else all."""
    return ([f for f in failed if not is_echo(f)]
            or [f for f in failed if f.message.startswith("req_func")] or failed)


def req_func_failure(rank: int, device_key: str, error: str) -> Failure:
    """The failure of a ``req_func`` that raised: its message names the cause (the exception's last
    line: which URL, which error), not only that it raised; the whole traceback rides along."""
    return Failure(rank, device_key, f"req_func raised: {last_line(error)}", error)


def last_line(tb: str | None) -> str:
    """The exception line of a formatted traceback (``ConnectError: [Errno 111] Connection refused``),
    at most 600 characters."""
    lines = [x for x in (tb or "").strip().splitlines() if x.strip()]
    return lines[-1].strip()[:600] if lines else "(no traceback)"


class ReqThread(threading.Thread):
    """Runs req_func and keeps its traceback text; daemon so a stuck engine never blocks exit."""

    def __init__(self, fn: Callable, handles):
        super().__init__(name="ckpt-req-func", daemon=True)
        self.fn, self.handles = fn, handles
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.fn(list(self.handles))
        except BaseException:
            self.error = traceback.format_exc()


class StopSignal:
    """The update's abort flag in the rendezvous store (one key per update)."""

    def __init__(self, store, key: str, rank: int, req: ReqThread | None, log):
        self.store, self.key, self.rank, self.req, self.log = store, key, rank, req, log
        self._last_check = 0.0
        self._req_published = False

    def should_stop(self) -> str | None:
        """Why this rank should stop waiting for its worker, or None."""
        if self.req is not None and self.req.error is not None:
            if not self._req_published:   # once: every poll would be a store round trip
                self._req_published = True
                self._set(f"rank {self.rank}: req_func raised: {last_line(self.req.error)}"[:500])
            return f"req_func raised: {last_line(self.req.error)}"
        now = time.monotonic()
        if self.store is None or now - self._last_check < STORE_CHECK_INTERVAL_S:
            return None
        self._last_check = now
        try:
            if self.store.check([self.key]):
                return f"another rank failed first ({self.store.get(self.key).decode(errors='replace')})"
        except Exception as exc:  # the store lives in rank 0's process
            return f"the rendezvous store is unreachable (did rank 0 die?): {exc}"
        return None

    def publish(self, failure: Failure) -> None:
        """Tell the other ranks at once, so they stop waiting for their own workers."""
        self._set(f"rank {self.rank}: {failure.message}"[:500])

    def close(self) -> None:
        """The update ended: let go of the store. A failed update's traceback keeps its frames, and
        with them this signal, alive; holding the store there kept rank 0's rendezvous port
        listening until ``close()`` gave up waiting for it."""
        self.store = self.req = None

    def _set(self, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self.key, value)
        except Exception as exc:  # the store going away is reported by the next collective
            self.log.warning("could not publish the failure to the other ranks: %s", exc)
