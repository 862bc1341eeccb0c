"""The parameter-server end of one update's ZeroMQ PAIR socket to its engine worker."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import zmq

from ckpt_core.errors import ProtocolError
from ckpt_core.wire import protocol as proto
from ckpt_core.wire.endpoint import endpoint_bound

POLL_SLICE_MS = 50
# The connecting side, until its peer connects: how often it looks whether the peer's endpoint is still
# bound (a read of /proc/net/unix, which can be long on a busy host).
ENDPOINT_CHECK_S = 1.0
# ... and how long an endpoint it never saw bound may stay unbound before that means its binder gave up.
# Every PS rank posts every rank's handle (req_func), so a worker can be told its handle by rank 0 before
# its own PS rank bound it (that rank is still allocating its buffer, say): an unbound handle then means
# "not yet". A handle seen bound and then gone is a PS that left, at once.
NEVER_BOUND_GRACE_S = 10.0
# Close with a short linger so that a last frame (abort, finished, error) still reaches
# the peer; with linger 0 ZeroMQ may drop it, and the peer then waits for its deadline.
CLOSE_LINGER_MS = 1000
_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED


class PeerWatch:
    """Follows whether the peer of a PAIR socket is still there, through a ZeroMQ monitor.

    A PAIR socket by itself never says that its peer went away: a killed engine
    worker or parameter server would look like a silent one until the deadline.
    ``lost`` becomes true once a peer had connected and no connection is left.
    On the connecting side (``expect(endpoint)``), ``unbound`` becomes true when the peer never
    connected and nobody binds its endpoint any more: it gave up before we connected.
    """

    def __init__(self, sock: zmq.Socket, *, sticky: bool = False):
        self.sock = sock
        self.mon = sock.get_monitor_socket(_PEER_EVENTS)   # before bind/connect: miss no event
        self.peers = 0
        self.seen = False
        # sticky: any disconnect is final. The connecting side uses it: ZeroMQ would reconnect
        # (e.g. after dropping a frame over MAXMSGSIZE), but within one update the PS never
        # legitimately drops the connection, so a reconnect cannot make the update whole.
        self.sticky, self.dropped = sticky, False
        self.endpoint: str | None = None   # what the connecting side connects to (expect)
        self._next_check = self._expected_at = 0.0
        self._bound_once = False   # the expected endpoint was seen bound at some look
        self.binder_gone = False   # binder_left found the endpoint unbound after the peer connected (latched)

    def expect(self, endpoint: str) -> None:
        """The connecting side: the endpoint it connects to, whose binder must be there until it connects."""
        self.endpoint, self._next_check, self._bound_once = endpoint, 0.0, False
        self._expected_at = time.monotonic()

    @property
    def lost(self) -> bool:
        self.drain()
        return self.seen and (self.peers <= 0 or (self.sticky and self.dropped))

    @property
    def unbound(self) -> bool:
        """True when the peer never connected and nobody binds the expected endpoint: it was seen
        bound at an earlier look and is gone, or it was never seen bound for ``NEVER_BOUND_GRACE_S``
        since ``expect`` (its binder may bind it a little after we were told it: see there).

        Looks at most once per ``ENDPOINT_CHECK_S`` (the first time at once), never once the peer
        connected, and never says True when the endpoint cannot be checked (``endpoint_bound``: a
        tcp:// handle, no /proc): such a wait goes on as before."""
        self.drain()
        now = time.monotonic()
        if self.seen or self.endpoint is None or now < self._next_check:
            return False
        self._next_check = now + ENDPOINT_CHECK_S
        bound = endpoint_bound(self.endpoint)
        if bound:
            self._bound_once = True
        if bound is not False or (not self._bound_once and now - self._expected_at < NEVER_BOUND_GRACE_S):
            return False
        # A connection made just before the binder left was announced on the monitor before the name
        # went away: look once more, so that it reads as a lost peer, not as one never reached.
        self.drain()
        return not self.seen

    @property
    def binder_left(self) -> bool:
        """The connecting side, after the peer connected: nobody binds its endpoint any more (its
        socket closed, its process died). Latched once true.

        A second signal beside the monitor's disconnect event, which a wait must not depend on alone
        (a worker once waited past its test's 10 s with its PS closed, on a loaded 2-core machine,
        the event not seen). An abstract name stays listed while any socket of the binder's
        connections is open, so this says the binder closed them all. Looks at most once per
        ``ENDPOINT_CHECK_S``, the first a second after the peer connected (no cost to an update that
        never waits that long); False where the endpoint cannot be checked (``tcp://``) or is a socket
        file (``ipc:///path``: its file may be unlinked while its binder still serves). What the
        binder sent before it left may still be on its way: read it first (``_Link.recv``)."""
        if self.binder_gone:
            return True
        self.drain()
        now = time.monotonic()
        # abstract names only: a socket file's path may be unlinked under a binder that still serves
        endpoint = self.endpoint or ""
        if not self.seen or not endpoint.startswith("ipc://@") or now < self._next_check:
            return False
        self._next_check = now + ENDPOINT_CHECK_S
        self.binder_gone = endpoint_bound(endpoint) is False
        return self.binder_gone

    def drain(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while self.mon is not None and self.mon.poll(0):
            event = recv_monitor_message(self.mon, zmq.NOBLOCK)["event"]
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                if not self.seen:   # binder_left's first look: a second after the peer connected
                    self._next_check = time.monotonic() + ENDPOINT_CHECK_S
                self.peers, self.seen = self.peers + 1, True
            elif event == zmq.EVENT_DISCONNECTED:
                self.peers, self.dropped = self.peers - 1, True

    def close(self) -> None:
        mon, self.mon = self.mon, None
        if mon is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close(linger=0)


@dataclass
class Failure:
    """What went wrong on one rank; exchanged between ranks as JSON."""
    rank: int
    device_key: str
    message: str
    traceback: str = ""
    timeout: bool = False

    def to_json(self) -> dict:
        return dict(self.__dict__)


class PsLink:
    """Sends the plan and bucket notices, reads the worker's answers; every wait has a deadline.

    The first problem (worker error, silence past the deadline, bad frame) is
    kept in ``failure`` and the link goes quiet: later sends and waits are
    no-ops, so the caller can finish the collectives and report once.
    Subclasses speaking another wire (``stock.StockLink``) change the socket type and frame limit.
    """

    SOCKET_TYPE = zmq.PAIR
    MAX_FRAME_BYTES = proto.MAX_FRAME_BYTES

    def __init__(self, ctx: zmq.Context, handle: str, update_id: str, *, rank: int, device_key: str,
                 deadline: float, should_stop: Callable[[], str | None]):
        self.update_id, self.rank, self.device_key = update_id, rank, device_key
        self.deadline, self.should_stop = deadline, should_stop
        self.opened = time.monotonic()   # when the handshake's wait began: a timeout's note says how late
        self.failure: Failure | None = None
        self.aborted = False   # send_abort ran: it tells the worker once per update
        self.sock = ctx.socket(self.SOCKET_TYPE)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.MAX_FRAME_BYTES)
        self.watch = PeerWatch(self.sock)
        self.sock.bind(handle)
        self._done_upto = -1

    # -- sending ---------------------------------------------------------------
    def _send(self, kind: str, frame: bytes | tuple[bytes, ...] | None = None, **fields) -> None:
        # A bound PAIR socket blocks on send until its peer connects: wait for
        # writability in slices, so a worker that never connects is a timeout.
        if kind == "hello":
            what = f"engine worker {self.device_key} to connect (did req_func reach the engine?)"
        else:
            what = f"engine worker {self.device_key} to take the {kind} message"
        while self.failure is None:
            if self._wait(zmq.POLLOUT, what):
                if isinstance(frame, tuple):   # one message of several frames (a hello and its plan)
                    self.sock.send_multipart(frame, zmq.NOBLOCK)
                else:
                    self.sock.send(frame if frame is not None else proto.encode(kind, self.update_id, **fields),
                                   zmq.NOBLOCK)
                return

    def _wait(self, event: int, what: str) -> bool:
        """One poll slice for ``event``; records a failure on stop, a lost peer or the deadline.

        What is already there is taken even past the deadline: a rank that was held
        up by a slow peer must not blame its own worker, whose answer is waiting.
        """
        stop = self.should_stop()
        if stop:
            self._fail(f"stopped while waiting for {what}: {stop}")
            return False
        if self.sock.poll(0, event):
            return True
        if self.watch.lost:
            if self.sock.poll(0, event):   # a last frame may have come in just before the disconnect
                return True
            self._fail(f"engine worker {self.device_key} disconnected (did its process die?) "
                       f"while the PS was waiting for {what}")
            return False
        left = self.deadline - time.monotonic()
        if left <= 0:
            self._fail(f"timed out waiting for {what}", timeout=True)
            return False
        return bool(self.sock.poll(min(POLL_SLICE_MS, max(1, int(left * 1000))), event))

    @property
    def reached(self) -> bool:
        """Whether the engine worker ever connected during this update."""
        self.watch.drain()
        return self.watch.seen

    def send_hello(self, fields: dict | None = None, *, frame: bytes | tuple[bytes, ...] | None = None) -> None:
        """Send the hello, from fields or as the frames already encoded (``proto.encode_hello``)."""
        self._send("hello", frame, **(fields or {}))

    def send_bucket(self, index: int, slot: int) -> None:
        self._send("bucket", index=index, slot=slot)

    def send_end(self, keep_buffer: bool) -> None:
        self._send("end", keep_buffer=keep_buffer)

    def send_abort(self, reason: str) -> None:
        if self.aborted:
            return
        self.aborted = True
        try:  # best effort: the worker may be gone; never block
            self.sock.send(proto.encode("abort", self.update_id, reason=reason[:4000]), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- receiving -------------------------------------------------------------
    def _recv(self, expect: tuple[str, ...], what: str) -> dict | None:
        while self.failure is None:
            if not self._wait(zmq.POLLIN, what):
                continue
            try:
                msg = proto.decode(self.sock.recv(), expect=expect + ("error",), update=self.update_id)
            except ProtocolError as exc:
                self._fail(f"bad message from the engine worker: {exc}")
                return None
            if msg["kind"] == "error":
                index = msg.get("index")
                where = (f"bucket {index}" if isinstance(index, int) and index >= 0
                         else "outside the buckets: handshake or post-hook")
                self._fail(f"engine worker failed ({where})", tb=str(msg.get("traceback", "")))
                return None
            return msg
        return None

    def wait_ready(self) -> bool:
        if self.failure is None:
            self._recv(("ready",), "the worker to connect and map the buffer (did req_func start it?)")
        return self.failure is None

    def wait_done(self, index: int) -> None:
        while self.failure is None and self._done_upto < index:
            msg = self._recv(("done",), f"bucket {index} to be loaded")
            if msg is not None:
                self._done_upto = int(msg.get("index", -1))

    def wait_finished(self) -> None:
        if self.failure is None:
            self._recv(("finished",), "the post-update hook")

    def expire(self, message: str) -> None:
        """Record that this rank's update timeout passed before a wait began (a first exchange that
        ended past the deadline): a timeout, agreed like any other, whatever is already waiting."""
        self._fail(message, timeout=True)

    def fail(self, message: str) -> None:
        """Record a failure of this rank that is not its worker's (e.g. its source file changed),
        so that it travels through the same status exchange and the link goes quiet."""
        self._fail(message)

    def _fail(self, message: str, *, tb: str = "", timeout: bool = False) -> None:
        if self.failure is None:
            self.failure = Failure(self.rank, self.device_key, message, tb, timeout)

    def close(self) -> None:
        self.watch.close()
        self.sock.close(linger=CLOSE_LINGER_MS)

    def end(self, ok: bool, reason: str) -> None:
        """Close at the end of an update; after a failure that skipped the agreement (a broken
        collective, say) end the worker's call first, so no engine waits on a dead update."""
        if not ok:
            self.send_abort(reason)
        self.close()
