"""The engine-side receive loop, engine-agnostic.

An engine adapter calls :func:`update_weights_from_ipc` inside each of its
workers with a ``run`` callable that loads a list of ``(name, tensor)`` into
the model, and an optional ``post_hook`` run once after the last bucket.
"""

from __future__ import annotations

import operator
import sys
import threading
import time
import traceback
from typing import Any, Callable

import torch
import zmq

from ckpt_core._settings import update_seconds
from ckpt_core.devices import get_backend
from ckpt_core.errors import (
    CkptError,
    ConfigError,
    ProtocolError,
    RemoteWorkerError,
    TransportError,
    UpdateTimeoutError,
)
from ckpt_core.ops.gc import gc_paused
from ckpt_core.ops.log import rank_logger
from ckpt_core.wire import protocol as proto
from ckpt_core.wire.link import CLOSE_LINGER_MS, ENDPOINT_CHECK_S, PeerWatch
from ckpt_core.wire.views import Views

__all__ = ["Unfinished", "update_weights_from_ipc"]

DEFAULT_TIMEOUT_S = 600.0
SEND_WAIT_S = 5.0   # longest a send waits for the connection (it is normally writable at once)
STOP_POLL_S = 0.2   # with should_stop: how often a wait for the parameter server asks it
LAST_FRAMES_S = 0.2   # a PS found gone by its socket table: how long what it sent before it left may take to arrive
RunFn = Callable[[list[tuple[str, torch.Tensor]]], Any]


class Unfinished:
    """What ``run`` may return for a bucket whose work it queued on the device without waiting for it (a
    pipelined delta's apply and checks, ``delta/apply.py``): the receive loop calls the next bucket's ``run``
    first, then ``finish()`` (which waits for this bucket's own work, reads its checks back and raises if one
    failed), and only then reports this bucket done, so the PS reuses its slot once nothing reads it any more.
    The host's work on the next bucket overlaps the device's on this one. The last bucket is finished at once.
    Where the PS has a single slot (it sends the next bucket only once this one is done) it is finished at once.
    ``finish()`` runs the given callable once; a later call raises what the first raised, or returns."""

    def __init__(self, finish: Callable[[], None]):
        self._finish: Callable[[], None] | None = finish
        self._error: BaseException | None = None

    def finish(self) -> None:
        fn, self._finish = self._finish, None
        if fn is not None:
            try:
                fn()
            except BaseException as exc:
                self._error = exc
                raise
        elif self._error is not None:
            raise self._error

# Buffers stay mapped between updates when the PS keeps its buffer (cheap next update).
_mapped: dict[str, tuple[torch.Tensor, Any]] = {}
_mapped_lock = threading.Lock()


def _buffer_key(desc: dict) -> str:
    return desc.get("path") or f"{desc.get('handle')}:{desc.get('storage_offset')}"


def _map(kind: str, desc: dict, device_id: int) -> tuple[str, torch.Tensor]:
    key = f"{kind}:{device_id}:{_buffer_key(desc)}"
    with _mapped_lock:
        if key not in _mapped:
            # One PS rank serves a device, with one buffer: a new buffer replaces any kept one
            # (its PS restarted or died), which would otherwise stay mapped, holding its memory.
            device = f"{kind}:{device_id}:"
            stale = [k for k in _mapped if k.startswith(device)]
            _mapped[key] = get_backend(kind).open_ipc(desc, device_id)
        else:
            stale = []
        for k in stale:
            _close_mapping(_mapped.pop(k))
        return key, _mapped[key][0]


def _close_mapping(entry: tuple[torch.Tensor, Any]) -> None:
    if entry[1] is not None:
        entry[1].close()


def _unmap(key: str | None) -> None:
    if key is None:
        return
    with _mapped_lock:
        entry = _mapped.pop(key, None)
    if entry is not None:
        _close_mapping(entry)


class _Link:
    """The worker's end of the PAIR socket; every receive has a deadline, and a PS that
    went away (process killed, update given up, even before this worker connected) is an error
    at once, not a long silence."""

    def __init__(self, sock: zmq.Socket, deadline: float, should_stop: Callable[[], str | None] | None = None):
        self.sock, self.deadline, self.should_stop = sock, deadline, should_stop
        self.handle = ""
        self.unbound = False   # the PS's socket was found unbound: nobody will ever take a frame
        self.update: str | None = None
        self.watch = PeerWatch(sock, sticky=True)
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.watch.mon, zmq.POLLIN)
        self.reported = False   # an error frame went to the PS already
        self.last_frame = b""
        self.rest: list[bytes] = []   # the frames after the last message's first (a hello's plan)

    def connect(self, handle: str) -> None:
        self.handle = handle
        self.watch.expect(handle)   # until the PS connects, its handle must stay bound (PeerWatch.unbound)
        self.sock.connect(handle)

    def recv(self, expect: tuple[str, ...]) -> dict:
        waiting = f"waiting for {'/'.join(expect)}"
        while True:
            if self.sock.poll(0):
                parts = self.sock.recv_multipart()
                self.last_frame, self.rest = parts[0], parts[1:]
                msg = proto.decode(self.last_frame, expect=expect, update=self.update)
                proto.check_parts(msg, self.rest)
                if msg["kind"] == "bucket" and (self.watch.lost or self.watch.binder_gone):
                    return self._last_word(expect, waiting)   # the PS is gone: its notices are void
                return msg
            if self.watch.lost:
                raise TransportError(f"the parameter server closed the connection ({waiting}): "
                                     "its process died or it gave the update up")
            if self.watch.binder_left:
                if self.sock.poll(int(LAST_FRAMES_S * 1000)):   # what it sent before it left: read that first
                    continue
                raise TransportError(f"the parameter server closed the connection ({waiting}): its socket "
                                     f"{self.handle} is not bound any more; its process died or it gave the update up")
            if self.watch.unbound and not self.sock.poll(0):
                self.unbound = True
                raise TransportError(f"the parameter server's socket {self.handle} is not bound: it gave the update "
                                     f"up (deadline, stop or death) before this worker connected; nothing was loaded "
                                     f"({waiting})")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise UpdateTimeoutError(f"no message from the parameter server within the update timeout "
                                         f"({waiting})")
            if self.should_stop is not None:
                why = self.should_stop()
                if why:   # the caller gave this update up (a stage dropped by a newer request, say)
                    raise ConfigError(f"{why} ({waiting})")
                left = min(left, STOP_POLL_S)
            left = min(left, ENDPOINT_CHECK_S)   # wake up to look at the PS's handle again (unbound, binder_left)
            self.poller.poll(max(1, int(left * 1000)))

    def _last_word(self, expect: tuple[str, ...], waiting: str) -> dict:
        """The PS left with bucket notices still queued: find its abort behind them, or report the loss."""
        while self.sock.poll(0):
            msg = proto.decode(self.sock.recv_multipart()[0], expect=expect, update=self.update)
            if msg["kind"] == "abort":
                return msg
        raise TransportError(f"the parameter server closed the connection ({waiting}); the bucket "
                             "notices it left behind belong to a dead update and were not loaded")

    def send(self, kind: str, **fields) -> None:
        """Never blocks past the deadline: a PAIR socket whose peer is gone blocks on send."""
        if kind == "error":
            self.reported = True
        gone = self.unbound or self.watch.lost or self.watch.binder_gone
        wait = 0.0 if gone else min(max(0.0, self.deadline - time.monotonic()), SEND_WAIT_S)
        if not self.sock.poll(int(wait * 1000), zmq.POLLOUT):
            raise TransportError(f"cannot send {kind!r} to the parameter server: the connection is gone")
        self.sock.send(proto.encode(kind, self.update or "", **fields), zmq.NOBLOCK)

    def report(self, index: int, text: str) -> None:
        """Best effort: tell the PS why this worker fails; the failure itself is raised by the caller."""
        try:
            self.send("error", index=index, traceback=text)
        except (TransportError, zmq.ZMQError):
            pass

    def close(self) -> None:
        self.watch.close()
        self.sock.close(linger=CLOSE_LINGER_MS)


def update_weights_from_ipc(zmq_ctx: zmq.Context, zmq_handle: str, device_id: int, *, run: RunFn,
                            post_hook: Callable[[], Any] | None = None,
                            timeout: float = DEFAULT_TIMEOUT_S,
                            on_plan: Callable[[list[tuple[str, torch.dtype, tuple[int, ...]]]], Any] | None = None,
                            slices: tuple[str, int] | None = None,
                            should_stop: Callable[[], str | None] | None = None) -> None:
    """Receive one update from the colocated parameter-server rank.

    Connects to ``zmq_handle``, maps the PS rank's IPC buffer on device
    ``device_id`` and calls ``run(weights)`` once per bucket, where ``weights`` is a
    list of ``(name, tensor)`` viewing the shared buffer (valid only during the
    call: copy what you keep). ``post_hook()`` runs once after every bucket of
    every rank arrived. ``on_plan(tensors)``, if given, sees every ``(name, dtype,
    shape)`` of the update (a tuple, made once per plan) before any bucket is loaded; if it raises (a missing or
    misshapen tensor, say), the update fails on every rank and nothing is loaded.
    ``slices``: ``(slice plan digest, engine rank)`` when this worker loads by a slice plan: the
    update must be routed to exactly that engine rank of that plan (the PS says so in its hello),
    else it is refused with ConfigError on every rank before anything is mapped or loaded; None
    (the default): whole tensors, and an update of slices is refused.
    ``should_stop()``, if given, is asked every few hundred milliseconds while the worker waits for the
    PS: a reason (a non-empty string) ends the wait with ConfigError naming it (a receive on a thread of
    its own that its owner drops, whose PS is bound but silent, say).
    Raises :class:`RemoteWorkerError` when the PS aborts the
    update, ``UpdateTimeoutError`` when it goes silent, ``TransportError`` when it goes away: it
    closed the connection, or it gave the update up before this worker connected (until the PS
    connects, an ``ipc://`` handle is looked up about once a second; one nobody binds ends the wait,
    nothing loaded: at once when it was seen bound before, after ``link.NEVER_BOUND_GRACE_S`` when
    it never was; a ``tcp://`` handle cannot be checked and is waited for until
    the timeout), and re-raises the first exception of ``run`` or ``post_hook``.

    Example (inside an engine worker)::

        update_weights_from_ipc(zmq.Context.instance(), handles[my_key], device_index,
                                run=model.load_weights, post_hook=lambda: torch.cuda.synchronize())
    """
    timeout = update_seconds(timeout)   # NaN or <= 0: ConfigError; inf: no deadline (clamped)
    with gc_paused():
        _receive_update(zmq_ctx, zmq_handle, device_id, run, post_hook, timeout, on_plan, _own_route(slices),
                        should_stop)


def _own_route(slices) -> tuple[str, int] | None:
    """``slices`` as (plan digest, engine rank); ConfigError for anything else but None."""
    if slices is None:
        return None
    try:
        digest, rank = slices
        if isinstance(digest, str) and digest and operator.index(rank) >= 0:
            return digest, operator.index(rank)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"slices must be (slice plan digest, engine rank) or None, got {slices!r:.80}")


def _receive_update(zmq_ctx: zmq.Context, zmq_handle: str, device_id: int, run: RunFn, post_hook, timeout: float,
                    on_plan, slices, should_stop=None) -> None:
    log = rank_logger(f"worker dev {device_id}")
    sock = zmq_ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    # A frame above the limit drops the connection instead of being buffered in full.
    sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_FRAME_BYTES)
    link = _Link(sock, time.monotonic() + timeout, should_stop)
    key = None
    keep = False
    try:
        link.connect(zmq_handle)
        hello, key, buf, backend = _handshake(link, device_id, on_plan, slices)
        t0 = time.perf_counter()
        failure = _receive_buckets(link, hello, buf, backend, device_id, run)
        if failure is not None:
            raise failure
        msg = link.recv(("end", "abort"))
        if msg["kind"] == "abort":
            raise RemoteWorkerError(f"update aborted by the parameter server: {msg.get('reason', '')}")
        keep = bool(msg.get("keep_buffer"))
        if post_hook is not None:
            try:
                post_hook()
            except Exception as exc:
                link.report(-1, traceback.format_exc())
                raise exc
        backend.synchronize(device_id)
        link.send("finished")
        log.info("update %s: %d buckets received in %.3f s", hello.update, len(hello.buckets),
                 time.perf_counter() - t0)
    except CkptError as exc:
        # Our own wait failed (bad frame, timeout, lost PS): tell the PS why, so that
        # it reports this worker's reason at once instead of waiting for its deadline.
        if not link.reported and not isinstance(exc, RemoteWorkerError):   # an abort: the PS knows
            link.report(-1, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        link.close()
        buf = None   # noqa: F841  (drop our view before unmapping)
        pending = sys.exc_info()[1]
        if pending is not None:
            # The traceback's frames hold views of the shared buffer (and the engine's
            # `weights` list); while they live, the exporting PS cannot free its buffer.
            _clear_frames(pending)
        if not keep:
            _unmap(key)


def _clear_frames(exc: BaseException) -> None:
    seen = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        traceback.clear_frames(cur.__traceback__)
        cur = cur.__cause__ or cur.__context__


def _handshake(link: _Link, device_id: int, on_plan=None, slices=None):
    try:
        raw = link.recv(("hello", "abort"))
        if raw["kind"] == "abort":   # another rank refused or failed before this PS rank sent its hello
            raise RemoteWorkerError(f"update aborted by the parameter server before its hello: "
                                    f"{raw.get('reason', '')}")
        hello = proto.parse_hello(raw, link.rest[0] if link.rest else None)
    except ProtocolError as exc:
        # A frame we cannot trust: answer (under its update id if it has one, so that a PS of
        # another protocol version sees why) and leave without touching anything.
        link.update = proto.update_id_of(link.last_frame)
        link.report(-1, f"ProtocolError: {exc}")
        raise
    link.update = hello.update
    problem = _route_problem(hello.slices, slices)
    if problem is not None:   # another engine rank's slices (or plan) must never reach this worker's loaders
        link.report(-1, f"ConfigError: {problem}")
        raise ConfigError(problem)
    try:
        if on_plan is not None:   # the engine may refuse the checkpoint before any weight is touched
            on_plan(hello.listing)   # made once per plan
        backend = get_backend(hello.device_kind)
        backend.set_device(device_id)
        key, buf = _map(hello.device_kind, hello.buffer, device_id)
    except Exception:
        link.report(-1, traceback.format_exc())
        raise
    link.send("ready")
    return hello, key, buf, backend


def _route_problem(sent: tuple[str, int] | None, mine: tuple[str, int] | None) -> str | None:
    """Why the buckets the PS routed (``sent``: slice plan digest and engine rank, or None: whole
    tensors) are not this worker's (``mine``), or None when they are."""
    if sent == mine:
        return None
    if mine is None:
        assert sent is not None  # noqa: S101 - sent != mine (type narrowing)
        return (f"the parameter server sends the slices of engine rank {sent[1]} of slice plan {sent[0][:12]}; "
                "this worker was told of no slice plan (it loads whole tensors)")
    assert mine is not None  # noqa: S101 - type narrowing: returned above when None
    if sent is None:
        return (f"this worker loads by slice plan {mine[0][:12]} as engine rank {mine[1]}; the parameter server "
                "sends whole tensors (it was given no slice plan, or another one)")
    if sent[0] != mine[0]:
        return (f"this worker loads by slice plan {mine[0][:12]}; the parameter server routes the update by slice "
                f"plan {sent[0][:12]}: give both the same plan")
    return (f"this worker is engine rank {mine[1]} of slice plan {mine[0][:12]}, but its parameter-server rank "
            f"sends the slices of engine rank {sent[1]}: each engine rank must sit beside the PS rank that "
            "routes its slices (docs/architecture.md, Slices)")


def _receive_buckets(link: _Link, hello: proto.Hello, buf, backend, device_id: int, run: RunFn):
    """Run every bucket; on the first failure answer ``error`` and wait for the PS's abort.

    Returns the exception to raise (None on success, leaving ``end`` to be read).
    """
    views = Views(buf)   # batched views of each bucket (wire/views.py)
    last = len(hello.buckets) - 1
    # a bucket ``run`` left unfinished is reported done once the next one ran and it finished: only where the
    # PS can send the next bucket before this one is done (two slots or more; with one, it waits for the done)
    can_hold = hello.num_slots >= 2
    held: tuple[int, Unfinished] | None = None
    for expected in range(len(hello.buckets)):
        msg = link.recv(("bucket", "abort"))
        if msg["kind"] == "abort":
            return RemoteWorkerError(f"update aborted by the parameter server: {msg.get('reason', '')}")
        failing = expected
        try:
            index, slot = proto.parse_bucket(msg, hello)
            if index != expected:
                raise ProtocolError(f"bucket {index} arrived where bucket {expected} was due")
            out = run(views.bucket(slot * hello.slot_bytes, hello.buckets[index], hello.views[index]))
            if held is not None:   # the previous bucket: its work was queued before this one's
                failing = held[0]
                held[1].finish()
                link.send("done", index=held[0])
                failing, held = expected, None
            if isinstance(out, Unfinished):
                if expected < last and can_hold:
                    held = (index, out)
                    continue
                out.finish()
            backend.synchronize(device_id)
        except Exception as exc:  # the engine's loader failed, or the frame was bad
            link.report(failing, traceback.format_exc())
            return _drain_until_abort(link, exc)
        link.send("done", index=index)
    return None


def _drain_until_abort(link: _Link, first: Exception) -> Exception:
    """After a failure, skip the buckets still in flight until the PS says abort."""
    while True:
        try:
            msg = link.recv(("bucket", "abort", "end"))
        except CkptError:   # timeout, bad frame, PS gone: the first failure is the one to report
            return first
        if msg["kind"] != "bucket":
            return first
