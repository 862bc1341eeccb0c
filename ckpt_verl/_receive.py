"""A rollout worker's receiving end: ckpt_core's P2P update, its engine-side loop in this process,
and the buckets handed to verl's rollout as an async stream of ``(name, tensor)``.

The update (``ParameterServer.update(..., ranks=[every rank of this rollout world])``) runs in
a thread. Its ``req_func`` runs ckpt_core's worker loop (``update_weights_from_ipc``) here, in
the same process, on the PS rank's own IPC buffer, so a bucket's bytes are read once from the
trainer ranks' host memory into this device's buffer and the rollout reads them where they
landed. Each bucket is handed to the event loop as views of the buffer; its slot is released when
the consumer asks for the next bucket (the views are valid until then: verl's rollouts copy each
tensor into their own bucket as they go, as with verl's NCCL backend). Meanwhile the pipeline
reads and broadcasts the next buckets into the other slots.

Every wait has a deadline (``timeout_s``); a consumer that stops reading early, or raises, makes
the update fail on every rank of the rollout world (the PS's agreement), never hang.
"""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from ckpt_core import update_weights_from_ipc
from ckpt_core.errors import CkptError, TransportError, UpdateTimeoutError

_END = object()


class BucketStream:
    """One round's receive on this rollout worker; iterate it with ``async for``."""

    def __init__(self, ps, name: str, timeout_s: float):
        self.ps, self.name, self.timeout_s = ps, name, timeout_s
        self.result: dict | None = None
        self.buckets = 0
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._released = threading.Event()
        self._stopped: str | None = None   # set when the consumer left: the worker loop fails its bucket
        self._zmq = zmq.Context()
        self._thread = threading.Thread(target=self._update, name=f"ckpt-verl-receive-{ps.rank}", daemon=True)

    def start(self) -> "BucketStream":
        self._thread.start()
        return self

    # -- the update's thread ------------------------------------------------------
    def _update(self) -> None:
        try:
            out = self.ps.update(self.name, self._req_func, ranks=list(range(self.ps.world_size)),
                                 timeout=self.timeout_s)
        except BaseException as exc:   # noqa: BLE001 - handed to the consumer, which raises it
            out = exc
        self._put(out)
        self._put(_END)

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:   # the loop is closed: nobody is reading any more
            pass

    def _req_func(self, handles) -> None:
        _, handle = handles[self.ps.rank]
        update_weights_from_ipc(self._zmq, handle, self.ps.device_index, run=self._hand_over,
                                timeout=self.timeout_s)

    def _hand_over(self, weights) -> None:
        """Runs in the worker loop per bucket: the views go to the consumer; return once it is done."""
        if self._stopped:
            raise TransportError(self._stopped)
        self._released.clear()
        self._put(weights)
        if not self._released.wait(self.timeout_s):
            raise UpdateTimeoutError(f"verl's rollout did not take bucket {self.buckets} within "
                                     f"{self.timeout_s:.0f} s")
        if self._stopped:
            raise TransportError(self._stopped)

    # -- the consumer (verl's event loop) ------------------------------------------
    async def __aiter__(self):
        deadline = time.monotonic() + self.timeout_s + 5.0   # the update's own deadline ends it first
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(self._queue.get(), max(left, 0.001))
                except asyncio.TimeoutError:
                    raise UpdateTimeoutError(f"no bucket and no verdict from the update within "
                                             f"{self.timeout_s:.0f} s") from None
                if isinstance(item, list):
                    for name, tensor in item:
                        yield name, tensor
                    self.buckets += 1
                    self._released.set()
                    continue
                if isinstance(item, BaseException):
                    raise item if isinstance(item, CkptError) else TransportError(f"{type(item).__name__}: {item}")
                self.result = item
                await self._queue.get()   # _END
                return
        finally:
            if self._thread.is_alive():
                self._stopped = self._stopped or "verl's rollout stopped reading the weights mid-update"
                self._released.set()
                await asyncio.to_thread(self._thread.join, self.timeout_s + 5.0)
            if not self._thread.is_alive():   # term() would wait for a socket still open in that thread
                self._zmq.term()
