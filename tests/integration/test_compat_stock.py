"""Our PS with the compat codec (wire="stock"/"stock-0.3") drives the STOCK checkpoint-engine worker.

Real processes: two PS ranks (gloo, /dev/shm buffer) and two engine-worker processes running
the stock ``checkpoint_engine.worker.update_weights_from_ipc`` of a release installed from
PyPI (0.4.2: two final messages; 0.3.4 and 0.2.1: one). Buckets are kept small so that every
update has several of them and slots are reused.
"""

from __future__ import annotations

import pytest

from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.stock_workers import StockSimEngine, stock_params, wire_of

SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(40_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}


@pytest.fixture(params=stock_params(), scope="module")
def stock(request):
    """(release, its folder, the PS world speaking its wire, the engine of stock workers)."""
    version, folder = request.param
    world = PsWorld("cpu", 2, init={"wire": wire_of(version)}, env=SMALL_BUCKETS)
    front = EngineFront("cpu", 2, behavior={"stock_dir": folder}, engine_cls=StockSimEngine)
    try:
        yield version, folder, world, front
    finally:
        front.close()
        world.close()


def test_stock_workers_receive_exact_weights_and_switch_on_the_next_update(stock):
    version, _folder, world, front = stock
    ckpts = FreshCheckpoints(world, seed=12)
    for _ in range(2):   # the second update must replace every tensor with the new step's
        name, want = ckpts.new("step")
        got = world.update(name, front, timeout=60)
        assert all(o.ok for o in got.values()), got
        assert got[0].value["buckets"] >= 4, f"buckets too large to exercise slot reuse: {got[0].value}"
        loaded = {**front.digests(0)}
        assert loaded == front.digests(1) == want, f"stock {version}: engines hold other bytes"
        ckpts.drop(name)


def test_a_failure_in_the_stock_workers_run_reaches_every_rank_and_the_next_update_works(stock):
    version, _folder, world, front = stock
    ckpts = FreshCheckpoints(world, seed=13)
    name, want = ckpts.new("fail")
    before = [front.digests(i) for i in range(2)]
    got = world.update(name, front, timeout=60, behaviors={1: {"fail_bucket": 1}})
    if version.startswith("0.2."):
        # 0.2.x answers an error with a pickled exception: refused unread, still a failure of rank 1
        assert_every_rank_failed(got, "RemoteWorkerError", "rank 1", "not unpickled")
    else:
        assert_every_rank_failed(got, "RemoteWorkerError", "rank 1", "injected engine failure at bucket 1")
    # post_hook never ran, so no engine committed anything of the failed update
    assert [front.digests(i) for i in range(2)] == before
    got = world.update(name, front, timeout=60)
    assert all(o.ok for o in got.values()), got
    assert front.digests(0) == front.digests(1) == want
    ckpts.drop(name)


@pytest.mark.parametrize("sleep_s", [1.0, 7.0], ids=["answers-within-grace", "answers-after-grace"])
def test_a_peer_failure_while_this_ranks_stock_worker_still_loads_aborts_it_too(stock, sleep_s):
    """Rank 1's worker fails while rank 0's is inside a slow bucket: rank 0 owes its REQ socket an
    answer. It takes the answer (or, past ABORT_GRACE_S, relaxes the REQ state machine) and sends the
    abort anyway: no worker is left waiting, and the next update is exact."""
    version, _folder, world, front = stock
    ckpts = FreshCheckpoints(world, seed=16)
    name, want = ckpts.new("slow")
    got = world.update(name, front, timeout=60, behaviors={0: {"sleep_s": sleep_s}, 1: {"fail_bucket": 0}})
    assert all(not o.ok and o.error == "RemoteWorkerError" and "rank 1" in o.message for o in got.values()), got
    got = world.update(name, front, timeout=60)
    assert all(o.ok for o in got.values()), got
    assert front.digests(0) == front.digests(1) == want
    ckpts.drop(name)


def test_a_failing_stock_post_hook_fails_every_rank(stock):
    _version, _folder, world, front = stock
    ckpts = FreshCheckpoints(world, seed=14)
    name, _want = ckpts.new("post")
    got = world.update(name, front, timeout=30, behaviors={0: {"fail_post_hook": True}})
    failed = [o for o in got.values() if not o.ok]
    assert len(failed) == 2, got
    assert all(o.error in ("RemoteWorkerError", "UpdateTimeoutError") for o in failed), got
    assert any("rank 0" in o.message for o in failed), got
    ckpts.drop(name)


def test_a_stock_worker_that_never_connects_is_a_timeout_naming_its_device():
    with PsWorld("cpu", 1, init={"wire": "stock"}) as world:
        ckpts = FreshCheckpoints(world, seed=15)
        name, _ = ckpts.new("silent")
        got = world.update(name, None, timeout=3)
        assert_every_rank_failed(got, "UpdateTimeoutError", world.device_uuids[0], "connect")


def test_an_unknown_wire_is_a_config_error():
    with pytest.raises(RuntimeError, match="ConfigError.*wire must be one of"):
        PsWorld("cpu", 1, init={"wire": "pickle-please"})
