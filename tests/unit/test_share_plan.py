"""Every PS rank gets the same slice plan, by digest alone when it holds it already
(``ckpt_core.transfer.share_plan``): ranks as threads over an in-process all-gather."""

import json
import threading

import pytest

from ckpt_core.errors import ConfigError
from ckpt_core.planning.slices import SliceKey, plan_to_json, split_plan
from ckpt_core.transfer.share_plan import SharedPlans, share_plan

TENSORS = {"q.weight": ("F32", (8, 4), 4), "norm.weight": ("F32", (4,), 4)}


def _plan(tp=2, tag="a"):
    return split_plan(SliceKey(tag, f"tp={tp}", "test"), TENSORS, tp, {"q.weight": 0})


class World:
    """``all_gather_json`` of ``size`` thread-ranks; counts the JSON bytes each round carried."""

    def __init__(self, size):
        self.size, self.barrier, self.slots, self.rounds = size, threading.Barrier(size, timeout=10), [None] * size, []

    def coll(self, rank):
        world = self

        class Coll:
            def all_gather_json(self, obj):
                world.barrier.wait()
                world.slots[rank] = json.loads(json.dumps(obj))
                world.barrier.wait()
                got = list(world.slots)
                if rank == 0:
                    world.rounds.append(len(json.dumps(got)))
                world.barrier.wait()
                return got
        return Coll()

    def run(self, calls):
        """``calls[r](coll)`` on each rank at once; each rank's result or exception."""
        out = [None] * self.size

        def one(r):
            try:
                out[r] = calls[r](self.coll(r))
            except Exception as exc:   # noqa: BLE001 - the test looks at it
                out[r] = exc
        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        return out


def test_the_first_share_sends_the_plan_and_the_next_one_its_digest_only():
    world, plan = World(3), _plan()
    known = [SharedPlans() for _ in range(3)]
    share = lambda r, p: (lambda c: share_plan(c, r, p, src=0, error=None, known=known[r]))  # noqa: E731
    first = world.run([share(0, plan), share(1, None), share(2, None)])
    assert [p.digest for p in first] == [plan.digest] * 3 and len(world.rounds) == 3
    world.rounds.clear()
    again = world.run([share(0, plan), share(1, None), share(2, None)])
    assert [p.digest for p in again] == [plan.digest] * 3
    assert len(world.rounds) == 2 and max(world.rounds) < 200, "only digests and yes/no travelled"
    other = _plan(tag="b")   # another plan: its JSON travels again
    world.rounds.clear()
    third = world.run([share(0, other), share(1, None), share(2, None)])
    assert [p.digest for p in third] == [other.digest] * 3 and len(world.rounds) == 3


def test_src_none_takes_the_lowest_rank_that_has_one_and_an_error_fails_every_rank_naming_it():
    world, plan = World(2), _plan()
    got = world.run([lambda c: share_plan(c, 0, None, src=None, error=None, known=SharedPlans()),
                     lambda c: share_plan(c, 1, plan, src=None, error=None, known=SharedPlans())])
    assert [p.digest for p in got] == [plan.digest] * 2
    failed = world.run([lambda c: share_plan(c, 0, None, src=None, error=None, known=SharedPlans()),
                        lambda c: share_plan(c, 1, None, src=None, error="RemoteWorkerError: no loader",
                                             known=SharedPlans())])
    assert all(isinstance(e, ConfigError) and "rank 1: RemoteWorkerError: no loader" in str(e) for e in failed)
    nobody = world.run([lambda c: share_plan(c, r, None, src=None, error=None, known=SharedPlans())
                        for r in range(2)])
    assert all(isinstance(e, ConfigError) and "no rank shared a slice plan" in str(e) for e in nobody)


def test_a_rank_that_evicted_the_plan_gets_its_json_again():
    world, plan = World(2), _plan()
    known = [SharedPlans(size=1), SharedPlans(size=1)]
    world.run([lambda c: share_plan(c, 0, plan, src=0, error=None, known=known[0]),
               lambda c: share_plan(c, 1, None, src=0, error=None, known=known[1])])
    known[1].put(_plan(tag="c"))   # rank 1's cache of one now holds another plan
    world.rounds.clear()
    got = world.run([lambda c: share_plan(c, 0, plan, src=0, error=None, known=known[0]),
                     lambda c: share_plan(c, 1, None, src=0, error=None, known=known[1])])
    assert [p.digest for p in got] == [plan.digest] * 2 and len(world.rounds) == 3


@pytest.mark.parametrize("size", [1, 4])
def test_the_cache_keeps_the_last_plans_by_digest(size):
    cache = SharedPlans(size=size)
    plans = [_plan(tag=t) for t in "wxyz"]
    for p in plans:
        cache.put(p)
    assert [cache.get(p.digest) is p for p in plans] == [i >= 4 - size for i in range(4)]


@pytest.mark.parametrize("args, needle", [
    (({"plan": "json"}, {}), "must be a SlicePlan"),            # the plan's JSON on rank 0
    (({"plan": "digest"}, {}), "digest is what an engine client"),
    (({}, {"plan": "json"}), "must be a SlicePlan"),            # a non-plan on a rank that is not the source
    (({"src": 1}, {"src": 0}), "the same src"),                  # the ranks name different sources
    (({"src": 5}, {"src": 5}), "world of 2"),
    (({"src": "0"}, {"src": "0"}), "src must be None or a rank number"),
    (({"error": ValueError("no loader")}, {}), "rank 0: ValueError: no loader"),   # not a str
])
def test_what_one_rank_passes_wrong_fails_every_rank_after_one_exchange(args, needle):
    """Nothing is raised before the first exchange (a peer would wait in it): every rank raises the
    same ConfigError after it, and no second exchange starts."""
    world, plan = World(2), _plan()
    forms = {"json": plan_to_json(plan), "digest": plan.digest}

    def call(r, kw):
        kw = dict({"src": 0, "error": None}, **kw)
        mine = forms.get(kw.pop("plan", None), plan if r == 0 else None)
        return lambda c: share_plan(c, r, mine, known=SharedPlans(), **kw)
    got = world.run([call(r, args[r]) for r in range(2)])
    assert all(isinstance(e, ConfigError) and needle in str(e) for e in got), got
    assert len(world.rounds) == 1, "one exchange, then every rank stopped"


def test_a_rank_in_another_collective_fails_the_share_and_is_not_waited_for():
    """Rank 1 runs another first exchange (an update's view) while rank 0 shares a plan: rank 0 raises a
    ConfigError naming rank 1 after that one exchange, instead of waiting for a second one."""
    world, plan = World(2), _plan()
    got = world.run([lambda c: share_plan(c, 0, plan, src=0, error=None, known=SharedPlans()),
                     lambda c: c.all_gather_json({"problem": None, "name": "step-1", "wire": "native"})])
    assert isinstance(got[0], ConfigError) and "rank(s) [1] are in another collective" in str(got[0]), got[0]
    assert len(world.rounds) == 1
