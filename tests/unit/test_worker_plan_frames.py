"""The worker's per-tensor work on every update: the hello's plan in its own frame, decoded only
when the worker has not validated that plan before, and one torch call per tensor to view it.

Against the hand-driven fake parameter server of ``test_worker.py`` (real sockets, a real /dev/shm
buffer, the worker in a thread)."""

from __future__ import annotations

import threading

import pytest
import torch
import zmq
from torch.overrides import TorchFunctionMode

from ckpt_core import update_weights_from_ipc
from ckpt_core.errors import ProtocolError
from ckpt_core.wire import protocol as proto
from ckpt_core.wire import worker as _worker
from test_worker import SLOT, UPDATE, FakePs, Worker


@pytest.fixture
def fresh_plans():
    proto._plan_cache.clear()
    yield
    proto._plan_cache.clear()


def two_frames(ps: FakePs, *, plan: bytes | None = None) -> tuple[bytes, bytes]:
    text, digest = proto.plan_fragment(ps.plan)
    head, body = proto.encode_hello(UPDATE, device_kind="cpu", buffer=ps.ipc.descriptor, slot_bytes=SLOT,
                                    num_slots=2, plan_json=text, plan_digest=digest)
    return head, body if plan is None else plan


def full_update(ps: FakePs, hello: tuple[bytes, bytes], **worker) -> Worker:
    w = Worker(ps.handle, **worker)
    assert ps.sock.poll(5000, zmq.POLLOUT)
    ps.sock.send_multipart(hello)
    assert ps.recv()["kind"] == "ready"
    for i in range(2):
        ps.send("bucket", index=i, slot=i)
        assert ps.recv()["kind"] == "done"
    ps.send("end", keep_buffer=False)
    assert ps.recv()["kind"] == "finished"
    w.join()
    assert w.error is None, w.error
    return w


def assert_bit_exact(ps: FakePs, w: Worker) -> None:
    got = {n: t for call in w.calls for n, t in call.items()}
    assert set(got) == set(ps.tensors)
    for n, t in ps.tensors.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n


def test_a_hello_in_two_frames_loads_bit_exact_and_a_plan_already_validated_is_not_decoded_again(fresh_plans):
    first, second = FakePs(), FakePs()
    try:
        assert_bit_exact(first, full_update(first, two_frames(first)))
        # the same plan (digest, slot size) again: its frame is not even read as JSON
        assert_bit_exact(second, full_update(second, two_frames(second, plan=b"\xff not the plan")))
    finally:
        first.close()
        second.close()


def test_on_plan_sees_every_tensor_of_the_plan_in_one_tuple_made_once_per_plan(fresh_plans):
    first, second = FakePs(), FakePs()
    seen = []
    try:
        for ps in (first, second):
            full_update(ps, two_frames(ps), on_plan=seen.append)
    finally:
        first.close()
        second.close()
    want = (("w.a", torch.bfloat16, (8, 16)), ("w.b", torch.float32, (100,)), ("w.c", torch.float8_e4m3fn, (33,)))
    assert seen[0] == want and seen[1] is seen[0]   # the second update of that plan builds no listing


def test_a_new_plan_whose_frame_is_not_json_is_refused_before_anything_is_mapped(fresh_plans):
    ps = FakePs()
    try:
        w = Worker(ps.handle)
        assert ps.sock.poll(5000, zmq.POLLOUT)
        ps.sock.send_multipart(two_frames(ps, plan=b"\xff not the plan"))
        answer = ps.recv()
        w.join()
        assert answer["kind"] == "error" and "plan frame is not UTF-8 JSON" in answer["traceback"]
        assert isinstance(w.error, ProtocolError) and w.calls == []
        assert not [k for k in _worker._mapped if ps.ipc.descriptor["path"] in k]
    finally:
        ps.close()


def test_a_second_frame_after_a_bucket_notice_is_refused_and_nothing_of_it_is_loaded(fresh_plans):
    ps = FakePs()
    try:
        w = Worker(ps.handle)
        ps.send("hello", **ps.hello())
        assert ps.recv()["kind"] == "ready"
        ps.sock.send_multipart([proto.encode("bucket", UPDATE, index=0, slot=0), b"[]"])
        answer = ps.recv()
        w.join()
        assert answer["kind"] == "error" and "a bucket message of 2 frames" in answer["traceback"]
        assert isinstance(w.error, ProtocolError) and w.calls == []
    finally:
        ps.close()


class _Calls(TorchFunctionMode):
    """Counts the torch calls made while it is active (views and dtype views included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def test_each_tensor_is_handed_over_as_a_contiguous_view_made_by_one_torch_call(fresh_plans):
    """The receive loop's per-tensor work: one call per tensor (after one dtype view of the buffer per
    dtype), every view contiguous, of its dtype and shape, at its offset of the mapped buffer."""
    ps = FakePs()
    ps.plan = [[(f"t{i}", "BF16" if i % 3 else "F32", (2, 3) if i % 2 else (6,), 64 * i) for i in range(40)],
               [("w.c", "F8_E4M3", (33,), 0)]]
    seen, marks = [], []   # marks: the count of calls when run() starts and when it returns

    def run(weights):
        marks.append(counter.count)
        seen.extend((n, t.dtype, tuple(t.shape), t.is_contiguous(), t.data_ptr()) for n, t in weights)
        marks.append(counter.count)

    counter = _Calls()

    def main():
        with counter:
            update_weights_from_ipc(zmq.Context.instance(), ps.handle, 0, run=run, timeout=10)

    thread = threading.Thread(target=main, daemon=True)
    try:
        thread.start()
        ps.send("hello", **ps.hello())
        assert ps.recv()["kind"] == "ready"
        mapped = counter.count   # the worker now waits for the first bucket
        for i in range(2):
            ps.send("bucket", index=i, slot=i)
            assert ps.recv()["kind"] == "done"
        ps.send("end", keep_buffer=False)
        assert ps.recv()["kind"] == "finished"
        thread.join(10)
        # bucket 0: 40 tensors of two dtypes: 40 calls, plus a few per dtype (the buffer as that dtype);
        # bucket 1: one tensor of a third dtype. Viewing bytes, then dtype, then shape took 3 per tensor.
        assert marks[0] - mapped <= 40 + 5 * 2 and marks[2] - marks[1] <= 1 + 5, (mapped, marks)
        base = ps.ipc.tensor.data_ptr()
        want = [(f"t{i}", torch.bfloat16 if i % 3 else torch.float32, (2, 3) if i % 2 else (6,), True, base + 64 * i)
                for i in range(40)] + [("w.c", torch.float8_e4m3fn, (33,), True, base + SLOT)]
        assert [s[:4] for s in seen] == [w[:4] for w in want]
        # the worker maps its own view of the /dev/shm file: compare offsets within it
        assert [s[4] - seen[0][4] for s in seen] == [w[4] - base for w in want]
    finally:
        thread.join(1)
        ps.close()
