"""The engine-side receive loop against a hand-driven fake parameter server (in process).

The fake binds the PAIR socket and a real /dev/shm buffer and sends exactly the frames a
test wants; the worker runs in a thread. Malformed or foreign frames must be refused with a
ProtocolError, answered with an error frame, and never reach ``run``.
"""

from __future__ import annotations

import json
import os
import re
import pickle
import threading
import time
import uuid

import pytest
import torch
import zmq

from ckpt_core.wire import protocol as proto
from ckpt_core.wire import worker as _worker
from ckpt_core import update_weights_from_ipc
from ckpt_core.devices.cpu import CpuBackend
from ckpt_core.wire.endpoint import endpoint_bound
from ckpt_core.errors import ConfigError, ProtocolError, RemoteWorkerError, TransportError, UpdateTimeoutError
from support.ports import free_port
from support.wire import PickleBomb, bound_in_process, hello_fields, monitor_misses_disconnects

SLOT = 4096
UPDATE = "fake-update"


class FakePs:
    """Binds the handle and owns a 2-slot /dev/shm buffer, like one PS rank would."""

    def __init__(self, handle: str | None = None):
        self.ctx = zmq.Context()
        self.handle = handle or f"ipc://@ckpt-test-{uuid.uuid4().hex}"
        self.sock = self.ctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.handle)
        self.ipc = CpuBackend().alloc_ipc(2 * SLOT, 0, f"test-{uuid.uuid4().hex[:12]}")
        gen = torch.Generator().manual_seed(3)
        self.tensors = {"w.a": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
                        "w.b": torch.randn(100, generator=gen),
                        "w.c": (torch.randn(33, generator=gen) * 3).to(torch.float8_e4m3fn)}
        self.plan = [[("w.a", "BF16", (8, 16), 0), ("w.b", "F32", (100,), 256)], [("w.c", "F8_E4M3", (33,), 0)]]
        for slot, bucket in enumerate(self.plan):
            for name, _, _, off in bucket:
                raw = self.tensors[name].reshape(-1).view(torch.uint8)
                self.ipc.tensor[slot * SLOT + off: slot * SLOT + off + raw.numel()] = raw

    def hello(self, **over) -> dict:
        fields = hello_fields("cpu", self.ipc.descriptor, SLOT, 2, self.plan)
        fields.update(over)
        return fields

    def send(self, kind: str, update: str = UPDATE, **fields) -> None:
        self.send_raw(proto.encode(kind, update, **fields))

    def send_raw(self, data: bytes, wait: float = 5.0) -> bool:
        """A bound PAIR blocks on send while no worker is connected: wait a while, then give up."""
        if not self.sock.poll(int(wait * 1000), zmq.POLLOUT):
            return False
        self.sock.send(data, zmq.NOBLOCK)
        return True

    def recv(self, timeout: float = 5.0) -> dict:
        assert self.sock.poll(int(timeout * 1000)), "the worker did not answer"
        return proto.decode(self.sock.recv(), expect=proto.WORKER_KINDS)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        self.ipc.close()


class Worker:
    """update_weights_from_ipc in a thread; records run() calls and the outcome."""

    def __init__(self, handle: str, *, timeout: float = 10.0, run=None, post_hook=None, slices=None, on_plan=None,
                 should_stop=None):
        self.calls: list[dict[str, torch.Tensor]] = []
        self.error: BaseException | None = None
        self.hooked = 0
        self._run, self._post = run, post_hook

        def run_fn(weights):
            self.calls.append({n: t.clone() for n, t in weights})
            if self._run:
                self._run(len(self.calls) - 1)

        def post():
            self.hooked += 1
            if self._post:
                self._post()

        def main():
            try:
                update_weights_from_ipc(zmq.Context.instance(), handle, 0, run=run_fn, post_hook=post, timeout=timeout,
                                        slices=slices, on_plan=on_plan, should_stop=should_stop)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=main, daemon=True)
        self.t0 = time.monotonic()
        self.thread.start()

    def join(self, timeout: float = 10.0) -> float:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the worker is still in its loop"
        return time.monotonic() - self.t0


@pytest.fixture
def ps():
    p = FakePs()
    yield p
    p.close()
    assert not [k for k in _worker._mapped if "test-" in k], "the worker kept a buffer mapped"


def handshake(ps: FakePs) -> Worker:
    w = Worker(ps.handle)
    ps.send("hello", **ps.hello())
    assert ps.recv()["kind"] == "ready"
    return w


def finish(ps: FakePs, w: Worker, buckets: int = 2) -> None:
    """The rest of a genuine update after its hello was answered: every bucket done, the end finished."""
    for i in range(buckets):
        ps.send("bucket", index=i, slot=i)
        assert ps.recv()["kind"] == "done"
    ps.send("end", keep_buffer=False)
    assert ps.recv()["kind"] == "finished"
    w.join()


# ------------------------------------------------------------------ the genuine exchange
def test_a_genuine_update_loads_every_tensor_bit_exact_and_runs_the_post_hook_once(ps):
    w = handshake(ps)
    for i in range(2):
        ps.send("bucket", index=i, slot=i)
        assert ps.recv() == {"v": 1, "kind": "done", "update": UPDATE, "index": i}
    ps.send("end", keep_buffer=False)
    assert ps.recv()["kind"] == "finished"
    w.join()
    assert w.error is None and w.hooked == 1
    got = {n: t for call in w.calls for n, t in call.items()}
    assert set(got) == set(ps.tensors)
    for n, t in ps.tensors.items():
        assert got[n].dtype == t.dtype and torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n


PLAN = "5e" * 20


@pytest.mark.parametrize("mine, sent, words", [
    ((PLAN, 0), {"plan": PLAN, "rank": 1}, "engine rank 0 of slice plan 5e5e5e5e5e5e, but .* engine rank 1"),
    ((PLAN, 1), {"plan": "77" * 20, "rank": 1}, "routes the update by slice plan 777777777777"),
    ((PLAN, 1), None, "sends whole tensors"),
    (None, {"plan": PLAN, "rank": 0}, "told of no slice plan"),
])
def test_a_worker_refuses_slices_routed_for_another_engine_rank_or_plan_before_mapping_anything(ps, mine, sent,
                                                                                                 words):
    """The hello names the slice plan and the engine rank the PS routed to this worker; a worker that is
    another rank of that plan, or loads by another plan (or none), answers a ConfigError, maps nothing
    and loads nothing."""
    w = Worker(ps.handle, slices=mine)
    ps.send("hello", **ps.hello(**({} if sent is None else {"slices": sent})))
    answer = ps.recv()
    assert answer["kind"] == "error" and answer["traceback"].startswith("ConfigError: ")
    w.join()
    assert isinstance(w.error, ConfigError) and w.calls == []
    assert re.search(words, str(w.error)), w.error
    assert not [k for k in _worker._mapped if ps.ipc.descriptor["path"] in k], "the buffer was mapped"


@pytest.mark.parametrize("bad", ["ab", ("ab",), ("", 0), ("ab", -1), (3, 0), ("ab", 1.5), ("ab", 0, 1)])
def test_a_malformed_slices_argument_is_a_config_error_before_connecting(bad):
    with pytest.raises(ConfigError, match="slices must be"):
        update_weights_from_ipc(zmq.Context.instance(), "ipc://@ckpt-nobody", 0, run=lambda w: None, slices=bad)


def test_a_worker_loads_the_slices_of_its_own_engine_rank_of_its_plan(ps):
    w = Worker(ps.handle, slices=(PLAN, 1))
    ps.send("hello", **ps.hello(slices={"plan": PLAN, "rank": 1}))
    assert ps.recv()["kind"] == "ready"
    finish(ps, w)
    assert w.error is None and len(w.calls) == 2


def test_a_kept_buffer_stays_mapped_for_the_next_update_until_released(ps):
    _kept_update(ps)
    keys = [k for k in _worker._mapped if ps.ipc.descriptor["path"] in k]
    assert len(keys) == 1
    _worker._unmap(keys[0])


def _kept_update(ps: FakePs) -> None:
    w = handshake(ps)
    for i in range(2):
        ps.send("bucket", index=i, slot=i)
        ps.recv()
    ps.send("end", keep_buffer=True)
    assert ps.recv()["kind"] == "finished"
    w.join()
    assert w.error is None


def test_a_new_buffer_for_the_device_replaces_a_kept_one_of_a_ps_that_went_away():
    first, second = FakePs(), FakePs()          # e.g. a PS that died holding its buffer, then its successor
    try:
        _kept_update(first)
        _kept_update(second)
        held = [k for k in _worker._mapped if "test-" in k]
        assert held == [k for k in held if second.ipc.descriptor["path"] in k] and len(held) == 1, held
        _worker._unmap(held[0])
    finally:
        first.close()
        second.close()


# ------------------------------------------------------------------ foreign or malformed first frames
def _first_frames(ps: FakePs, marker: str) -> dict[str, bytes]:
    good = ps.hello()
    enc = lambda **kw: json.dumps(kw).encode()  # noqa: E731
    return {
        "garbage bytes": os.urandom(64) + b"\xff",
        "a pickle payload": pickle.dumps(PickleBomb(marker)),
        "a JSON list": b"[1, 2, 3]",
        "deeply nested JSON": b"[" * 50000 + b"]" * 50000,
        "another protocol version": enc(v=2, kind="hello", update=UPDATE, **good),
        "a bucket before the hello": proto.encode("bucket", UPDATE, index=0, slot=0),
        "a worker's own kind": proto.encode("ready", UPDATE),
        "no update id": enc(v=1, kind="hello", **good),
        "tensors outside the buffer": proto.encode("hello", UPDATE, **ps.hello(
            buckets=[[["w.a", "BF16", [8, 16], SLOT - 64]]])),
        "a buffer smaller than its slots": proto.encode("hello", UPDATE, **ps.hello(
            buffer=dict(ps.ipc.descriptor, nbytes=SLOT))),
        "an unknown dtype": proto.encode("hello", UPDATE, **ps.hello(buckets=[[["w.a", "I4", [8], 0]]])),
    }


@pytest.mark.parametrize("case", ["garbage bytes", "a pickle payload", "a JSON list", "deeply nested JSON",
                                  "another protocol version", "a bucket before the hello", "a worker's own kind",
                                  "no update id", "tensors outside the buffer", "a buffer smaller than its slots",
                                  "an unknown dtype"])
def test_a_malformed_first_frame_is_refused_answered_and_nothing_runs(ps, tmp_path, case):
    marker = str(tmp_path / "unpickled")
    w = Worker(ps.handle)
    ps.send_raw(_first_frames(ps, marker)[case])
    answer = ps.recv()
    dt = w.join()
    assert isinstance(w.error, ProtocolError), repr(w.error)
    assert answer["kind"] == "error" and "ProtocolError" in answer["traceback"], answer
    assert w.calls == [] and w.hooked == 0
    assert not os.path.exists(marker), "a pickle was loaded"
    assert dt < 5


def test_the_refusal_of_another_versions_hello_is_addressed_to_its_update(ps):
    w = Worker(ps.handle)
    ps.send_raw(json.dumps({"v": 2, "kind": "hello", "update": "u-v2", **ps.hello()}).encode())
    answer = ps.recv()
    w.join()
    assert answer["update"] == "u-v2" and "version 2" in answer["traceback"], answer


def test_a_buffer_outside_the_shared_memory_folder_is_refused(ps):
    w = Worker(ps.handle)
    ps.send("hello", **ps.hello(buffer={"kind": "cpu", "path": "/etc/passwd", "nbytes": 2 * SLOT}))
    answer = ps.recv()
    w.join()
    assert isinstance(w.error, TransportError) and "refusing to map" in str(w.error)
    assert answer["kind"] == "error" and "refusing to map" in answer["traceback"]
    assert w.calls == []


# ------------------------------------------------------------------ bad frames after the handshake
@pytest.mark.parametrize("case", ["another update's bucket", "bucket index out of range", "bucket out of order",
                                  "slot out of range", "a second hello", "garbage"])
def test_a_bad_frame_after_the_handshake_is_refused_and_nothing_runs(ps, case):
    w = handshake(ps)
    frames = {
        "another update's bucket": proto.encode("bucket", "someone-else", index=0, slot=0),
        "bucket index out of range": proto.encode("bucket", UPDATE, index=2, slot=0),
        "bucket out of order": proto.encode("bucket", UPDATE, index=1, slot=1),
        "slot out of range": proto.encode("bucket", UPDATE, index=0, slot=2),
        "a second hello": proto.encode("hello", UPDATE, **ps.hello()),
        "garbage": b"\x00\x01\x02",
    }
    ps.send_raw(frames[case])
    answer = ps.recv()
    assert answer["kind"] == "error" and "ProtocolError" in answer["traceback"], answer
    ps.send_raw(proto.encode("abort", UPDATE, reason="the PS gives up"), wait=0.5)   # as a genuine PS would
    w.join()
    assert isinstance(w.error, ProtocolError), repr(w.error)
    assert w.calls == [] and w.hooked == 0


def test_a_frame_over_the_size_limit_is_dropped_by_zeromq_and_the_worker_leaves(ps, monkeypatch):
    monkeypatch.setattr(proto, "MAX_FRAME_BYTES", 1024)
    w = Worker(ps.handle, timeout=30)
    ps.send_raw(b"{" + b" " * 4096 + b"}")
    dt = w.join()
    assert isinstance(w.error, TransportError) and dt < 5, (repr(w.error), dt)
    assert w.calls == []


# ------------------------------------------------------------------ a PS that fails, leaves or goes silent
def test_an_abort_before_the_hello_is_a_remote_worker_error_with_the_reason_and_nothing_runs(ps):
    """A PS rank whose update failed before it sent its hello (another rank's worker refused first) ends
    the worker's call with an abort: the worker leaves as aborted, not with a protocol error of its own."""
    w = Worker(ps.handle)
    ps.send("abort", reason="rank 0: engine worker refused the plan")
    w.join()
    assert isinstance(w.error, RemoteWorkerError), repr(w.error)
    assert "before its hello" in str(w.error) and "rank 0: engine worker refused the plan" in str(w.error)
    assert w.calls == [] and w.hooked == 0


def test_an_abort_after_a_bucket_is_a_remote_worker_error_with_the_reason(ps):
    w = handshake(ps)
    ps.send("bucket", index=0, slot=0)
    assert ps.recv()["kind"] == "done"
    ps.send("abort", reason="rank 1: engine worker failed (bucket 1)")
    w.join()
    assert isinstance(w.error, RemoteWorkerError) and "rank 1: engine worker failed" in str(w.error)
    assert len(w.calls) == 1 and w.hooked == 0


def _unfinished_worker(ps: FakePs, events: list[str], fail: int | None = None, **hello) -> dict:
    """A worker whose run() leaves each bucket unfinished (``_worker.Unfinished``): runs and finishes recorded in
    ``events``; the finish of bucket ``fail`` raises."""
    out: dict = {}

    def run(weights):
        i = sum(e.startswith("run") for e in events)
        events.append(f"run {i}")

        def finish():
            events.append(f"finish {i}")
            if i == fail:
                raise ValueError(f"bucket {i} failed its checks once read back")
        return _worker.Unfinished(finish)

    def main():
        try:
            update_weights_from_ipc(zmq.Context.instance(), ps.handle, 0, run=run, timeout=10.0)
        except BaseException as exc:   # noqa: BLE001 - recorded for the test
            out["error"] = exc
    out["thread"] = threading.Thread(target=main, daemon=True)
    out["thread"].start()
    ps.send("hello", **ps.hello(**hello))
    assert ps.recv()["kind"] == "ready"
    return out


def test_with_a_single_slot_an_unfinished_bucket_is_finished_and_done_at_once(ps):
    """A PS with one slot sends the next bucket only once this one is done: holding it would deadlock."""
    events: list[str] = []
    w = _unfinished_worker(ps, events, num_slots=1)
    for i in range(2):
        ps.send("bucket", index=i, slot=0)
        assert ps.recv()["index"] == i
    assert events == ["run 0", "finish 0", "run 1", "finish 1"]
    ps.send("end", keep_buffer=False)
    assert ps.recv()["kind"] == "finished"
    w["thread"].join(10)
    assert "error" not in w


def test_a_bucket_left_unfinished_is_done_only_after_the_next_bucket_ran_and_it_finished(ps):
    """The pipelined receive loop: bucket 0's done waits for bucket 1's run (its host work overlaps bucket 0's
    device work) and for bucket 0's finish; the last bucket is finished at once."""
    events: list[str] = []
    w = _unfinished_worker(ps, events)
    ps.send("bucket", index=0, slot=0)
    assert not ps.sock.poll(300), "bucket 0 reported done before the next bucket ran"
    assert events == ["run 0"]
    ps.send("bucket", index=1, slot=1)
    assert [ps.recv()["index"] for _ in range(2)] == [0, 1]
    assert events == ["run 0", "run 1", "finish 0", "finish 1"]
    ps.send("end", keep_buffer=False)
    assert ps.recv()["kind"] == "finished"
    w["thread"].join(10)
    assert "error" not in w


@pytest.mark.parametrize("fail", [0, 1])
def test_an_unfinished_bucket_whose_finish_raises_is_reported_under_its_own_index(ps, fail):
    events: list[str] = []
    w = _unfinished_worker(ps, events, fail=fail)
    for i in range(2):
        ps.send("bucket", index=i, slot=i)
    answers = [ps.recv()]
    if fail == 1:
        answers.append(ps.recv())
    assert [a["kind"] for a in answers] == ["done"] * fail + ["error"]
    assert answers[-1]["index"] == fail and f"bucket {fail} failed its checks" in answers[-1]["traceback"]
    ps.send("abort", reason="rank 0: engine worker failed")
    w["thread"].join(10)
    assert isinstance(w["error"], ValueError) and f"bucket {fail}" in str(w["error"])
    assert events == ["run 0", "run 1", "finish 0"] + (["finish 1"] if fail == 1 else [])


def test_unfinished_finishes_once_and_a_failure_is_raised_again():
    calls = []

    def boom():
        calls.append(1)
        raise ValueError("bad")
    u = _worker.Unfinished(boom)
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            u.finish()
    assert calls == [1]
    ok = _worker.Unfinished(lambda: calls.append(2))
    ok.finish()
    ok.finish()
    assert calls == [1, 2]


@pytest.mark.parametrize("bucket", [0, 1])
def test_run_raising_is_answered_with_its_traceback_and_reraised_after_the_abort(ps, bucket):
    def run(i):
        if i == bucket:
            raise ValueError(f"engine cannot load bucket {i}")
    w = Worker(ps.handle, run=run)
    ps.send("hello", **ps.hello())
    assert ps.recv()["kind"] == "ready"
    for i in range(bucket + 1):
        ps.send("bucket", index=i, slot=i)
    answers = [ps.recv() for _ in range(bucket + 1)]
    assert answers[-1]["kind"] == "error" and answers[-1]["index"] == bucket
    assert f"ValueError: engine cannot load bucket {bucket}" in answers[-1]["traceback"]
    ps.send("abort", reason="rank 0: engine worker failed")
    w.join()
    assert isinstance(w.error, ValueError) and w.hooked == 0


def test_a_post_hook_raising_is_answered_and_reraised(ps):
    def post():
        raise RuntimeError("hook failed")
    w = Worker(ps.handle, post_hook=post)
    ps.send("hello", **ps.hello())
    ps.recv()
    for i in range(2):
        ps.send("bucket", index=i, slot=i)
        ps.recv()
    ps.send("end", keep_buffer=False)
    answer = ps.recv()
    w.join()
    assert answer["kind"] == "error" and answer["index"] == -1 and "hook failed" in answer["traceback"]
    assert isinstance(w.error, RuntimeError)


@pytest.mark.parametrize("monitor", ["reports the disconnect", "misses the disconnect"])
def test_a_ps_that_goes_away_mid_update_is_a_transport_error_at_once(ps, monitor, monkeypatch):
    """Noticed by ZeroMQ's disconnect event, or without it (once, in CI, it was never seen and the worker
    waited out the test) by the PS's handle no longer bound, about a second later."""
    if monitor == "misses the disconnect":
        if endpoint_bound(ps.handle) is not True:
            pytest.skip("this machine's socket table cannot tell whether the PS's handle is bound")
        monitor_misses_disconnects(monkeypatch)
    w = Worker(ps.handle, timeout=30)
    ps.send("hello", **ps.hello())
    assert ps.recv()["kind"] == "ready"
    ps.sock.close(linger=0)                      # its process died
    dt = w.join()
    assert isinstance(w.error, TransportError) and "closed the connection" in str(w.error), repr(w.error)
    if monitor == "misses the disconnect":
        assert "is not bound any more" in str(w.error), repr(w.error)
    assert dt < 5, f"noticed after {dt:.1f} s; the timeout was 30 s"
    ps.sock = ps.ctx.socket(zmq.PAIR)            # for the fixture's close


def test_bucket_notices_left_by_a_dead_ps_are_not_loaded(ps):
    entered = threading.Event()

    def run(i):
        entered.set()
        time.sleep(0.3)                          # the PS dies while bucket 0 loads
    w = Worker(ps.handle, timeout=30, run=run)
    ps.send("hello", **ps.hello())
    ps.recv()
    ps.send("bucket", index=0, slot=0)
    assert entered.wait(5)
    ps.send("bucket", index=1, slot=1)
    ps.sock.close(linger=0)
    w.join()
    assert isinstance(w.error, TransportError), repr(w.error)
    assert len(w.calls) == 1, "the dead update's second bucket was loaded"
    ps.sock = ps.ctx.socket(zmq.PAIR)


def _unchecked_handle() -> str:
    """A handle nobody binds on a transport whose binding cannot be looked up: waited for as before."""
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("bound", [True, False], ids=["silent-ps", "unchecked-absent-ps"])
def test_a_silent_or_absent_ps_is_a_timeout_naming_what_was_awaited(bound):
    if bound:
        ps = FakePs()
        handle = ps.handle
    else:
        ps, handle = None, _unchecked_handle()
    try:
        w = Worker(handle, timeout=0.5)
        dt = w.join()
        assert isinstance(w.error, UpdateTimeoutError) and "waiting for hello" in str(w.error), repr(w.error)
        assert 0.4 < dt < 3
    finally:
        if ps is not None:
            ps.close()


@pytest.mark.parametrize("bound", [True, False], ids=["silent-ps", "unchecked-absent-ps"])
def test_a_wait_its_owner_gives_up_ends_at_once_naming_why_not_at_the_timeout(bound):
    """``should_stop``: a worker receiving on a thread of its own (a stage) whose PS never sends its hello
    (bound and silent, or absent behind a handle whose binding cannot be looked up) ends its wait
    within a poll once its owner drops it, with the owner's reason, not at the update's timeout (a
    dropped stage that waited on kept the engine's next update waiting, then failing)."""
    if bound:
        ps = FakePs()
        handle = ps.handle
    else:
        ps, handle = None, _unchecked_handle()
    dropped = threading.Event()
    try:
        w = Worker(handle, timeout=60, should_stop=lambda: "the stage of 'v1' was dropped" if dropped.is_set() else None)
        time.sleep(1.5)   # past the first looks at the PS's handle
        assert w.thread.is_alive() and w.error is None   # still waiting: nothing asked it to stop
        dropped.set()
        dt = w.join(5)
        assert isinstance(w.error, ConfigError), repr(w.error)
        assert "the stage of 'v1' was dropped (waiting for hello/abort)" in str(w.error), str(w.error)
        assert dt < 4.0 and not w.calls
    finally:
        if ps is not None:
            ps.close()


# ------------------------------------------------------------------ a PS that gave up before the worker connected

@pytest.mark.parametrize("how", ["never-bound", "closed", "killed"])
def test_a_worker_whose_ps_gave_up_before_it_connected_fails_soon_having_loaded_nothing(how, monkeypatch):
    """A worker that runs the request after its PS gave the update up (its deadline, a stop: it closed
    the socket; its process died) finds the handle bound by nobody. It waits for the grace a PS rank
    slower than the one that posted the handle may need to bind (2 s here), then fails with
    TransportError, not after its timeout (60 s here) with the engine blocked; nothing ran and nothing
    stays mapped."""
    from ckpt_core.wire import link

    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 2.0)
    handle = f"ipc://@ckpt-test-gone-{uuid.uuid4().hex}"
    if how == "closed":
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PAIR)
        sock.bind(handle)
        sock.close(linger=0)
        ctx.term()
    elif how == "killed":
        with bound_in_process(handle) as proc:
            proc.kill()
            proc.wait(30)
    w = Worker(handle, timeout=60)
    dt = w.join(30)
    assert isinstance(w.error, TransportError), repr(w.error)
    assert str(w.error) == (f"the parameter server's socket {handle} is not bound: it gave the update up (deadline, "
                            "stop or death) before this worker connected; nothing was loaded (waiting for hello/abort)")
    assert 2.0 <= dt < 10, f"noticed after {dt:.1f} s; the grace was 2 s, the timeout 60 s"
    assert not w.calls and w.hooked == 0
    assert not [k for k in _worker._mapped if handle in k]


def test_a_handle_its_ps_rank_binds_after_the_worker_was_told_it_is_waited_for(monkeypatch):
    """Every PS rank posts every rank's handle: a worker may be told its handle by rank 0 before its
    own rank bound it (still allocating its buffer, say). A handle not yet bound is waited for within
    the grace (5 s here; bound after 2.5 s, past the worker's first looks) and the update completes."""
    from ckpt_core.wire import link

    monkeypatch.setattr(link, "NEVER_BOUND_GRACE_S", 5.0)
    handle = f"ipc://@ckpt-test-late-{uuid.uuid4().hex}"
    w = Worker(handle, timeout=30)
    time.sleep(2.5)
    assert w.thread.is_alive() and w.error is None, repr(w.error)
    late = FakePs(handle)
    try:
        late.send("hello", **late.hello())
        assert late.recv()["kind"] == "ready"
        finish(late, w)
        assert w.error is None and len(w.calls) == 2, repr(w.error)
    finally:
        late.close()


def test_a_slow_ps_that_bound_its_handle_is_waited_for_and_the_update_completes(ps):
    """A PS that bound its handle and sends its hello late (1.5 s: past the worker's first looks at
    the handle) is no PS that gave up: the update runs to the end, bit exact."""
    w = Worker(ps.handle, timeout=30)
    time.sleep(1.5)
    assert w.thread.is_alive() and w.error is None, repr(w.error)
    ps.send("hello", **ps.hello())
    assert ps.recv()["kind"] == "ready"
    finish(ps, w)
    assert w.error is None, repr(w.error)
    got = {n: t for call in w.calls for n, t in call.items()}
    assert set(got) == set(ps.tensors)
    assert all(torch.equal(got[n].view(torch.uint8), ps.tensors[n].view(torch.uint8)) for n in got)
    assert w.hooked == 1
