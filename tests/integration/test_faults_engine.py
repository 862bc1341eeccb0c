"""Fault injection on the engine side: a worker that raises, never connects, is too slow, or dies.

One real world is shared by the cases (2 PS rank processes over gloo, 2 engine-worker
processes behind an engine front). Every case pushes a checkpoint of fresh random data,
fails in a known way, checks the error is typed and says what and where, that every healthy
worker's update_weights_from_ipc raised RemoteWorkerError and that no worker changed its
weights, then retries the same update in the same world and checks the engine holds exactly
the new weights. Time bounds are generous ceilings tied to the promise they guard (the
update timeout); the figures themselves are reported, not asserted.
"""

from __future__ import annotations

import time

import pytest

from support.asserts import assert_every_rank_failed as every_rank_failed
from support.asserts import assert_healthy_workers_aborted, report_case
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld

BUCKET_BYTES = 16 << 10          # small buckets: every checkpoint spans several
TIMEOUT_S = 3.0                  # the update timeout of the failing updates


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init={"max_bucket_gb": BUCKET_BYTES / (1 << 30)})
    try:
        ckpts = FreshCheckpoints(ps, seed=404)
        name, want = ckpts.new("baseline")
        got = ps.update(name, front, 30)
        assert all(o.ok for o in got.values()), got
        ps.n_buckets = got[0].value["buckets"]
        assert ps.n_buckets >= 4, "the cases need several buckets"
        ckpts.drop(name)
        yield ps, front, ckpts
    finally:
        ps.close()
        front.close()


def failed_update(ps, front, name, behaviors, *, timeout=TIMEOUT_S, aborts_healthy=True):
    """Run an update that must fail; unless ``aborts_healthy`` is false, check that the healthy
    workers aborted with RemoteWorkerError and that no worker committed anything. Returns every
    rank's outcome and the seconds taken."""
    before = {i: front.digests(i) for i in range(ps.size)}
    since = front.fanouts
    t0 = time.monotonic()
    got = ps.update(name, front, timeout, behaviors)
    dt = time.monotonic() - t0
    if aborts_healthy:
        assert_healthy_workers_aborted(front, since, before, failing=tuple(behaviors))
    return got, dt


def assert_every_rank_failed(got, error: str, *needles: str) -> str:
    """support.asserts.assert_every_rank_failed; returns rank 0's message."""
    return every_rank_failed(got, error, *needles)[0].message


def assert_retry_delivers(ps, front, ckpts, name, want) -> None:
    """The same update again, in the same world: succeeds; every engine holds exactly the new weights."""
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    for i in range(ps.size):
        assert front.digests(i) == want, f"engine worker {i} does not hold exactly {name}"
        assert front.stats(i)["mapped"] == [], f"engine worker {i} still maps an IPC buffer"
    held = ps.all("ipc_buffer")
    assert all(o.ok and o.value is None for o in held.values()), f"IPC buffers not released: {held}"
    ckpts.drop(name)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("where", ["first", "last"])
def test_an_engine_raising_on_one_rank_fails_every_rank_naming_it_and_a_retry_delivers(world, where, rank):
    ps, front, ckpts = world
    bucket = 0 if where == "first" else ps.n_buckets - 1
    name, want = ckpts.new(f"raise-{where}")
    got, dt = failed_update(ps, front, name, {rank: {"fail_bucket": bucket}}, timeout=30)
    msg = assert_every_rank_failed(got, "RemoteWorkerError", f"[rank {rank}]", f"bucket {bucket}",
                                   f"injected engine failure at bucket {bucket}", ps.device_uuids[rank])
    assert dt < 30, f"an engine error must be reported before the update timeout, took {dt:.1f} s"
    assert "Traceback" in msg, "the remote traceback travels with the error"
    report_case(f"engine raises on rank {rank}, {where} bucket ({bucket})",
                f"RemoteWorkerError [rank {rank}] + traceback", dt)
    assert_retry_delivers(ps, front, ckpts, name, want)


def test_a_post_hook_raising_on_one_rank_fails_every_rank_and_a_retry_delivers(world):
    ps, front, ckpts = world
    name, want = ckpts.new("post-hook")
    # post_hook is each worker's commit: the healthy one has committed when rank 1's fails
    got, dt = failed_update(ps, front, name, {1: {"fail_post_hook": True}}, timeout=30, aborts_healthy=False)
    assert_every_rank_failed(got, "RemoteWorkerError", "[rank 1]", "post-hook", "injected post-hook failure")
    assert dt < 30, f"a post-hook error must be reported before the update timeout, took {dt:.1f} s"
    report_case("engine post_hook raises (rank 1)", "RemoteWorkerError [rank 1] during post-hook", dt)
    assert_retry_delivers(ps, front, ckpts, name, want)


def test_an_engine_that_never_connects_times_out_naming_its_device(world):
    ps, front, ckpts = world
    name, want = ckpts.new("absent")
    got, dt = failed_update(ps, front, name, {1: {"never_connect": TIMEOUT_S + 1}})
    assert_every_rank_failed(got, "UpdateTimeoutError", "[rank 1]", f"engine worker {ps.device_uuids[1]} to connect")
    assert dt > TIMEOUT_S - 0.5, f"gave up after {dt:.1f} s, before the {TIMEOUT_S} s timeout"
    report_case("engine never connects (rank 1)", "UpdateTimeoutError [rank 1] names the device key", dt)
    assert_retry_delivers(ps, front, ckpts, name, want)


def test_an_engine_slower_than_the_timeout_fails_every_rank_in_time_naming_the_slow_rank(world):
    ps, front, ckpts = world
    name, want = ckpts.new("slow")
    runs = front.stats(1)["runs"]
    got, dt = failed_update(ps, front, name, {1: {"sleep_s": TIMEOUT_S + 1, "timeout": 30}})
    msg = assert_every_rank_failed(got, "UpdateTimeoutError", "[rank 1]", "to be loaded")
    assert "rank 0:" not in msg, f"rank 0's engine was on time and must not be blamed: {msg}"
    assert dt > TIMEOUT_S - 0.5, f"gave up after {dt:.1f} s, before the {TIMEOUT_S} s timeout"
    report_case("engine slower than the timeout (rank 1)", "UpdateTimeoutError [rank 1] bucket 0", dt)
    # The slow worker gave the dead update up after its current bucket, not after every queued one.
    assert front.stats(1)["runs"] == runs + 1, "the slow worker loaded buckets of an update already lost"
    assert_retry_delivers(ps, front, ckpts, name, want)


def test_an_engine_worker_killed_mid_update_is_noticed_at_once_and_a_restarted_one_gets_the_retry(world, tmp_path):
    ps, front, ckpts = world
    name, want = ckpts.new("killed")
    before = {i: front.digests(i) for i in range(ps.size)}
    since = front.fanouts
    slow = {1: {"sleep_s": 0.5, "mark_dir": str(tmp_path)}}
    ps.send("update", (name, front.address, 20.0, slow))
    marker = tmp_path / "w1-b1"
    deadline = time.monotonic() + 20
    while not marker.exists():          # worker 1 is inside run() for bucket 1
        assert time.monotonic() < deadline, "worker 1 never reached bucket 1"
        time.sleep(0.01)
    front.kill(1)
    t_kill = time.monotonic()
    got = ps.collect(timeout=60)
    dt = time.monotonic() - t_kill
    assert_every_rank_failed(got, "RemoteWorkerError", "[rank 1]", "disconnected", ps.device_uuids[1])
    assert dt < 20, f"a dead worker must be noticed, not waited for until the 20 s deadline (took {dt:.1f} s)"
    assert_healthy_workers_aborted(front, since, before, failing=(1,))
    report_case("engine worker SIGKILLed in bucket 1 (rank 1)", "RemoteWorkerError [rank 1] worker disconnected", dt)
    front.restart(1)
    assert_retry_delivers(ps, front, ckpts, name, want)
