"""The stock checkpoint-engine worker loop, as our loader runs it inside SGLang's scheduler process.

SGLang's own ``/update_weights_from_ipc`` runs ``checkpoint_engine.worker.update_weights_from_ipc``
(the stock package) with ``run=model.load_weights``; the parameter server feeding it speaks the
stock wire (``ParameterServer(wire="stock")``). Our loader's ``stage`` and ``load`` ops run the very
same loop, so one PS feeds all three; only ``run`` differs (copy into a staging area, or SGLang's
``load_weights``). Two things change around it, both for speed inside a busy scheduler process:

- ``gc``: the loop's full collections become young-generation ones (:class:`YoungGc`).
- the interpreter's switch interval (:func:`fast_switching`): SGLang's scheduler thread spins; with
  Python's default 5 ms interval a thread receiving beside it gets the GIL only every few
  milliseconds per small step (a stage of 0.1 s took 10.6 s on an H200). ``benchmarks/sglang_stage_probe.py``
  shows the effect without SGLang.
"""

from __future__ import annotations

import gc
import sys
import threading
import traceback
import types
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

__all__ = ["YoungGc", "stock_loop", "receiver_context", "fast_switching", "run_stock_loop", "SWITCH_INTERVAL_S"]

SWITCH_INTERVAL_S = 0.0001   # while receiving; Python's default is 0.005

_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


class YoungGc:
    """``gc`` as the stock loop sees it here: ``collect()`` collects the youngest generation only.

    The stock loop runs two full collections per update. In a scheduler process with torch
    imported one takes 0.1-0.5 s holding the GIL, and the scheduler cannot step meanwhile. What
    those collections are for (dropping the views of the IPC buffer) is young garbage.
    """

    @staticmethod
    def collect(generation: int = 0) -> int:
        return gc.collect(0)

    def __getattr__(self, name):
        return getattr(gc, name)


def stock_loop() -> Callable:
    """``checkpoint_engine.worker.update_weights_from_ipc``, unchanged but for the ``gc`` it calls."""
    import checkpoint_engine.worker as stock

    fn = stock.update_weights_from_ipc
    loop = types.FunctionType(fn.__code__, {**fn.__globals__, "gc": YoungGc()}, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    loop.__kwdefaults__ = fn.__kwdefaults__
    return loop


def receiver_context(timeout_s: float):
    """A ZeroMQ context whose sockets time out after ``timeout_s``: the stock loop has no deadline
    of its own, its socket inherits these."""
    import zmq

    ctx = zmq.Context()
    ctx.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    ctx.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    ctx.setsockopt(zmq.LINGER, 0)
    return ctx


@contextmanager
def fast_switching(interval_s: float = SWITCH_INTERVAL_S) -> Iterator[None]:
    """Lower the interpreter's switch interval while receiving; the previous value comes back when
    the last user leaves (also on failure). Process-wide, hence counted."""
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(interval_s, _switch_saved))
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0:
                sys.setswitchinterval(_switch_saved)


class _HookReply:
    """A post hook whose failure is the loop's last reply (see :func:`run_stock_loop`)."""

    def __init__(self, hook: Callable[[], None]):
        self.hook, self.text = hook, ""
        self.error: Exception | None = None

    def __call__(self) -> None:
        try:
            self.hook()
        except Exception as exc:   # noqa: BLE001 - answered to the PS by _ReplyingSocket, raised after the loop
            self.error = exc
            self.text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


class _ReplyingSocket:
    """The stock loop's REP socket; its ``b""`` after a failed post hook becomes the hook's traceback."""

    def __init__(self, sock, hook: _HookReply):
        self._sock, self._hook = sock, hook

    def send(self, data, *args, **kwargs):
        if data == b"" and self._hook.error is not None:
            return self._sock.send_string(self._hook.text)
        return self._sock.send(data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _ReplyingContext:
    def __init__(self, ctx, hook: _HookReply):
        self._ctx, self._hook = ctx, hook

    def socket(self, kind, *args, **kwargs):
        return _ReplyingSocket(self._ctx.socket(kind, *args, **kwargs), self._hook)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def run_stock_loop(handle: str, device: torch.device, device_id, timeout_s: float, *, run: Callable,
                   post_hook: Callable[[], None] | None = None, side_stream: bool = True,
                   reply_hook_error: bool = False) -> None:
    """One update through the stock loop: a fresh ZeroMQ context with ``timeout_s``, the lowered
    switch interval and, with ``side_stream`` on a GPU, a CUDA stream of its own (a stage runs
    beside generation; the loop synchronizes the device after each bucket). Raises what the loop
    raises (the PS has been told by then).

    ``reply_hook_error``: the stock loop lets a failing ``post_hook`` propagate without answering
    the PS's last message (the PS would wait for it until its deadline); with this, the failure is
    that answer (its traceback, as a failing ``run`` answers a bucket: the PS raises it on every
    rank) and it is raised here once the loop returned."""
    loop = stock_loop()
    ctx = receiver_context(timeout_s)
    hook = _HookReply(post_hook) if reply_hook_error and post_hook is not None else None
    if hook is not None:
        post_hook = hook
    loop_ctx = ctx if hook is None else _ReplyingContext(ctx, hook)
    try:
        with fast_switching():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if device.type == "cuda" and side_stream:
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    loop(loop_ctx, handle, device_id, run=run, post_hook=post_hook)
            else:
                loop(loop_ctx, handle, device_id, run=run, post_hook=post_hook)
    finally:
        ctx.destroy(linger=0)
    if hook is not None and hook.error is not None:
        raise hook.error
