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


def run_stock_loop(handle: str, device: torch.device, device_id, timeout_s: float, *, run: Callable,
                   post_hook: Callable[[], None] | None = None, side_stream: bool = True) -> None:
    """One update through the stock loop: a fresh ZeroMQ context with ``timeout_s``, the lowered
    switch interval and, with ``side_stream`` on a GPU, a CUDA stream of its own (a stage runs
    beside generation; the loop synchronizes the device after each bucket). Raises what the loop
    raises (the PS has been told by then)."""
    loop = stock_loop()
    ctx = receiver_context(timeout_s)
    try:
        with fast_switching():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if device.type == "cuda" and side_stream:
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    loop(ctx, handle, device_id, run=run, post_hook=post_hook)
            else:
                loop(ctx, handle, device_id, run=run, post_hook=post_hook)
    finally:
        ctx.destroy(linger=0)
