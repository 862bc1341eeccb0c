"""Sliced deltas end to end: real PS processes (2 ranks, gloo) and real engine-worker processes of a
2-rank tensor-parallel-like engine (``support.delta_slices_world``: each worker holds only its boxes,
fused into its live parameters, some of them strided column blocks).

A goes whole by the slice plan, then B and C (real AdamW steps) go as sliced deltas: each worker
receives only the changed elements of its own boxes, less than its sliced full update, and holds
exactly its boxes of the whole version afterwards. An apply that drops one changed element, and a
box payload corrupted in a PS rank's memory, are refused on every rank with every engine on its
base byte for byte; then the delta works. A sliced delta is built once per (version, plan) and
released with its version.
"""

import pytest

from support import delta_slices_world as dsw
from support.engine import EngineFront
from support.world import PsWorld

pytestmark = pytest.mark.timeout(600)

WORLD = 2


def _all_ok(got):
    assert all(o.ok for o in got.values()), got
    return got


def _register(world, name, version, base=None):
    extra = {} if base is None else {"base": base}
    split = dsw.per_rank(version)
    _all_ok(world.all("register", per_rank={r: (name, {"named_tensors": split[r], **extra}) for r in range(WORLD)}))
    _all_ok(world.all("gather", name))


def _update(world, front, name, delta, behaviors=None, timeout=60):
    return world.all("call", (dsw.__name__, "sliced_update", (name, front.address, timeout, dsw.plan_doc(), behaviors,
                                                               delta)), timeout=timeout + 60)


def _holds(front, version):
    return all(front.digests(i) == dsw.want(version, i) for i in range(WORLD))


@pytest.fixture
def world_and_front():
    plan = dsw.plan()
    world = PsWorld("cpu", WORLD)
    front = EngineFront("cpu", WORLD, behavior={"plan_doc": dsw.plan_doc()}, engine_cls=dsw.SlicedDeltaEngine,
                        slices=(plan.digest, [0, 1]))
    try:
        yield world, front
    finally:
        front.close()
        world.close()


def test_sliced_deltas_of_adamw_steps_leave_every_engine_rank_with_exactly_its_boxes(world_and_front):
    world, front = world_and_front
    trainer = dsw.Trainer(seed=39)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    full = _all_ok(_update(world, front, "A", False, {i: {"version": "A"} for i in range(WORLD)}))
    assert _holds(front, v["A"])
    full_bytes = full[0].value["slices"]["received_bytes"]
    assert full_bytes == [dsw.plan().rank_bytes(0), dsw.plan().rank_bytes(1)]

    prev = "A"
    for name, lr in (("B", 1e-5), ("C", 1e-4)):
        trainer.step(lr)
        v[name] = trainer.version()
        _register(world, name, v[name], base=prev)
        got = _all_ok(_update(world, front, name, True))
        assert _holds(front, v[name]), f"an engine rank differs from its boxes of {name} after the sliced delta"
        for r, o in got.items():
            fig, sl = o.value["delta"], o.value["slices"]
            assert fig["base"] == prev and fig["sliced"]["plan"] == dsw.plan().digest, fig
            assert fig["sliced"]["full_rank_bytes"] == full_bytes
            assert sl["plan"] == dsw.plan().digest
            # each engine rank received only its boxes' changes: less than its sliced full update
            assert all(0 < d < f for d, f in zip(sl["received_bytes"], full_bytes)), (name, sl, full_bytes)
        outcomes = front.worker_outcomes(front.fanouts - 1)
        for status, result in outcomes:
            assert status == "ok" and result["delta"] and result["version"] == name and result["base"] == prev, result
            assert result["scattered"] >= 6, result   # boxes of contiguous and of strided regions
            assert "gate" in result["scattered_tensors"], result   # a strided one (gu)
        assert all(front.call(i, "held")[1] == name for i in range(WORLD))
        prev = name


def test_a_dropped_element_and_a_corrupted_box_payload_are_refused_with_every_engine_on_its_base(world_and_front):
    world, front = world_and_front
    trainer = dsw.Trainer(seed=7)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    _all_ok(_update(world, front, "A", False, {i: {"version": "A"} for i in range(WORLD)}))
    for name, base in (("B", "A"), ("C", "B")):
        trainer.step(1e-4)
        v[name] = trainer.version()
        _register(world, name, v[name], base=base)
    _all_ok(_update(world, front, "B", True))
    assert _holds(front, v["B"])

    # the mutation check: each worker drops one changed element of its first box payload; the box's
    # post-apply digest fails, every rank raises, every worker undoes its writes
    drop = {i: {"env": {"CKPT_TEST_DELTA_DROP_ONE": "1"}} for i in range(WORLD)}
    got = _update(world, front, "C", True, drop)
    for r, o in got.items():
        assert not o.ok and o.error == "RemoteWorkerError" and "do not match the version's digest" in o.message, (r, o)
    assert _holds(front, v["B"]) and all(front.call(i, "held")[1] == "B" for i in range(WORLD))

    # C's sliced delta was built by that update (once per version and plan): corrupt one box payload of
    # rank 1's share in its memory; the worker refuses it by its body check, every engine stays on B
    hit = world.all("call", (dsw.__name__, "corrupt_box_payload", ("C", dsw.plan_doc(), "up")))
    assert [hit[r].value for r in range(WORLD)] == [False, True]
    got = _update(world, front, "C", True)
    for r, o in got.items():
        assert not o.ok and o.error == "RemoteWorkerError" and "body's check" in o.message, (r, o)
    assert _holds(front, v["B"]) and all(front.call(i, "held")[1] == "B" for i in range(WORLD))

    # repaired (the same XOR again): the cached sliced delta now lands
    world.all("call", (dsw.__name__, "corrupt_box_payload", ("C", dsw.plan_doc(), "up")))
    _all_ok(_update(world, front, "C", True))
    assert _holds(front, v["C"])

    # released with their versions
    listed = world.all("call", (dsw.__name__, "sliced_checkpoints", ()))
    assert sorted(listed[0].value) == sorted(f"{n}@delta[{dsw.plan().digest[:16]}]" for n in ("B", "C"))
    _all_ok(world.all("unregister", ("B", {})))
    listed = world.all("call", (dsw.__name__, "sliced_checkpoints", ()))
    assert all(o.value == [f"C@delta[{dsw.plan().digest[:16]}]"] for o in listed.values())


def test_refusals_are_agreed_before_anything_moves(world_and_front):
    """A version without a base, a rank without the plan, a skipped version and a device-resident version:
    every rank raises the same error and no engine is asked to load anything; with "fallback" the version
    goes whole by the plan."""
    world, front = world_and_front
    trainer = dsw.Trainer(seed=3)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    _all_ok(_update(world, front, "A", False, {i: {"version": "A"} for i in range(WORLD)}))
    fanouts = front.fanouts
    got = _update(world, front, "A", True)
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "not registered with a base" in o.message, (r, o)
    for name, base in (("B", "A"), ("C", "B")):
        trainer.step(1e-4)
        v[name] = trainer.version()
        _register(world, name, v[name], base=base)
    got = world.all("call", per_rank={
        0: (dsw.__name__, "sliced_update", ("B", front.address, 30, dsw.plan_doc(), None, True)),
        1: (dsw.__name__, "sliced_update", ("B", front.address, 30, None, None, True))})
    for r, o in got.items():   # rank 1 is in a whole delta's first exchange: each side sees the other's call
        assert not o.ok and o.error == "ConfigError" and "disagree" in o.message, (r, o)
    got = _update(world, front, "C", True)   # the engines hold A, C's delta applies to B
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "'B'" in o.message, (r, o)
    assert front.fanouts == fanouts and _holds(front, v["A"])
    # versions kept on the trainer's device (``on_device``; the CPU stands in for it): their boxes are cut in
    # host memory, so a sliced delta of them is refused on every rank before anything moves
    for name, base in (("dA", None), ("dB", "dA")):
        extra = {"on_device": True, **({} if base is None else {"base": base})}
        split = dsw.per_rank(v["A" if base is None else "B"])
        _all_ok(world.all("register", per_rank={r: (name, {"named_tensors": split[r], **extra}) for r in range(WORLD)}))
        _all_ok(world.all("gather", name))
    _all_ok(_update(world, front, "dA", False, {i: {"version": "dA"} for i in range(WORLD)}))   # A's bytes
    fanouts = front.fanouts
    got = _update(world, front, "dB", True)   # the engines hold its base: refused only for where it lies
    for r, o in got.items():
        assert not o.ok and o.error == "ConfigError" and "device-resident" in o.message, (r, o)
    assert front.fanouts == fanouts and _holds(front, v["A"])
    got = _all_ok(_update(world, front, "C", "fallback", {i: {"version": "C"} for i in range(WORLD)}))
    assert all("fallback" in o.value["delta"] for o in got.values()) and _holds(front, v["C"])


def test_engines_on_an_older_version_take_a_fold_cut_into_their_boxes(world_and_front):
    """Engines hold A; C's delta (base B) is folded from A on every rank (``fold_delta``): the delta's
    agreement picks the fold, which is cut into each rank's boxes like any delta; every engine rank then
    holds exactly its boxes of C, having received less than its sliced full update."""
    world, front = world_and_front
    trainer = dsw.Trainer(seed=21)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    full = _all_ok(_update(world, front, "A", False, {i: {"version": "A"} for i in range(WORLD)}))
    for name, base in (("B", "A"), ("C", "B")):
        trainer.step(1e-5)
        v[name] = trainer.version()
        _register(world, name, v[name], base=base)
    _all_ok(world.all("call", (dsw.__name__, "fold", ("C", "A"))))
    got = _all_ok(_update(world, front, "C", True))
    assert _holds(front, v["C"]) and all(front.call(i, "held")[1] == "C" for i in range(WORLD))
    for o in got.values():
        assert o.value["delta"]["base"] == "A" and o.value["delta"]["companion"].startswith("C@delta:"), o.value
        got_bytes, full_bytes = o.value["slices"]["received_bytes"], full[0].value["slices"]["received_bytes"]
        assert all(0 < g < f for g, f in zip(got_bytes, full_bytes)), (got_bytes, full_bytes)
