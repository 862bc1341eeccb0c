"""Wire content the protocol tests build by hand: a payload that proves nothing from a socket was
unpickled, and a hello with its plan inline; and a parameter server's socket bound in a process of
its own (to be killed, as a PS that died)."""

from __future__ import annotations

import select
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator


class PickleBomb:
    """Unpickling this would create a file: proof that nothing from a socket was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def hello_fields(device_kind: str, buffer: dict, slot_bytes: int, num_slots: int,
                 buckets: list[list[tuple[str, str, tuple[int, ...], int]]]) -> dict:
    """A hello's fields with its plan inline (``buckets``), for ``protocol.encode("hello", ...)``: the
    PS sends the plan as a second frame (``plan_fragment``); tests build small ones by hand."""
    return {"device_kind": device_kind, "buffer": buffer, "slot_bytes": slot_bytes,
            "num_slots": num_slots, "buckets": [[[n, d, list(s), o] for n, d, s, o in b] for b in buckets]}


@contextmanager
def bound_in_process(handle: str, socket_type: str = "PAIR") -> Iterator[subprocess.Popen]:
    """A process of its own that binds ``handle`` (a ZeroMQ socket of ``socket_type``) and sits on it,
    as a PS rank does before it asks its engine to connect; yields the process once the handle is bound
    (kill it to play a PS that died). Killed on leaving, if still alive."""
    code = ("import sys, time, zmq\n"
            "sock = zmq.Context().socket(getattr(zmq, sys.argv[2]))\n"
            "sock.bind(sys.argv[1])\n"
            "print('bound', flush=True)\n"
            "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, handle, socket_type], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        poller = select.poll()   # not select(): a long test process may hold descriptors past FD_SETSIZE (1024)
        poller.register(proc.stdout, select.POLLIN)
        line = proc.stdout.readline() if poller.poll(60_000) else ""
        assert line == "bound\n", f"the binding process did not bind {handle} (it said {line!r})"
        yield proc
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def monitor_misses_disconnects(monkeypatch) -> None:
    """Every ``PeerWatch`` of this process as if ZeroMQ's monitor never reported a disconnect: the
    DISCONNECTED events it reads are turned into no event. A worker once kept waiting, in CI, for a PS
    that had closed its socket with no such event seen; the second signal (``PeerWatch.binder_left``:
    the PS's handle no longer bound) must end such a wait by itself."""
    import zmq
    import zmq.utils.monitor as monitor

    real = monitor.recv_monitor_message

    def without_disconnects(sock, flags: int = 0) -> dict:
        msg = real(sock, flags)
        return {**msg, "event": 0} if msg["event"] == zmq.EVENT_DISCONNECTED else msg

    monkeypatch.setattr(monitor, "recv_monitor_message", without_disconnects)
