"""Something that is not a slice plan, passed on one rank only (the plan's digest, which an engine
client's ``update(slices=)`` takes, or the plan's JSON), to ``update(slices=)`` or to
``share_slice_plan``: every rank refuses it with a ConfigError at once (none waits for the rank that
refused, nothing reaches an engine), the world stays usable and the next sliced update is bit-exact.
Real PS processes (gloo) and engine-worker processes (tests/support/), the slices of
tests/support/slices_world.py."""

import itertools

import pytest

from support import slices_world as sw
from support.data import digest
from support.engine import EngineFront
from support.world import PsWorld

COLLECTIVE_S = 15   # PS_COLLECTIVE_TIMEOUT_S here: a rank left waiting in an exchange shows within it
UPDATE_S = 10       # the updates' timeout: every rank must have answered well within it
CASES = "support.plan_refusal_cases"


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2, slices=(sw.plan().digest, [0, 1]))   # the workers know their slices
    w = PsWorld("cpu", 2, env={"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_S)})
    w.front, w.seeds = front, itertools.count(61)
    yield w
    w.close()
    front.close()


def _fresh(world) -> tuple[str, int]:
    """A checkpoint of the slices' layout with fresh data, registered (rank 0: rows and norm, rank 1:
    cols and emb) and gathered."""
    seed = next(world.seeds)
    name, t = f"c{seed}", sw.tensors(seed)
    got = world.all("register", per_rank={0: (name, {"named_tensors": {"rows": t["rows"], "norm": t["norm"]}}),
                                          1: (name, {"named_tensors": {"cols": t["cols"], "emb": t["emb"]}})})
    assert all(o.ok for o in got.values()), got
    assert all(o.ok for o in world.all("gather", name).values())
    return name, seed


def _every_rank_refused_at_once(world, got: dict, before: list, fanouts: int) -> None:
    for r, o in got.items():
        assert not o.ok and o.error == "ConfigError", f"rank {r}: {o}"
        assert "must be a SlicePlan" in o.message, f"rank {r}: {o.message}"
        assert o.seconds < UPDATE_S, f"rank {r} answered after {o.seconds:.1f} s, past the update's timeout"
    assert world.front.fanouts == fanouts, "no engine was asked to load anything"
    assert [world.front.digests(r) for r in range(2)] == before, "an engine worker's weights changed"


def _next_sliced_update_is_exact(world, name: str, seed: int) -> None:
    got = world.all("call", (CASES, "share_then_update", (name, world.front.address, UPDATE_S)))
    assert all(o.ok for o in got.values()), got
    for r in range(2):
        assert world.front.digests(r) == {n: digest(x) for n, x in sw.want(seed, r).items()}, f"worker {r}"


@pytest.mark.parametrize("bad_rank, what", [(0, "digest"), (1, "digest"), (0, "json"), (1, "json")])
def test_update_with_a_digest_or_json_on_one_rank_is_a_config_error_on_every_rank(world, bad_rank, what):
    name, seed = _fresh(world)
    before, fanouts = [world.front.digests(r) for r in range(2)], world.front.fanouts
    args = {r: (CASES, "update_with", (name, world.front.address, UPDATE_S, what if r == bad_rank else "plan"))
            for r in range(2)}
    got = world.all("call", per_rank=args, timeout=COLLECTIVE_S + 60)
    _every_rank_refused_at_once(world, got, before, fanouts)
    _next_sliced_update_is_exact(world, name, seed)


@pytest.mark.parametrize("per_rank, src", [(("json", "none"), 0), (("plan", "json"), 0),
                                           (("digest", "none"), None)])
def test_share_slice_plan_of_a_non_plan_is_a_config_error_on_every_rank(world, per_rank, src):
    name, seed = _fresh(world)
    before, fanouts = [world.front.digests(r) for r in range(2)], world.front.fanouts
    got = world.all("call", per_rank={r: (CASES, "share_with", (per_rank[r], src)) for r in range(2)},
                    timeout=COLLECTIVE_S + 60)
    _every_rank_refused_at_once(world, got, before, fanouts)
    _next_sliced_update_is_exact(world, name, seed)
