"""Compat codec: our parameter server speaking stock checkpoint-engine's worker protocol.

Engines that embed the stock ``checkpoint_engine.worker.update_weights_from_ipc`` (SGLang
imports it by name) cannot speak our JSON protocol. ``ParameterServer(..., wire="stock")``
(stock >= 0.4.0) or ``wire="stock-0.3"`` (0.2.1 - 0.3.4) makes the PS speak theirs instead:

- socket: the PS rank binds a ZeroMQ REQ socket at
  ``ipc://@checkpoint-engine-<device key>-<update id>.sock``; the stock worker connects REP.
  Device keys are the stock ones (``GPU-<uuid>``, ``NPU-...``) because our backends use them.
- exchange, strictly one request and one reply at a time::

      PS -> worker  (rebuild function, args)   pickled handle of the uint8 IPC buffer; the
                                               worker puts its device index at args[6]
      worker -> PS  b"" | traceback text
      PS -> worker  [{name, dtype, shape, offset}, ...]   one per bucket, offsets in the buffer
      worker -> PS  b"" | traceback text       after run() (the worker keeps waiting on error)
      PS -> worker  None                       stock >= 0.4: release the buffer, reply b""
      PS -> worker  None                       run post_hook, reply b"" (0.2.1-0.3.4: only this one)
      PS -> worker  RuntimeError(reason)       instead of any of the above: the worker raises

Ending a failed update (``StockLink.send_abort``). Stock workers have no timeout, so a worker the
PS leaves waiting blocks its engine's ``update_weights_from_ipc`` call for good. Whatever state
the worker is in, the abort ends its call:

- not connected yet (the engine starts it after ``req_func`` posted): wait up to
  ``ABORT_CONNECT_S`` for it to connect, then as below; one that connects later stays blocked
  (the bound is what a failing rank can afford; logged).
- connected, no buffer handle sent: it takes the abort for the handle (``assert isinstance(...,
  tuple)`` fails), answers with that traceback and waits for an ack: the PS reads the answer
  (as bytes, discarded) and sends ``b""``; the worker raises ``AssertionError``.
- handle sent, answer owed: take the answer (or relax REQ past ``ABORT_GRACE_S``), then the abort:
  a worker that rebuilt the buffer raises it; one that failed to takes it as its ack and raises.
- between buckets or final messages (answer taken or owed): same, the worker raises the abort.

Trust boundary. The stock protocol pickles, and unpickling runs code chosen by the sender.
Our PS only *encodes* pickles (of its own buffer handle, plain dicts, ``None`` and a
``RuntimeError``); every reply is read as raw bytes: ``b""`` is success, printable UTF-8 text
is the worker's traceback, anything else (a pickle, binary garbage, a frame over
``MAX_REPLY_BYTES``) is a ``ProtocolError`` on that rank, never decoded further. The stock
*worker* unpickles what the PS sends: whoever can connect to its socket can run code in the
engine. That is the stock design, unchanged by us; keep the engine, the PS and the socket
(abstract Unix socket, reachable from the host's network namespace) inside one trust domain,
or use our native protocol (``wire="native"``), which never unpickles on either side.

Stock workers have no timeouts: one whose PS vanishes waits forever. Our side keeps every
deadline of the native link (``PsLink``).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Sequence

import torch
import zmq

from ckpt_core.checkpoint.safetensors import DTYPES
from ckpt_core.devices import IpcBuffer, get_backend
from ckpt_core.errors import ConfigError, ProtocolError, TransportError
from ckpt_core.planning.buckets import Bucket
from ckpt_core.wire.link import PsLink

_log = logging.getLogger(__name__)
__all__ = ["WIRES", "check_wire", "wire_handles", "open_link", "decode_reply", "open_shared_buffer"]

# wire -> number of final ``None`` messages its stock worker expects (native: not a stock wire)
WIRES = {"native": 0, "stock": 2, "stock-0.3": 1}
MAX_REPLY_BYTES = 4 << 20       # a traceback; a larger reply drops the connection (MAXMSGSIZE)
ABORT_GRACE_S = 5.0             # how long an abort waits for the reply owed to the last request
ABORT_CONNECT_S = 10.0          # how long a failing rank waits for a stock worker that has not connected
PICKLE_PROTOCOL = 4             # readable by every Python a stock worker runs on
_NONE_FRAME = pickle.dumps(None, protocol=PICKLE_PROTOCOL)
_LAYOUT = str.maketrans("", "", "\n\r\t")   # the only control characters a traceback holds


def check_wire(wire: Any) -> str:
    if wire not in WIRES:
        raise ConfigError(f"wire must be one of {sorted(WIRES)}, got {wire!r} ('stock': checkpoint-engine "
                          ">= 0.4 workers, 'stock-0.3': 0.2.1 - 0.3.4, 'native': ckpt_core workers)")
    return wire


def wire_handles(wire: str, update_id: str, device_keys: list[str]) -> list[tuple[str, str]]:
    """``[(device key, ZeroMQ handle)]`` of every rank, as ``req_func`` receives them."""
    if wire == "native":
        return [(k, f"ipc://@ckpt-{update_id}-{r}") for r, k in enumerate(device_keys)]
    return [(k, f"ipc://@checkpoint-engine-{k}-{update_id}.sock") for k in device_keys]


def open_link(wire: str, ctx: zmq.Context, handle: str, update_id: str, *, buckets: Sequence[Bucket],
              slot_bytes: int, ipc: IpcBuffer | None, device_kind: str, **link_kw) -> PsLink:
    """The PS end of one update's socket for ``wire`` (``link_kw``: ``PsLink``'s keywords)."""
    if wire == "native":
        return PsLink(ctx, handle, update_id, **link_kw)
    # ipc is None when this rank could not allocate it: the update then fails before any hello
    def hello() -> bytes:
        if ipc is None:   # never sent: the update failed before its hello
            raise TransportError("this rank has no IPC buffer to describe in a hello")
        return buffer_frame(device_kind, ipc)

    return StockLink(ctx, handle, update_id, finals=WIRES[wire], buckets=buckets, slot_bytes=slot_bytes,
                     hello=hello, **link_kw)


# -- encoding (the only pickles we make; we never load one) ------------------------------------
def open_shared_buffer(path: str, nbytes: int, _2=None, _3=None, _4=None, _5=None, device_id: int = 0) -> torch.Tensor:
    """Rebuild function of a ``cpu``-kind buffer in a stock worker: maps our /dev/shm buffer.

    Seven positional arguments because the stock worker overwrites argument 6 with its device
    index (torch's ``rebuild_cuda_tensor`` convention). The worker must be able to import
    ckpt_core: stock checkpoint-engine itself has no CPU kind (its PS refuses to run without a
    GPU/NPU), so this serves tests and CPU deployments that install both packages.
    """
    # the device index means nothing for host memory (SGLang on CPU even passes the string "cpu")
    tensor, _mapping = get_backend("cpu").open_ipc({"path": path, "nbytes": nbytes}, 0)
    return tensor   # torch.frombuffer keeps the mapping alive as long as the tensor


def buffer_frame(device_kind: str, ipc: IpcBuffer) -> bytes:
    """The first frame: ``(rebuild function, args)`` of the uint8 IPC buffer, pickled.

    Device kinds use torch's own ``reduce_tensor`` (exactly what the stock PS sends; CUDA and
    torch_npu put the device index at argument 6); a ``/dev/shm`` buffer cannot travel that way
    (torch shares CPU storage by file descriptor over a multiprocessing connection).
    """
    if device_kind == "cpu":
        desc = ipc.descriptor
        handle = (open_shared_buffer, (desc["path"], desc["nbytes"], None, None, None, None, 0))
    else:
        from torch.multiprocessing.reductions import reduce_tensor
        handle = reduce_tensor(ipc.tensor)
    return pickle.dumps(handle, protocol=PICKLE_PROTOCOL)


def bucket_frame(bucket: Bucket, base: int) -> bytes:
    """One bucket's tensors as the stock worker reads them: absolute offsets in the buffer. Made
    once per planned bucket and slot offset (plans are cached): a per-tensor dict, size and pickle
    on every update cost microseconds per tensor."""
    frames = bucket.__dict__.setdefault("_stock_frames", {})
    if base not in frames:
        frames[base] = pickle.dumps([{"name": p.meta.name, "dtype": DTYPES[p.meta.dtype],
                                      "shape": torch.Size(p.meta.shape), "offset": base + p.offset}
                                     for p in bucket.placements], protocol=PICKLE_PROTOCOL)
    return frames[base]


def abort_frame(reason: str) -> bytes:
    return pickle.dumps(RuntimeError(f"update aborted by the parameter server: {reason[:4000]}"),
                        protocol=PICKLE_PROTOCOL)


# -- decoding (bytes and text only) --------------------------------------------------------------
def decode_reply(frame: bytes) -> str:
    """``""`` for success, the worker's traceback text otherwise; ``ProtocolError`` for anything else.

    Never unpickles: a reply is data from another process, read as bytes.
    """
    if len(frame) > MAX_REPLY_BYTES:
        raise ProtocolError(f"reply of {len(frame)} bytes exceeds the limit of {MAX_REPLY_BYTES}")
    if not frame:
        return ""
    hint = " (a pickle? checkpoint-engine < 0.3 answers errors pickled; it was not unpickled)" \
        if frame[:1] == b"\x80" else ""
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"reply is neither empty nor UTF-8 text{hint}; first bytes {frame[:32]!r}") from exc
    if not text.translate(_LAYOUT).isprintable():
        raise ProtocolError(f"reply is not printable text; first bytes {frame[:32]!r}")
    return text


class StockLink(PsLink):
    """``PsLink`` over a REQ socket, speaking the stock worker's pickled frames.

    The pipeline drives it like the native link (``send_bucket``, ``wait_done``, ...). REQ
    allows one request in flight: sending the next bucket first takes the answer to the
    previous one, so the worker loads bucket i while the PS stages and broadcasts later ones.
    """

    SOCKET_TYPE = zmq.REQ
    MAX_FRAME_BYTES = MAX_REPLY_BYTES

    def __init__(self, ctx: zmq.Context, handle: str, update_id: str, *, finals: int, buckets: Sequence[Bucket],
                 slot_bytes: int, hello, **link_kw):
        super().__init__(ctx, handle, update_id, **link_kw)
        self.finals, self.buckets, self.slot_bytes = finals, buckets, slot_bytes
        self._hello = hello   # () -> the pickled buffer handle
        self._owed: tuple[str, int] | None = None   # (what the pending request was, bucket index or -1)
        self._sent_handle = False   # whether the worker got its buffer handle (it expects it first)

    def _request(self, kind: str, frame: bytes, what: str, index: int = -1) -> None:
        if self._owed is not None:
            self._take_reply(self._owed)
        if self.failure is None:
            self._send(kind, frame)
            if self.failure is None:
                self._owed = (what, index)
                self._sent_handle = True

    def _take_reply(self, owed: tuple[str, int]) -> None:
        """Read the answer owed to the last request (``owed``: ``self._owed``). If the wait ends first (stop,
        deadline, lost worker), the answer stays owed: ``send_abort`` must know that the turn is still the worker's."""
        what, index = owed
        while self.failure is None:
            if not self._wait(zmq.POLLIN, f"the engine worker's answer to {what}"):
                continue
            frame = self.sock.recv()
            self._owed = None
            try:
                text = decode_reply(frame)
            except ProtocolError as exc:
                self._fail(f"bad answer from the engine worker to {what}: {exc}")
                return
            if text:
                self._fail(f"engine worker failed ({what})", tb=text)
            elif index >= 0:
                self._done_upto = index
            return

    def send_hello(self, fields: dict | None = None, *, frame: bytes | tuple[bytes, ...] | None = None) -> None:
        """Send the buffer handle. The native hello (plan, descriptor) has no stock equivalent and is
        ignored: a stock worker learns the buffer from the handle and the tensors bucket by bucket."""
        self._request("hello", self._hello(), "the buffer handle")

    def wait_ready(self) -> bool:
        if self._owed is not None:
            self._take_reply(self._owed)
        return self.failure is None

    def send_bucket(self, index: int, slot: int) -> None:
        self._request("bucket", bucket_frame(self.buckets[index], slot * self.slot_bytes), f"bucket {index}", index)

    def wait_done(self, index: int) -> None:
        while self.failure is None and self._done_upto < index:
            assert self._owed is not None and self._owed[1] >= index, f"bucket {index} was never sent"  # noqa: S101 - our send order, not a peer's input
            self._take_reply(self._owed)

    def send_end(self, keep_buffer: bool) -> None:
        """Stock workers always unmap; ``keep_buffer`` only keeps the PS's own buffer."""
        if self.finals == 2:
            self._request("end", _NONE_FRAME, "the release message")
        self._request("end", _NONE_FRAME, "the post-update message")

    def wait_finished(self) -> None:
        if self._owed is not None:
            self._take_reply(self._owed)

    def send_abort(self, reason: str) -> None:
        """End the stock worker's call, whatever its state (module docstring); once per update.

        Bounded: at most ``ABORT_CONNECT_S`` for a worker that has not connected, then
        ``ABORT_GRACE_S`` per answer it owes. Never raises: the update is lost anyway.
        """
        if self.aborted:
            return
        self.aborted = True
        try:
            self._abort(reason)
        except zmq.ZMQError:
            pass

    def _abort(self, reason: str) -> None:
        if not self._reach_worker():
            return
        if self._owed is not None:
            # the turn is the worker's (it is loading a bucket or rebuilding the buffer): take its
            # answer; if it does not come, relax the REQ state machine so the abort can go anyway
            self._owed = None
            if self.sock.poll(int(ABORT_GRACE_S * 1000), zmq.POLLIN):
                self.sock.recv(zmq.NOBLOCK)   # discarded unread: the update is lost anyway
            else:
                self.sock.setsockopt(zmq.REQ_RELAXED, 1)
        if not self.sock.poll(int(ABORT_GRACE_S * 1000), zmq.POLLOUT):
            return
        self.sock.send(abort_frame(reason), zmq.NOBLOCK)
        if not self._sent_handle:
            # it took the abort for the buffer handle: it answers with a traceback, then waits for an ack
            if self.sock.poll(int(ABORT_GRACE_S * 1000), zmq.POLLIN):
                self.sock.recv(zmq.NOBLOCK)   # bytes, discarded unread
                self.sock.send(b"", zmq.NOBLOCK)

    def _reach_worker(self) -> bool:
        """Whether a worker is connected to take the abort, waiting up to ``ABORT_CONNECT_S`` for one
        that has not connected yet (``req_func`` may have started it a moment ago)."""
        if self.watch.lost:   # it connected and is gone: nobody to tell
            return False
        if self.watch.seen:
            return True
        # a REQ socket is writable once a peer is connected
        if self.sock.poll(int(ABORT_CONNECT_S * 1000), zmq.POLLOUT) and not self.watch.lost:
            return True
        self.log_abandoned()
        return False

    def log_abandoned(self) -> None:
        _log.warning("rank %d: no stock engine worker (%s) connected within %.0f s of the failed update; "
                     "one that connects later waits forever (stock workers have no timeout)",
                     self.rank, self.device_key, ABORT_CONNECT_S)
