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

And one for its owner: the stock loop waits for the parameter server with plain blocking receives.
Its socket (made by the context we pass) waits in slices of ``STOP_POLL_S`` instead
(:class:`_LoopSocket`), asking ``should_stop()`` between slices, so that a stage's owner can end a
receiver waiting for a PS that gave the update up (a drop, a newer stage) at once instead of after
the receive timeout; and a PS that connected and went away (its process died), or that gave the
update up before the receiver connected (its handle is no longer bound), ends the wait too, for a
direct load as well (nobody can stop that one: it runs in the scheduler's own call).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
import types
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ckpt_core.errors import ConfigError, TransportError, UpdateTimeoutError
from ckpt_core.wire.worker import (  # how often a wait for the PS asks its owner, as our own worker does
    LAST_FRAMES_S,
    STOP_POLL_S,
)

__all__ = ["YoungGc", "stock_loop", "receiver_context", "fast_switching", "run_stock_loop", "SWITCH_INTERVAL_S",
           "STOP_POLL_S"]

SWITCH_INTERVAL_S = 0.0001   # while receiving; Python's default is 0.005
StopFn = Callable[[], "str | None"]

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


class _LoopSocket:
    """The stock loop's REP socket, as the context we pass it makes it.

    - Receives wait in slices of ``STOP_POLL_S`` and ask ``should_stop()`` between them: a reason
      ends the wait with ``ConfigError`` naming it; no message within ``timeout_s`` is an
      ``UpdateTimeoutError``. Either is kept and raised again by every later send or receive (the
      stock loop answers a failed first receive with a send, which ZeroMQ would refuse with EFSM and
      hide the cause). Only the receiver's own thread touches the socket: the owner just answers
      ``should_stop``, nothing is closed across threads.
    - A PS that had connected and is gone (a ZeroMQ monitor, :class:`~ckpt_core.wire.link.PeerWatch`,
      sticky: within one update the PS never drops the connection; or its handle no longer bound,
      looked up about once a second: ``PeerWatch.binder_left``) is a ``TransportError`` once
      nothing it sent is left to read. So is a PS that gave the update up before the receiver
      connected: until the PS connects, its handle (recorded by ``connect``) is looked up about once
      a second (``PeerWatch.unbound``, ``ckpt_core/wire/endpoint.py``: listed in ``/proc/net/unix``);
      a handle nobody binds ends the wait (at once when it was seen bound, after a grace when never).
      A slow PS still binds its handle and is waited for; a handle that cannot be checked
      (``tcp://``) is waited for as before, until the owner's stop or the timeout.
    - With a failed post hook (``hook``), the loop's ``b""`` after it becomes the hook's traceback.
    """

    def __init__(self, sock, hook: "_HookReply | None", should_stop: StopFn | None, timeout_s: float):
        from ckpt_core.wire.link import PeerWatch

        self._sock, self._hook, self._should_stop, self._timeout_s = sock, hook, should_stop, timeout_s
        self.failure: Exception | None = None
        self._watch = PeerWatch(sock, sticky=True)   # before the loop connects: no event missed

    def _wait(self) -> None:
        import zmq

        if self.failure is not None:
            raise self.failure
        deadline = time.monotonic() + self._timeout_s
        while True:
            why = self._should_stop() if self._should_stop is not None else None
            if why:
                self.failure = ConfigError(f"{why} (the receiver was waiting for the parameter server's next message)")
                raise self.failure
            left = deadline - time.monotonic()
            if left <= 0:
                self.failure = UpdateTimeoutError(f"no message from the parameter server within the receive timeout "
                                                  f"({self._timeout_s:g} s)")
                raise self.failure
            if self._sock.poll(max(1, int(min(left, STOP_POLL_S) * 1000)), zmq.POLLIN):
                return
            if self._watch.lost and not self._sock.poll(0, zmq.POLLIN):
                self.failure = TransportError("the parameter server disconnected (did its process die?) while the "
                                              "receiver was waiting for its next message")
                raise self.failure
            if self._watch.binder_left and not self._sock.poll(int(LAST_FRAMES_S * 1000), zmq.POLLIN):
                self.failure = TransportError(f"the parameter server's socket {self._watch.endpoint} is not bound any "
                                              "more (did its process die?) while the receiver was waiting for its "
                                              "next message")
                raise self.failure
            if self._watch.unbound and not self._sock.poll(0, zmq.POLLIN):
                self.failure = TransportError(f"the parameter server's socket {self._watch.endpoint} is not bound: it "
                                              "gave the update up (deadline, stop or death) before this receiver "
                                              "connected; nothing was loaded")
                raise self.failure

    def connect(self, addr, *args, **kwargs):
        self._watch.expect(addr)   # until the PS connects, its handle must stay bound (PeerWatch.unbound)
        return self._sock.connect(addr, *args, **kwargs)

    def recv(self, *args, **kwargs):
        self._wait()
        return self._sock.recv(*args, **kwargs)

    def recv_pyobj(self, *args, **kwargs):
        self._wait()
        return self._sock.recv_pyobj(*args, **kwargs)

    def recv_string(self, *args, **kwargs):
        self._wait()
        return self._sock.recv_string(*args, **kwargs)

    def recv_multipart(self, *args, **kwargs):
        self._wait()
        return self._sock.recv_multipart(*args, **kwargs)

    def send(self, data, *args, **kwargs):
        if self.failure is not None:
            raise self.failure
        if self._hook is not None and data == b"" and self._hook.error is not None:
            return self._sock.send_string(self._hook.text)
        return self._sock.send(data, *args, **kwargs)

    def send_string(self, *args, **kwargs):
        if self.failure is not None:
            raise self.failure
        return self._sock.send_string(*args, **kwargs)

    def send_pyobj(self, *args, **kwargs):
        if self.failure is not None:
            raise self.failure
        return self._sock.send_pyobj(*args, **kwargs)

    def close(self, *args, **kwargs):
        self._watch.close()
        return self._sock.close(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class _LoopContext:
    """The context the stock loop gets: its sockets are :class:`_LoopSocket`; the last one made is kept."""

    def __init__(self, ctx, hook: "_HookReply | None", should_stop: StopFn | None, timeout_s: float):
        self._ctx, self._hook, self._should_stop, self._timeout_s = ctx, hook, should_stop, timeout_s
        self.sock: _LoopSocket | None = None

    def socket(self, kind, *args, **kwargs) -> _LoopSocket:
        self.sock = _LoopSocket(self._ctx.socket(kind, *args, **kwargs), self._hook, self._should_stop,
                                self._timeout_s)
        return self.sock

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def run_stock_loop(handle: str, device: torch.device, device_id, timeout_s: float, *, run: Callable,
                   post_hook: Callable[[], None] | None = None, side_stream: bool = True,
                   reply_hook_error: bool = False, should_stop: StopFn | None = None) -> None:
    """One update through the stock loop: a fresh ZeroMQ context with ``timeout_s``, the lowered
    switch interval and, with ``side_stream`` on a GPU, a CUDA stream of its own (a stage runs
    beside generation; the loop synchronizes the device after each bucket). Raises what the loop
    raises (the PS has been told by then).

    ``reply_hook_error``: the stock loop lets a failing ``post_hook`` propagate without answering
    the PS's last message (the PS would wait for it until its deadline); with this, the failure is
    that answer (its traceback, as a failing ``run`` answers a bucket: the PS raises it on every
    rank) and it is raised here once the loop returned.

    ``should_stop()``, if given, is asked every ``STOP_POLL_S`` while the loop waits for the PS: a
    reason (a non-empty string) ends the wait and the loop with ``ConfigError`` naming it (a stage's
    receiver that its owner drops: its PS may be bound and silent, or on a handle that cannot be
    checked). Without it, a PS that gave the update up before this receiver connected still ends the
    wait when its ``ipc://`` handle is bound by nobody (``TransportError``, see
    :class:`_LoopSocket`). Each receive waits at most ``timeout_s`` (``UpdateTimeoutError``)."""
    loop = stock_loop()
    ctx = receiver_context(timeout_s)
    hook = _HookReply(post_hook) if reply_hook_error and post_hook is not None else None
    if hook is not None:
        post_hook = hook
    loop_ctx = _LoopContext(ctx, hook, should_stop, timeout_s)
    try:
        with fast_switching():
            if device.type == "cuda":
                torch.cuda.set_device(device)
            if device.type == "cuda" and side_stream:
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    loop(loop_ctx, handle, device_id, run=run, post_hook=post_hook)
            else:
                loop(loop_ctx, handle, device_id, run=run, post_hook=post_hook)
    except BaseException as exc:
        failure = None if loop_ctx.sock is None else loop_ctx.sock.failure
        if failure is not None and failure is not exc:   # what the loop raised on top of our stop or timeout
            raise failure from exc
        raise
    finally:
        ctx.destroy(linger=0)
    if hook is not None and hook.error is not None:
        raise hook.error
