"""Hostile replies on the compat (stock-wire) socket are refused without being unpickled.

A fake "stock worker" in this process connects to the PS rank's real REQ socket, reads the
buffer handle as raw bytes and answers with a pickle that would create a file if loaded,
binary garbage, text with control characters, or a frame over the reply limit. The PS rank
(a real process) fails the update with a typed error naming the cause, the marker file is
never created, and the next update, into real stock workers, delivers exact weights.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import threading
import uuid
from multiprocessing.connection import Listener

import pytest
import zmq

from ckpt_core.wire.stock import MAX_REPLY_BYTES
from support.asserts import assert_every_rank_failed
from support.engine import AUTH, EngineFront
from support.wire import PickleBomb
from support.world import FreshCheckpoints, PsWorld
from support.stock_workers import StockSimEngine, stock_dirs


def _globals(frame: bytes) -> list[str]:
    """The module-level names a pickle refers to, read without executing it."""
    out, strings = [], []
    for op, arg, _pos in pickletools.genops(frame):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            out.append(".".join(strings[-2:]))
        elif op.name == "GLOBAL":
            out.append(arg.replace(" ", "."))
    return out


class HostileWorker:
    """Answers the PS's first frame with ``reply`` on its handle; keeps the frames it got, as bytes."""

    def __init__(self, reply: bytes):
        self.reply, self.frames = reply, []
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTH)
        self.address = self.listener.address
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with self.listener.accept() as conn:
            handles, _ = conn.recv()
            ctx = zmq.Context()
            sock = ctx.socket(zmq.REP)
            sock.connect(next(iter(handles.values())))
            for wait_s in (20, 5):   # the buffer handle, then whatever the PS sends after our reply
                if not sock.poll(wait_s * 1000):
                    break
                self.frames.append(sock.recv())
                if len(self.frames) == 1:
                    sock.send(self.reply)
            sock.close(linger=0)
            ctx.term()
            conn.send([("ok", None)])   # the engine claims success: the PS must judge by its socket


@pytest.fixture(scope="module")
def world():
    with PsWorld("cpu", 1, init={"wire": "stock"}) as w:
        yield w


def _cases(marker: str) -> dict[str, tuple[bytes, str]]:
    return {
        "pickle": (pickle.dumps(PickleBomb(marker)), "not unpickled"),
        "garbage": (os.urandom(64) + b"\xff\xfe", "neither empty nor UTF-8 text"),
        "control characters": (b"Traceback\x00\x1b[31m", "not printable text"),
        "huge frame": (b"x" * (MAX_REPLY_BYTES + 1), "disconnected"),
    }


@pytest.mark.parametrize("case", list(_cases("")))
def test_a_hostile_reply_is_refused_unread_and_the_next_update_works(world, tmp_path, case):
    marker = str(tmp_path / f"pwned-{uuid.uuid4().hex}")
    reply, needle = _cases(marker)[case]
    ckpts = FreshCheckpoints(world, seed=21)
    name, want = ckpts.new(case.replace(" ", "-"))
    hostile = HostileWorker(reply)
    got = world.update(name, hostile, timeout=30)
    hostile.thread.join(30)
    assert_every_rank_failed(got, "RemoteWorkerError", "rank 0", needle)
    assert not os.path.exists(marker), "a reply was unpickled"
    # what the PS sent, inspected without loading: our buffer opener, then (except after a dropped
    # connection) the abort as a RuntimeError
    assert _globals(hostile.frames[0])[0] == "ckpt_core.wire.stock.open_shared_buffer"
    if case != "huge frame":
        assert "builtins.RuntimeError" in _globals(hostile.frames[1]), hostile.frames[1][:200]

    dirs = stock_dirs()
    if "0.4.2" not in dirs:
        pytest.skip("stock checkpoint-engine 0.4.2 not installed (scripts/stock_ce_env.sh): next update not run")
    front = EngineFront("cpu", 1, behavior={"stock_dir": dirs["0.4.2"]}, engine_cls=StockSimEngine)
    try:
        got = world.update(name, front, timeout=60)
        assert all(o.ok for o in got.values()), got
        assert front.digests(0) == want
    finally:
        front.close()
    ckpts.drop(name)
