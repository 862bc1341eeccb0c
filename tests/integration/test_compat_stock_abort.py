"""A failed stock-wire update ends every stock worker's call, whatever state its handshake is in.

Stock workers (the PyPI releases, unmodified, in real processes) have no timeout: a worker the PS
leaves waiting blocks its engine's ``update_weights_from_ipc`` for good (SGLang's HTTP route never
answers). Two PS ranks; rank 1 fails at one point of the handshake, and its worker is then

- not connected yet (the engine reaches it late),
- connected, still waiting for its buffer handle (rank 1 could not allocate the buffer),
- holding the mapped buffer, waiting for a bucket (rank 1 failed right after the handshake).

Every rank raises naming rank 1, both workers' calls return with an error within a generous
bound (ceiling: ``ABORT_CONNECT_S`` plus the graces, far below "forever"), nothing is committed,
and the next update is bit-exact.
"""

from __future__ import annotations

import time

import pytest

from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.stock_workers import StockSimEngine, stock_params, wire_of

SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(40_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}
WORKER_RETURN_CEILING_S = 60   # generous: the promise is "returns", not a duration
PRE_BUFFER = "assert isinstance(ipc_handle, tuple)"   # what the stock worker raises on an abort for its handle
ABORTED = "update aborted by the parameter server"     # the abort the worker raises once it holds the buffer


@pytest.fixture(params=stock_params(), scope="module")
def stock(request):
    version, folder = request.param
    world = PsWorld("cpu", 2, init={"wire": wire_of(version)}, env=SMALL_BUCKETS)
    front = EngineFront("cpu", 2, behavior={"stock_dir": folder}, engine_cls=StockSimEngine)
    try:
        yield version, world, front
    finally:
        if front._lock.locked():   # a worker still blocked in the stock loop holds the front: kill, do not wait
            for i in range(2):
                front.kill(i)
        front.close()
        world.close()


def _worker_outcomes(front: EngineFront, since: int) -> list | None:
    """Both workers' outcomes of the update after ``since``, or None if a worker's call has not returned
    within the ceiling (``front.worker_outcomes`` would wait on the lock that the blocked fan-out holds)."""
    deadline = time.monotonic() + WORKER_RETURN_CEILING_S
    while front.fanouts <= since:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return list(front.last_results)


def _replace_workers(front: EngineFront, since: int) -> None:
    """Kill the blocked workers (the fan-out then ends) and start fresh ones."""
    for i in range(2):
        front.kill(i)
    while front.fanouts <= since:
        time.sleep(0.05)
    for i in range(2):
        front.restart(i)


def _inject(world: PsWorld, fn: str, *args) -> None:
    got = world.all("call", ("support.stock_abort_cases", fn, (*args,)), ranks=[1])
    assert got[1].ok, got


CASES = {
    "not-connected-yet": ("fail_next_ipc_alloc", (False,), {1: {"connect_delay_s": 3.0}}, PRE_BUFFER),
    "connected-before-buffer": ("fail_next_ipc_alloc", (True,), None, PRE_BUFFER),
    "after-buffer": ("fail_after_buffer", None, None, ABORTED),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_failing_in_the_handshake_ends_every_stock_workers_call_and_the_next_update_is_exact(stock, case):
    version, world, front = stock
    fn, args, behaviors, worker1_raises = CASES[case]
    ckpts = FreshCheckpoints(world, seed=31)
    name, want = ckpts.new(case)
    _inject(world, fn, *(args if args is not None else (name,)))
    before = [front.digests(i) for i in range(2)]
    since = front.fanouts

    got = world.update(name, front, timeout=60, behaviors=behaviors)

    assert_every_rank_failed(got, "RemoteWorkerError", "rank 1", "injected")
    outcomes = _worker_outcomes(front, since)
    if outcomes is None:
        _replace_workers(front, since)   # so that the next case starts with a free engine
    assert outcomes is not None, (f"stock {version}, {case}: a stock worker's update_weights_from_ipc did not return "
                                  f"within {WORKER_RETURN_CEILING_S} s (its engine is wedged)")
    assert [status for status, _ in outcomes] == ["error", "error"], outcomes
    assert worker1_raises in outcomes[1][1], f"stock {version}: worker 1 ended otherwise: {outcomes[1][1][-600:]}"
    assert [front.digests(i) for i in range(2)] == before, "a failed update committed weights"

    got = world.update(name, front, timeout=60)
    assert all(o.ok for o in got.values()), got
    assert front.digests(0) == front.digests(1) == want, f"stock {version}: the next update is not exact"
    ckpts.drop(name)
