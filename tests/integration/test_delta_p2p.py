"""Delta updates on the P2P path: real PS processes reading each other's host memory over Mooncake's TCP
transport on loopback, real engine-worker processes (``delta_world.DeltaEngine``).

A small model trains with AdamW between versions. Inside one world and from a joining world, each
P2P delta leaves every target engine bit-exact with the full version while the readers fetch only
the delta's payloads. A skipped version, a restarted engine, a corrupted payload, an apply that
drops an element, a rank without the delta and ranks disagreeing on the base are each refused on
every rank with the engines unchanged (byte for byte), and the next delta works; ``"fallback"``
turns a refusal into a full P2P update.
"""

from __future__ import annotations

import pytest

from support.asserts import assert_every_rank_failed
from support.delta_world import DERIVED, DeltaEngine, Trainer
from support.data import want_digests
from support.engine import EngineFront
from support.world import PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                    "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")
pytestmark = pytest.mark.timeout(900)

WORLD = 2




def _register(world, name, tensors, base=None, ranks=None):
    extra = {} if base is None else {"base": base}
    ranks = list(range(world.size)) if ranks is None else ranks
    all_ok(world.all("register", per_rank={r: (name, {"named_tensors": tensors[r], **extra}) for r in ranks},
                  ranks=ranks))
    if len(ranks) == world.size:
        all_ok(world.all("gather", name))


def _p2p(world, front, name, targets, mode=True, versions=None, behaviors=None, timeout=60):
    """update(name, ..., ranks=targets, delta=mode) on every rank of ``world``; the engines of ``front``
    are told the version (``versions``: per worker, default ``name``)."""
    per = {i: {"version": name} for i in range(len(targets))}
    for i, extra in (behaviors or {}).items():
        per[i] = dict(per[i], **extra)
    return world.all("call", ("support.delta_world", "p2p_delta_update", (name, front.address, timeout, targets, per, mode)),
                     timeout=timeout + 90)


def _engines(front, n):
    return [front.digests(i) for i in range(n)]


def _want(tensors):
    return want_digests(*tensors.values())


def _check_delta(got, targets, name, base):
    """Each target read exactly the delta's payloads over the network, less than the version weighs."""
    for r, o in got.items():
        fig = o.value["delta"]
        assert fig["base"] == base, (name, r, fig)
        if r in targets:
            assert o.value["target"] and o.value["read_bytes"] > 0, (name, r, o.value)
    read = sum(got[r].value["read_bytes"] for r in targets)   # runs read whole: alignment gaps included
    fig = got[targets[0]].value["delta"]
    assert fig["delta_bytes"] <= read < fig["version_bytes"], (name, read, fig)
    return read / fig["version_bytes"]


def test_p2p_deltas_inside_one_world_are_bit_exact_and_read_only_the_payloads():
    """Owners 0 and 1 hold A..D; the engine beside rank 1 (a restarted instance) joins with A whole over
    P2P, then takes B, C, D as P2P deltas. Rank 0's engine is not touched."""
    trainer = Trainer(seed=39)
    versions = {"A": trainer.version()}
    with PsWorld("cpu", WORLD, init=SMALL, env=OWNERS) as world:
        front = EngineFront("cpu", 1, devices=[1], behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
        try:
            _register(world, "A", versions["A"])
            got = all_ok(_p2p(world, front, "A", [1], mode=False))
            assert got[1].value["read_bytes"] >= got[1].value["bytes"]
            assert _engines(front, 1) == [_want(versions["A"])]
            prev = "A"
            for name, lr in (("B", 1e-5), ("C", 1e-4), ("D", 1e-6)):   # real optimizer steps between versions
                trainer.step(lr)
                versions[name] = trainer.version()
                _register(world, name, versions[name], base=prev)
                got = all_ok(_p2p(world, front, name, [1]))
                _check_delta(got, [1], name, prev)
                assert not got[0].value["target"]
                assert _engines(front, 1) == [_want(versions[name])], f"the engine differs from {name} after its delta"
                [(status, result)] = front.worker_outcomes(front.fanouts - 1)
                assert status == "ok" and result["delta"] and result["version"] == name and result["base"] == prev
                assert result["reloaded"] >= 1 and result["scattered"] >= 1, result   # both apply paths ran
                held = all_ok(world.all("call", ("support.delta_world", "engines_hold", ())))
                assert held[1].value == name and held[0].value is None, held   # rank 0's engine was not updated
                prev = name
            # a full P2P update refused in the handshake (the worker's plan check) sent nothing: every rank
            # says so, rank 1 still records D as its engine's, and the delta of D then applies
            trainer.step(1e-5)
            versions["E"] = trainer.version()
            _register(world, "E", versions["E"], base="D")
            got = _p2p(world, front, "E", [1], mode=False, behaviors={0: {"require": ["lm_head.absent"]}})
            for r, o in got.items():
                assert not o.ok and "nothing was sent to any engine worker" in o.message, (r, o.message)
            assert "the engines still hold version 'D', and a delta of it can follow" in got[1].message
            assert _engines(front, 1) == [_want(versions["D"])]
            held = all_ok(world.all("call", ("support.delta_world", "engines_hold", ())))
            assert held[1].value == "D" and held[0].value is None, held
            got = all_ok(_p2p(world, front, "E", [1]))
            _check_delta(got, [1], "E", "D")
            assert _engines(front, 1) == [_want(versions["E"])]
        finally:
            front.close()


def test_a_rank_without_the_delta_or_ranks_disagreeing_on_its_base_refuse_it_on_every_rank():
    trainer = Trainer(seed=5)
    v = {"A": trainer.version()}
    with PsWorld("cpu", WORLD, init=SMALL, env=OWNERS) as world:
        front = EngineFront("cpu", 1, devices=[1], behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
        try:
            _register(world, "A", v["A"])
            all_ok(_p2p(world, front, "A", [1], mode=False))
            trainer.step(1e-4)
            v["B"] = trainer.version()
            _register(world, "B", v["B"], base="A")
            fanouts, before = front.fanouts, _engines(front, 1)
            # rank 1 registers X without a base: it has no delta of X
            trainer.step(1e-4)
            v["X"] = trainer.version()
            _register(world, "X", v["X"], base="B", ranks=[0])
            _register(world, "X", v["X"], ranks=[1])
            assert_every_rank_failed(_p2p(world, front, "X", [1]), "DeltaBaseError", "rank(s) [1] cannot serve or read the delta")
            # Y's delta applies to A on rank 0 and to B on rank 1
            _register(world, "Y", v["X"], base="A", ranks=[0])
            _register(world, "Y", v["X"], base="B", ranks=[1])
            assert_every_rank_failed(_p2p(world, front, "Y", [1]), "DeltaBaseError", "ranks disagree on the base", "rank 0 'A'")
            # one rank passes a bad mode: ConfigError on every rank, in the agreement (nobody waits for it)
            bad = {r: ("support.delta_world", "p2p_delta_update", ("B", front.address, 30, [1], {0: {"version": "B"}},
                                                           True if r == 0 else "bogus")) for r in range(WORLD)}
            assert_every_rank_failed(world.all("call", per_rank=bad, timeout=120), "ConfigError", "delta must be False, True or")
            assert front.fanouts == fanouts and _engines(front, 1) == before, "an engine was asked or changed"
            # the world is intact: B's delta works, and X with "fallback" goes whole
            all_ok(world.all("gather", "X"))
            _check_delta(all_ok(_p2p(world, front, "B", [1])), [1], "B", "A")
            assert _engines(front, 1) == [_want(v["B"])]
            got = all_ok(_p2p(world, front, "X", [1], mode="fallback"))
            assert "cannot serve or read the delta" in got[1].value["delta"]["fallback"]
            assert got[1].value["read_bytes"] >= got[1].value["bytes"]   # the whole version
            assert _engines(front, 1) == [_want(v["X"])]
        finally:
            front.close()


def _joiners_load(owners, joiners, path):
    names = all_ok(owners.all("call", ("support.delta_world", "save_metas", (path,))))[0].value
    all_ok(joiners.all("load_metas", path))
    return names


def test_a_joining_world_takes_p2p_deltas_and_refusals_leave_its_engines_on_their_base(tmp_path):
    trainer = Trainer(seed=7)
    v = {"A": trainer.version()}
    path = str(tmp_path / "metas.json")
    with PsWorld("cpu", WORLD, init=SMALL, env=OWNERS) as owners, \
            PsWorld("cpu", WORLD, init=SMALL, env=JOINERS) as joiners:
        front = EngineFront("cpu", WORLD, behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
        targets = list(range(WORLD))
        try:
            _register(owners, "A", v["A"])
            for name, base in (("B", "A"), ("C", "B"), ("D", "C")):
                trainer.step(1e-4)
                v[name] = trainer.version()
                _register(owners, name, v[name], base=base)
            names = _joiners_load(owners, joiners, path)
            assert {"B@delta", "C@delta", "D@delta"} <= set(names), names   # gather_metas carried each delta
            all_ok(_p2p(joiners, front, "A", targets, mode=False))
            assert _engines(front, WORLD) == [_want(v["A"])] * WORLD
            _check_delta(all_ok(_p2p(joiners, front, "B", targets)), targets, "B", "A")
            assert _engines(front, WORLD) == [_want(v["B"])] * WORLD

            # a skipped version: the engines hold B, D's delta applies to C. Refused by the first exchange,
            # naming what the engines hold and what would work; no engine is asked
            fanouts, before = front.fanouts, _engines(front, WORLD)
            assert_every_rank_failed(_p2p(joiners, front, "D", targets), "DeltaBaseError", "applies to 'C'", "last made 'B' live",
                     "'C', then 'D'")
            assert front.fanouts == fanouts and _engines(front, WORLD) == before

            # a restarted engine holds nothing: it refuses C's delta in its handshake, before a byte is read;
            # every rank raises DeltaBaseError naming what it holds; the other engine keeps B byte for byte
            front.kill(1)
            front.restart(1)
            assert_every_rank_failed(_p2p(joiners, front, "C", targets), "DeltaBaseError", "does not hold its base 'B'",
                     "this worker holds None", "update 'C' whole")
            assert front.digests(0) == before[0] and front.digests(1) == {}
            got = all_ok(_p2p(joiners, front, "C", targets, mode="fallback"))
            assert all("fallback" in o.value["delta"] for o in got.values())
            assert sum(got[r].value["read_bytes"] for r in targets) >= got[0].value["bytes"]   # the whole version
            assert _engines(front, WORLD) == [_want(v["C"])] * WORLD

            # an apply that drops one changed element fails the post-apply digest check: undone everywhere
            drop = {i: {"env": {"CKPT_TEST_DELTA_DROP_ONE": "1"}} for i in targets}
            assert_every_rank_failed(_p2p(joiners, front, "D", targets, behaviors=drop), "RemoteWorkerError",
                     "do not match the version's digest")
            assert _engines(front, WORLD) == [_want(v["C"])] * WORLD

            # a corrupted payload in an owner's host memory: the reader's digest check refuses the bucket before
            # any engine loads it; the engines keep C byte for byte
            hit = all_ok(owners.all("call", ("support.delta_world", "corrupt_payload", ("D", "r1.down.weight"))))
            assert [hit[r].value for r in range(WORLD)] == [False, True]
            assert_every_rank_failed(_p2p(joiners, front, "D", targets), "TransportError", "does not match the digest")
            assert _engines(front, WORLD) == [_want(v["C"])] * WORLD
            assert all(front.call(i, "held")[1] == "C" for i in targets)

            # the owners register D again; the joiners load the new metas; the next delta works
            all_ok(owners.all("unregister", ("D", {})))
            _register(owners, "D", v["D"], base="C")
            _joiners_load(owners, joiners, path)
            _check_delta(all_ok(_p2p(joiners, front, "D", targets)), targets, "D", "C")
            assert _engines(front, WORLD) == [_want(v["D"])] * WORLD
        finally:
            front.close()
