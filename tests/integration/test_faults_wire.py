"""Foreign or malformed frames on real engine-worker processes' sockets.

A fake parameter server (this test process) binds the handles the engine is told to
connect to and sends garbage, another protocol version, the wrong kind, tensors outside
the buffer, a pickle that would run code, a buffer path outside /dev/shm. Each worker
refuses with a typed error (ProtocolError; TransportError for the buffer path), runs
nothing, and a following genuine update from a real PS world delivers exact weights.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
import uuid
from multiprocessing.connection import Client

import pytest
import zmq

from ckpt_core.wire import protocol as proto
from ckpt_core import local_device_key
from support.asserts import report_case
from support.engine import AUTH, EngineFront
from support.wire import PickleBomb, hello_fields
from support.world import FreshCheckpoints, PsWorld

SLOT = 4096


def _hello(**over) -> dict:
    fields = hello_fields("cpu", {"kind": "cpu", "path": f"/dev/shm/ckpt-foreign-{uuid.uuid4().hex}",
                                        "nbytes": SLOT}, SLOT, 1, [[("w", "F32", (16,), 0)]])
    fields.update(over)
    return fields


def frames(marker: str) -> dict[str, tuple[bytes, str]]:
    """case -> (first frame, the error class the worker must raise)."""
    return {
        "garbage": (os.urandom(200) + b"\xfe", "ProtocolError"),
        "pickle payload": (pickle.dumps(PickleBomb(marker)), "ProtocolError"),
        "wrong version": (json.dumps({"v": 0, "kind": "hello", "update": "x", **_hello()}).encode(), "ProtocolError"),
        "wrong kind": (proto.encode("bucket", "x", index=0, slot=0), "ProtocolError"),
        "tensors outside the buffer": (proto.encode("hello", "x", **_hello(buckets=[[["w", "F32", [2048], 0]]])),
                                       "ProtocolError"),
        "buffer path outside /dev/shm": (proto.encode("hello", "x", **_hello(
            buffer={"kind": "cpu", "path": "/etc/passwd", "nbytes": SLOT})), "TransportError"),
    }


class ForeignPs:
    """Binds one handle per engine worker and asks the engine front to connect them to it."""

    def __init__(self, front: EngineFront, world: int):
        self.ctx = zmq.Context()
        self.socks, handles = [], {}
        for i in range(world):
            h = f"ipc://@ckpt-foreign-{uuid.uuid4().hex}-{i}"
            s = self.ctx.socket(zmq.PAIR)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(h)
            self.socks.append(s)
            handles[local_device_key("cpu", i)] = h
        self.results = None
        self.thread = threading.Thread(target=self._ask, args=(front.address, handles), daemon=True)
        self.thread.start()

    def _ask(self, address, handles) -> None:
        with Client(address, authkey=AUTH) as c:
            c.send((handles, {i: {"timeout": 20} for i in range(len(handles))}))
            self.results = c.recv()

    def send_to_all(self, frame: bytes) -> list[dict]:
        answers = []
        for s in self.socks:
            assert s.poll(20000, zmq.POLLOUT), "the engine worker never connected"
            s.send(frame, zmq.NOBLOCK)
        for s in self.socks:
            assert s.poll(20000), "the engine worker did not answer"
            answers.append(proto.decode(s.recv(), expect=proto.WORKER_KINDS))
        return answers

    def finish(self, timeout: float = 30) -> list:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the engine workers did not leave"
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()
        return self.results


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)})
    try:
        yield ps, front, FreshCheckpoints(ps, seed=31)
    finally:
        ps.close()
        front.close()


@pytest.mark.parametrize("case", list(frames("")))
def test_a_foreign_frame_is_refused_nothing_runs_and_a_genuine_update_follows(world, tmp_path, case):
    ps, front, ckpts = world
    marker = str(tmp_path / "unpickled")
    frame, error = frames(marker)[case]
    runs_before = [front.stats(i)["runs"] for i in range(2)]
    t0 = time.monotonic()
    foreign = ForeignPs(front, 2)
    answers = foreign.send_to_all(frame)
    results = foreign.finish()
    dt = time.monotonic() - t0
    for i, (answer, result) in enumerate(zip(answers, results)):
        assert answer["kind"] == "error", (i, answer)
        assert result[0] == "error" and f"{error}" in result[1], (i, result)
    assert not os.path.exists(marker), "a pickle was loaded by an engine worker"
    for i in range(2):
        stats = front.stats(i)
        assert stats["runs"] == runs_before[i], f"engine worker {i} ran a bucket of a foreign frame"
        assert stats["mapped"] == [], f"engine worker {i} mapped a foreign buffer"
    report_case(f"foreign frame on the worker socket: {case}", f"{error} in both workers, run() not called", dt)
    name, want = ckpts.new("genuine")
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    assert all(front.digests(i) == want for i in range(2))
    ckpts.drop(name)
