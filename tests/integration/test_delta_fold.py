"""Folded deltas end to end (``fold_delta``, docs/deltas.md): engines that hold an older version A take
version D in one delta update, its chain A -> B -> C -> D folded into one on the PS ranks.

Real PS processes (2 ranks, gloo; and, for joining worlds, Mooncake TCP on loopback between two worlds)
and real engine-worker processes (``delta_world.DeltaEngine``: tensors scattered in place and tensors the
engine derives, rebuilt and reloaded). A small model trains with AdamW between versions. The fold leaves
every engine bit-exact with D, whether it was encoded against A (still registered) or built from the
chain's payloads (A unregistered), and a joining world reads only the fold's payloads: fewer bytes than
the three deltas together, and fewer than D whole. A fold missing on a rank, a fold of a base the engine
does not hold and a corrupted fold payload are each refused on every rank with the engines unchanged
byte for byte; ``"fallback"`` turns a refusal into a full update; unregistering D removes its folds.
"""

from __future__ import annotations

import pytest
from support.p2p_cases import all_ok
from support.asserts import assert_every_rank_failed
from support.data import want_digests
from support.delta_world import DERIVED, DeltaEngine, Trainer
from support.engine import EngineFront
from support.world import PsWorld

pytestmark = pytest.mark.timeout(900)

WORLD = 2
CHAIN = (("B", "A"), ("C", "B"), ("D", "C"))




def _register(world, name, tensors, base=None):
    extra = {} if base is None else {"base": base}
    all_ok(world.all("register", per_rank={r: (name, {"named_tensors": tensors[r], **extra}) for r in range(WORLD)}))
    all_ok(world.all("gather", name))


def _call(world, fn, *args, ranks=None, timeout=120):
    return world.all("call", ("support.delta_world", fn, args), ranks=ranks, timeout=timeout)


def _delta(world, front, name, mode=True, behaviors=None, timeout=60):
    behaviors = behaviors or {i: {"version": name} for i in range(WORLD)}
    return _call(world, "delta_update", name, front.address, timeout, behaviors, mode, timeout=timeout + 60)


def _engines(front, n=WORLD):
    return [front.digests(i) for i in range(n)]


def _want(tensors):
    return want_digests(*tensors.values())


def _versions(seed, lrs=(1e-5, 1e-5, 1e-5)):
    """A, then B, C, D: AdamW steps at ``lrs``; the same elements tend to change at each step (overlap)."""
    trainer = Trainer(seed=seed)
    v = {"A": trainer.version()}
    for (name, _), lr in zip(CHAIN, lrs):
        trainer.step(lr)
        v[name] = trainer.version()
    return v



@pytest.mark.parametrize("how", ["chain", "direct"])
def test_engines_that_hold_a_take_d_folded_from_a_in_one_update(world_and_front, how):
    """``chain``: A is unregistered before the fold (RL loops drop old versions): the fold is the union of
    the chain's payloads; ``direct``: A is still registered: D encoded against it."""
    world, front = world_and_front
    v = _versions(39)
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    for name, base in CHAIN:
        _register(world, name, v[name], base=base)
    step_bytes = sum(all_ok(_call(world, "delta_figures", name))[0].value["payload_bytes"] for name, _ in CHAIN)

    # without a fold the engines (on A) are refused D's delta (its base is C), told what would work
    before, fanouts = _engines(front), front.fanouts
    assert_every_rank_failed(_delta(world, front, "D"), "DeltaBaseError", "applies to 'C'", "last made 'A' live",
             "'B', then 'C', then 'D'", "fold_delta('D', base='A')")
    assert front.fanouts == fanouts and _engines(front) == before

    if how == "chain":
        all_ok(world.all("unregister", ("A", {})))
    figs = all_ok(_call(world, "fold_delta", "D", "A"))
    fold = figs[0].value
    assert fold["fold"] == ("A -> B -> C -> D" if how == "chain" else "encoded against the registered base"), fold
    assert 0 < fold["payload_bytes"] < step_bytes and fold["payload_bytes"] < fold["full_bytes"], (fold, step_bytes)
    assert all("D@delta:A" in o.value for o in all_ok(world.all("checkpoints")).values())
    if how == "direct":   # the fold outlives its base: dropping A leaves it registered
        all_ok(world.all("unregister", ("A", {})))
        assert all("D@delta:A" in o.value for o in all_ok(world.all("checkpoints")).values())

    got = all_ok(_delta(world, front, "D"))
    for r, o in got.items():
        fig = o.value["delta"]
        assert fig["base"] == "A" and fig["companion"] == "D@delta:A" and fig["payload_bytes"] > 0, (r, fig)
    assert _engines(front) == [_want(v["D"])] * WORLD, "an engine differs from D after the folded delta"
    for status, result in front.worker_outcomes(front.fanouts - 1):
        assert status == "ok" and result["base"] == "A" and result["version"] == "D", result
        assert result["reloaded"] >= 1 and result["scattered"] >= 1, result   # both apply paths ran
    assert all(front.call(i, "held")[1] == "D" for i in range(WORLD))

    # unregistering D removes its delta and its fold; registered again, D's own delta from C is there again
    all_ok(world.all("unregister", ("D", {})))
    assert not any(c.startswith("D") for o in all_ok(world.all("checkpoints")).values() for c in o.value)


def test_a_fold_refused_or_corrupted_leaves_the_engines_on_their_base(world_and_front):
    world, front = world_and_front
    v = _versions(7, lrs=(1e-4, 1e-4, 1e-4))
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    for name, base in CHAIN:
        _register(world, name, v[name], base=base)
    all_ok(world.all("unregister", ("A", {})))

    # a base no registered version or chain leads from: refused by the fold, nothing kept
    assert_every_rank_failed(_call(world, "fold_delta", "D", "Z"), "DeltaBaseError", "cannot fold the deltas of 'D' from 'Z'",
             "A -> B -> C -> D")
    # folded on rank 0 only: the update is refused on every rank before anything moves
    all_ok(_call(world, "fold_delta", "D", "A", ranks=[0]))
    before, fanouts = _engines(front), front.fanouts
    assert_every_rank_failed(_delta(world, front, "D"), "DeltaBaseError", "rank(s) [1] have no delta of 'D' from 'A'",
             "fold_delta('D', base='A')")
    assert front.fanouts == fanouts and _engines(front) == before

    # a corrupted fold payload (rank 1's): refused when its bucket is decoded, undone on every worker
    all_ok(_call(world, "fold_delta", "D", "A", ranks=[1]))
    hit = all_ok(_call(world, "corrupt_payload", "D", "r1.down.weight", "D@delta:A"))
    assert [hit[r].value for r in range(WORLD)] == [False, True]
    assert_every_rank_failed(_delta(world, front, "D"), "RemoteWorkerError", "body's check")
    assert _engines(front) == before and all(front.call(i, "held")[1] == "A" for i in range(WORLD))

    # an engine that does not hold the fold's base (restarted: it holds nothing) refuses it in its handshake;
    # every rank raises DeltaBaseError, the other engine keeps A byte for byte
    all_ok(world.all("unregister", ("D@delta:A", {})))
    all_ok(_call(world, "fold_delta", "D", "A"))
    front.kill(1)
    front.restart(1)
    assert_every_rank_failed(_delta(world, front, "D"), "DeltaBaseError", "does not hold its base 'A'", "this worker holds None")
    assert front.digests(0) == before[0] and front.digests(1) == {}
    # "fallback" turns the refusal into a full update of D
    got = all_ok(_delta(world, front, "D", mode="fallback"))
    assert all("fallback" in o.value["delta"] for o in got.values())
    assert _engines(front) == [_want(v["D"])] * WORLD


def test_a_joining_world_that_holds_a_reads_only_the_folds_payloads(tmp_path):
    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed")
    from support.p2p_cases import JOINERS, OWNERS, SMALL
    v = _versions(11)
    path = str(tmp_path / "metas.json")
    targets = list(range(WORLD))

    def p2p(name, mode=True, behaviors=None):
        per = {i: {"version": name, **(behaviors or {}).get(i, {})} for i in targets}
        return _call(joiners, "p2p_delta_update", name, front.address, 60, targets, per, mode, timeout=150)

    with PsWorld("cpu", WORLD, init=SMALL, env=OWNERS) as owners, \
            PsWorld("cpu", WORLD, init=SMALL, env=JOINERS) as joiners:
        front = EngineFront("cpu", WORLD, behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
        try:
            _register(owners, "A", v["A"])
            for name, base in CHAIN:
                _register(owners, name, v[name], base=base)
            all_ok(owners.all("unregister", ("A", {})))   # the owners moved on; the fold comes from the chain
            all_ok(_call(owners, "fold_delta", "D", "A"))
            all_ok(owners.all("gather", "D"))   # carries D@delta and D@delta:A
            names = all_ok(_call(owners, "save_metas", path))[0].value
            assert {"D@delta", "D@delta:A", "C@delta"} <= set(names), names
            all_ok(joiners.all("load_metas", path))

            # the joining engines take A whole: A's own metas, saved before the owners dropped it
            _register(owners, "A", v["A"])
            all_ok(_call(owners, "save_metas", path))
            all_ok(joiners.all("load_metas", path))
            all_ok(p2p("A", mode=False))
            assert _engines(front) == [_want(v["A"])] * WORLD

            got = all_ok(p2p("D"))
            read = sum(got[r].value["read_bytes"] for r in targets)
            fig = got[0].value["delta"]
            assert fig["base"] == "A" and fig["companion"] == "D@delta:A", fig
            chain = sum(all_ok(_call(joiners, "companion_bytes", f"{n}@delta"))[0].value for n, _ in CHAIN)
            assert fig["delta_bytes"] <= read < chain and read < fig["version_bytes"], (read, chain, fig)
            assert _engines(front) == [_want(v["D"])] * WORLD, "a joining engine differs from D after the fold"
            for status, result in front.worker_outcomes(front.fanouts - 1):
                assert status == "ok" and result["base"] == "A" and result["version"] == "D", result

            # back to A (whole), then: a corrupted fold payload in an owner's memory is refused by the reader's
            # digest check before any engine loads it; the engines keep A byte for byte
            all_ok(p2p("A", mode=False))
            hit = all_ok(_call(owners, "corrupt_payload", "D", "r1.down.weight", "D@delta:A"))
            assert [hit[r].value for r in range(WORLD)] == [False, True]
            assert_every_rank_failed(p2p("D"), "TransportError", "does not match the digest")
            assert _engines(front) == [_want(v["A"])] * WORLD

            # a restarted engine holds nothing: it refuses the fold's base in its handshake; "fallback" reads D whole
            front.kill(1)
            front.restart(1)
            assert_every_rank_failed(p2p("D"), "DeltaBaseError", "does not hold its base 'A'")
            assert front.digests(0) == _want(v["A"]) and front.digests(1) == {}
            got = all_ok(p2p("D", mode="fallback"))
            assert sum(got[r].value["read_bytes"] for r in targets) >= got[0].value["bytes"]
            assert _engines(front) == [_want(v["D"])] * WORLD
        finally:
            front.close()
