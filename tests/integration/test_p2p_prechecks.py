"""P2P updates agree on every rank's pre-checks in their first exchange (issue 14 defect 2's sibling).

A local problem on one rank (an owner that no longer holds the checkpoint, a bad timeout or
req_func, ranks out of range or not the same list everywhere, a broadcast call among P2P calls)
used to make that rank raise alone while its peers entered the update's collectives and waited
for it until PS_COLLECTIVE_TIMEOUT_S. Now every rank raises the same typed error at once and
the next P2P update delivers. Real PS processes, Mooncake's TCP transport on loopback.
"""

from __future__ import annotations

import pytest

from support.asserts import assert_every_rank_failed
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.p2p_cases import OWNERS, SMALL, all_ok, call

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                    "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")

COLLECTIVE_TIMEOUT_S = 20.0    # a refusal must come well before any collective would time out
TARGET = [1]                   # rank 0 owns its share and serves it; rank 1's engine is updated


@pytest.fixture(scope="module")
def world():
    w = PsWorld("cpu", 2, init=SMALL, env={**OWNERS, "PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)})
    front = EngineFront("cpu", 1, devices=TARGET)
    try:
        yield w, front, FreshCheckpoints(w, seed=1717)
    finally:
        w.close()
        front.close()


def p2p_each(w, per_rank: dict) -> dict:
    """Every rank calls update(..., ranks=...) with its own arguments (name, address, timeout, ranks[, req])."""
    calls = {r: ("support.p2p_cases", "p2p_update_as", a) for r, a in per_rank.items()}
    return w.collect(w.send("call", per_rank=calls), timeout=120)


def assert_refused_at_once(got: dict, error: str, *needles: str) -> None:
    assert_every_rank_failed(got, error, *needles)
    slowest = max(o.seconds for o in got.values())
    # Before: the rank with the problem raised alone, the other waited for PS_COLLECTIVE_TIMEOUT_S.
    assert slowest < COLLECTIVE_TIMEOUT_S, f"a refusal must not wait for the collective timeout ({slowest:.1f} s)"


def assert_p2p_still_delivers(w, front, ckpts) -> None:
    name, want = ckpts.new("genuine")
    all_ok(call(w, "p2p_update", name, front.address, 60, TARGET))
    assert front.digests(0) == want, "the target's engine does not hold the next checkpoint"
    ckpts.drop(name)


def test_a_checkpoint_unregistered_on_an_owner_refuses_the_p2p_update_on_every_rank(world):
    w, front, ckpts = world
    name, _ = ckpts.new("owner-gone")
    assert w.all("unregister", (name, {}), ranks=[0])[0].ok          # the owner outside the targets
    posted = len(front.requests)
    got = p2p_each(w, {r: (name, front.address, 30, TARGET) for r in range(2)})
    assert_refused_at_once(got, "CheckpointNotFoundError", repr(name), "owner rank(s) [0]")
    assert len(front.requests) == posted, "refused before anything moved: the target's engine was not asked"
    assert w.all("unregister", (name, {}), ranks=[1])[1].ok
    assert_p2p_still_delivers(w, front, ckpts)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, 0, "soon"], ids=["nan", "negative", "zero", "str"])
@pytest.mark.parametrize("on", [0, 1], ids=["on-a-non-target", "on-the-target"])
def test_a_bad_timeout_on_one_rank_is_a_config_error_on_every_rank(world, bad, on):
    w, front, ckpts = world
    name, _ = ckpts.new("bad-timeout")
    got = p2p_each(w, {r: (name, front.address, bad if r == on else 30, TARGET) for r in range(2)})
    assert_refused_at_once(got, "ConfigError", "update timeout", f"rank(s) [{on}]")
    ckpts.drop(name)
    assert_p2p_still_delivers(w, front, ckpts)


@pytest.mark.parametrize("case", ["out-of-range", "not-integers", "different-lists", "broadcast-among-p2p",
                                  "req-func-not-callable"])
def test_a_local_mistake_in_the_arguments_of_one_rank_is_one_config_error_on_every_rank(world, case):
    w, front, ckpts = world
    name, _ = ckpts.new(case)
    good = (name, front.address, 30, TARGET)
    bad, needles = {
        "out-of-range": ((name, None, 30, [1, 5]), ["not all in [0, 2)", "rank(s) [0]"]),
        "not-integers": ((name, None, 30, ["one"]), ["list of integers", "rank(s) [0]"]),
        "different-lists": ((name, None, 30, [0, 1]), ["disagree on the targets"]),
        "broadcast-among-p2p": ((name, None, 30, None), ["rank(s) [1] called a P2P update", "rank(s) [0] a broadcast"]),
        "req-func-not-callable": ((name, None, 30, TARGET, "none"), ["req_func must be callable", "rank(s) [0]"]),
    }[case]
    got = p2p_each(w, {0: bad, 1: good})
    assert_refused_at_once(got, "ConfigError", *needles)
    ckpts.drop(name)
    assert_p2p_still_delivers(w, front, ckpts)
