"""Delta updates end to end: real PS processes (2 ranks, gloo) and real engine-worker processes.

A small model trains with AdamW between versions; A goes whole, then B, C, D go as deltas of their
predecessor, each leaving every engine worker bit-exact with the full version (digests of every
tensor, scattered in place or rebuilt and reloaded where the engine derives its weights). A delta
of a base the engines do not hold, a corrupted payload, and an apply that drops one changed element
are each refused on every rank with the engines left on their base byte for byte, and the next
update works.
"""

import pytest

from support.p2p_cases import all_ok
from support.data import want_digests
from support.delta_world import Trainer

pytestmark = pytest.mark.timeout(600)

WORLD = 2



def _register(world, name, tensors, base=None):
    extra = {} if base is None else {"base": base}
    all_ok(world.all("register", per_rank={r: (name, {"named_tensors": tensors[r], **extra}) for r in range(WORLD)}))
    all_ok(world.all("gather", name))


def _delta(world, front, name, mode=True, behaviors=None, timeout=60):
    return world.all("call", ("support.delta_world", "delta_update", (name, front.address, timeout, behaviors, mode)),
                     timeout=timeout + 60)


def _engines(front):
    return [front.digests(i) for i in range(WORLD)]


def _want(tensors):
    return want_digests(*tensors.values())


def _changed_fraction(a, b) -> float:
    from ckpt_core.delta.encode import changed_mask
    n = sum(int(changed_mask(b[r][k], a[r][k]).sum()) for r in a for k in a[r])
    return n / sum(t.numel() for r in a for t in a[r].values())



def test_a_chain_of_deltas_leaves_every_engine_equal_to_the_full_version(world_and_front):
    world, front = world_and_front
    trainer = Trainer(seed=39)
    versions = {"A": trainer.version()}
    _register(world, "A", versions["A"])
    got = all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    assert all(d == _want(versions["A"]) for d in _engines(front))

    prev = "A"
    for name, lr in (("B", 1e-5), ("C", 1e-4), ("D", 1e-6)):   # real optimizer steps between versions
        trainer.step(lr)
        versions[name] = trainer.version()
        density = _changed_fraction(versions[prev], versions[name])
        assert 0 < density < 1, (name, density)
        _register(world, name, versions[name], base=prev)
        got = all_ok(_delta(world, front, name))
        for r, o in got.items():
            fig = o.value["delta"]
            assert fig["base"] == prev and fig["payload_bytes"] < fig["full_bytes"], (name, r, fig)
        # every engine holds exactly the full version: scattered tensors and rebuilt-and-reloaded ones
        engines = _engines(front)
        for i in range(WORLD):
            assert engines[i] == _want(versions[name]), f"worker {i} differs from {name} after its delta"
        outcomes = front.worker_outcomes(front.fanouts - 1)
        for status, result in outcomes:
            assert status == "ok" and result["delta"] and result["version"] == name and result["base"] == prev, result
            assert result["reloaded"] >= 1 and result["scattered"] >= 1, result   # both paths ran
        assert all(front.call(i, "held")[1] == name for i in range(WORLD))
        prev = name


def test_a_chain_in_the_shared_pool_alternates_two_regions_and_each_delta_is_exact(world_and_front):
    """use_shared_memory_pool along a chain: B (base A, which holds the pool's region) takes a second
    region; once A is unregistered C takes A's, D then B's: the pool stays at two regions, and every
    delta leaves the engines equal to its full version (a recycled region holds its new version's bytes
    and digests, not its previous holder's)."""
    world, front = world_and_front
    trainer = Trainer(seed=41)
    versions = {"A": trainer.version()}

    def register(name, base=None):
        opts = {"use_shared_memory_pool": True, **({} if base is None else {"base": base})}
        all_ok(world.all("register", per_rank={r: (name, {"named_tensors": versions[name][r], **opts})
                                               for r in range(WORLD)}))
        all_ok(world.all("gather", name))

    register("A")
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    one = all_ok(world.all("pool_bytes"))[0].value
    prev = "A"
    for name, lr in (("B", 1e-5), ("C", 1e-4), ("D", 1e-5)):
        trainer.step(lr)
        versions[name] = trainer.version()
        register(name, base=prev)
        assert all_ok(world.all("pool_bytes"))[0].value == 2 * one, name   # two regions, never a third
        all_ok(_delta(world, front, name))
        assert all(d == _want(versions[name]) for d in _engines(front)), f"engines differ from {name}"
        # both regions held (prev and name): another registration into the pool is refused, nothing kept
        refused = world.all("register", ("X", {"named_tensors": versions["A"][0], "use_shared_memory_pool": True}))
        assert all(not o.ok and o.error == "ConfigError" and "held by checkpoints" in o.message
                   for o in refused.values()), refused
        all_ok(world.all("unregister", (prev, {})))   # the engines left it: its region is free for the next
        prev = name
    assert all_ok(world.all("pool_bytes"))[0].value == 2 * one


def test_refusals_leave_the_engines_on_their_base(world_and_front):
    world, front = world_and_front
    trainer = Trainer(seed=7)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    for name, base in (("B", "A"), ("C", "B"), ("D", "C")):
        trainer.step(1e-4)
        v[name] = trainer.version()
        _register(world, name, v[name], base=base)

    # a skipped version: the engines hold A, C's delta applies to B. Refused on every rank by the PS's
    # first exchange, before anything moves.
    before = _engines(front)
    fanouts = front.fanouts
    got = _delta(world, front, "C")
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "'B'" in o.message, (r, o)
    assert front.fanouts == fanouts and _engines(front) == before   # no engine was even asked

    # a restarted engine worker holds nothing: B's delta is refused by that worker in its handshake,
    # raised as DeltaBaseError on every PS rank; the other worker, which held A, keeps A byte for byte
    front.kill(1)
    front.restart(1)
    got = _delta(world, front, "B")
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "does not hold its base" in o.message, (r, o)
    assert front.digests(0) == before[0] and front.digests(1) == {}
    # with fallback the same call becomes a full update of B: every engine holds B
    got = all_ok(_delta(world, front, "B", mode="fallback", behaviors={i: {"version": "B"} for i in range(WORLD)}))
    assert all("fallback" in o.value["delta"] for o in got.values())
    assert all(d == _want(v["B"]) for d in _engines(front))

    # a corrupted payload (rank 1's copy of one tensor's delta): refused when its bucket is decoded; the
    # worker that already applied rank 0's bucket undoes it; both keep B byte for byte
    hit = world.all("call", ("support.delta_world", "corrupt_payload", ("C", "r1.down.weight")))
    assert [hit[r].value for r in range(WORLD)] == [False, True]
    got = _delta(world, front, "C")
    for r, o in got.items():
        assert not o.ok and o.error == "RemoteWorkerError" and "body's check" in o.message, (r, o)
    assert all(d == _want(v["B"]) for d in _engines(front))
    assert all(front.call(i, "held")[1] == "B" for i in range(WORLD))

    # the mutation check: an apply that drops one changed element fails the post-apply digest check
    all_ok(world.all("unregister", ("C", {})))
    _register(world, "C", v["C"], base="B")
    drop = {i: {"env": {"CKPT_TEST_DELTA_DROP_ONE": "1"}} for i in range(WORLD)}
    got = _delta(world, front, "C", behaviors=drop)
    for r, o in got.items():
        assert not o.ok and o.error == "RemoteWorkerError" and "do not match the version's digest" in o.message, (r, o)
    assert all(d == _want(v["B"]) for d in _engines(front))

    # and the next deltas work: C, then D
    for name in ("C", "D"):
        all_ok(_delta(world, front, name))
        assert all(d == _want(v[name]) for d in _engines(front))


def test_a_full_update_that_failed_before_its_transfer_keeps_the_delta_base(world_and_front):
    """A full update refused in its handshake (an engine worker's plan check) sent nothing to any engine
    worker: every PS rank says so, keeps the version its engines hold as the next delta's base, and the
    delta then applies bit exact. One that failed after its transfer began says the engines may hold a
    mix, and the delta of the old base is refused until a full update succeeds."""
    world, front = world_and_front
    trainer = Trainer(seed=11)
    v = {"A": trainer.version()}
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    for name, base in (("B", "A"), ("C", "B")):
        trainer.step(1e-4)
        v[name] = trainer.version()
        _register(world, name, v[name], base=base)

    got = world.update("B", front, behaviors={1: {"require": ["lm_head.absent"]}})
    for r, o in got.items():
        assert not o.ok and "checkpoint lacks" in o.message, (r, o)
        assert "nothing was sent to any engine worker" in o.message, (r, o.message)
        assert "the engines still hold version 'A', and a delta of it can follow" in o.message, (r, o.message)
    assert all(d == _want(v["A"]) for d in _engines(front))
    assert [o.value for o in world.all("call", ("support.delta_world", "engines_hold", ())).values()] == ["A", "A"]
    all_ok(_delta(world, front, "B"))
    assert all(d == _want(v["B"]) for d in _engines(front))

    got = world.update("C", front, behaviors={1: {"fail_bucket": 0}})
    for r, o in got.items():
        assert not o.ok and "the transfer had begun: the engines may hold a mix" in o.message, (r, o.message)
        assert "nothing was sent" not in o.message, (r, o.message)
    got = _delta(world, front, "C")
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError", (r, o)
    all_ok(world.update("C", front, behaviors={i: {"version": "C"} for i in range(WORLD)}))
    assert all(d == _want(v["C"]) for d in _engines(front))


def test_a_version_without_a_base_is_refused_as_a_delta_on_every_rank(world_and_front):
    world, front = world_and_front
    trainer = Trainer(seed=3)
    _register(world, "A", trainer.version())
    got = _delta(world, front, "A")
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "not registered with a base" in o.message, (r, o)
    got = world.all("register", per_rank={r: ("B", {"named_tensors": trainer.version()[r], "base": "Z"})
                                          for r in range(WORLD)})
    for r, o in got.items():
        assert not o.ok and o.error == "DeltaBaseError" and "'Z'" in o.message, (r, o)
    _register(world, "B", trainer.version(), base="A")
    got = world.all("call", ("support.delta_world", "delta_update_sliced", ("B",)))
    for r, o in got.items():
        assert not o.ok and o.error == "ConfigError" and "must be a SlicePlan" in o.message, (r, o)


def test_a_trainers_versions_on_its_device_are_encoded_there_and_applied_bit_exact(world_and_front):
    """``on_device=True`` versions (a trainer's weights and its previous ones, kept on its device; here the
    CPU stands in for it): the delta is encoded on the device (``encode_device.py``), its payloads stay
    there and are copied device-to-device into the IPC buffer; every engine equals the full version.
    The same versions registered in host memory give the same delta (changed elements, payload bytes,
    encodings)."""
    world, front = world_and_front
    trainer = Trainer(seed=5)
    v = {"A": trainer.version()}

    def register(name, tensors, base=None, on_device=True):
        extra = {"on_device": True} if on_device else {}
        extra.update({} if base is None else {"base": base})
        all_ok(world.all("register", per_rank={r: (name, {"named_tensors": tensors[r], **extra})
                                                for r in range(WORLD)}))
        all_ok(world.all("gather", name))

    def figures(name):
        got = all_ok(world.all("call", ("support.delta_world", "delta_figures", (name,))))
        keep = ("changed_tensors", "changed_elements", "payload_bytes", "full_bytes", "encodings")
        return {r: {k: o.value[k] for k in keep} for r, o in got.items()}

    register("A", v["A"])
    register("hA", v["A"], on_device=False)
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    prev = "A"
    for name, lr in (("B", 1e-5), ("C", 1e-4)):
        trainer.step(lr)
        v[name] = trainer.version()
        register(name, v[name], base=prev)
        register("h" + name, v[name], base="h" + prev, on_device=False)
        assert figures(name) == figures("h" + name)
        for n, where in ((name, True), ("h" + name, False)):
            got = all_ok(world.all("call", ("support.delta_world", "companion_on_device", (n,))))
            assert all(o.value is where for o in got.values()), (n, got)
        got = all_ok(_delta(world, front, name))
        for r, o in got.items():
            fig = o.value["delta"]
            assert fig["base"] == prev and 0 < fig["payload_bytes"] < fig["full_bytes"], (name, r, fig)
        assert all(d == _want(v[name]) for d in _engines(front)), f"an engine differs from {name} after its delta"
        prev = name


def test_a_device_resident_base_that_changed_since_its_registration_is_refused(world_and_front):
    """A trainer that registers its live parameters as a version and then steps in place changes that
    version under the PS: the engines received the registered bytes, so a delta against the changed
    ones would leave them silently different. Registering the next version with that base is refused
    (``DeviceResidentError``), nothing kept; a base kept as its own copy works."""
    world, front = world_and_front
    trainer = Trainer(seed=9)
    v = {"A": trainer.version()}
    all_ok(world.all("register", per_rank={r: ("A", {"named_tensors": v["A"][r], "on_device": True})
                                            for r in range(WORLD)}))
    all_ok(world.all("gather", "A"))
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    # the trainer steps "in place": A's registered tensors now hold B's bytes
    all_ok(world.all("call", ("support.delta_world", "overwrite_registered", ("A", 1))))
    trainer.step(1e-4)
    v["B"] = trainer.version()
    got = world.all("register", per_rank={r: ("B", {"named_tensors": v["B"][r], "on_device": True, "base": "A"})
                                          for r in range(WORLD)})
    for r, o in got.items():
        assert not o.ok and o.error == "DeviceResidentError" and "shown unchanged" in o.message, (r, o)
        assert "on_device_digest" not in o.message, o.message   # its bytes changed: named, not unrecorded
    got = all_ok(world.all("checkpoints"))
    assert all(o.value == ["A"] for o in got.values()), got
    # a version registered without its record (on_device_digest=False: full updates only) is no base either
    all_ok(world.all("register", per_rank={r: ("N", {"named_tensors": v["B"][r], "on_device": True,
                                                      "on_device_digest": False}) for r in range(WORLD)}))
    got = world.all("register", per_rank={r: ("B", {"named_tensors": v["B"][r], "on_device": True, "base": "N"})
                                          for r in range(WORLD)})
    for r, o in got.items():
        assert not o.ok and o.error == "DeviceResidentError" and "on_device_digest=False" in o.message, (r, o)


def test_a_base_mapped_in_place_from_a_file_written_since_is_refused():
    """A version registered in place from /dev/shm (mapped, not copied) holds the file's bytes: a trainer
    that writes its next step into the same file changes them under the PS. Registering a version with
    that base is refused (``DeltaBaseError``), nothing kept; a base whose file was left alone works, and so
    does one written as a new file (write-then-rename: the mapping keeps the old inode)."""
    import os

    import torch

    from ckpt_core import DeltaBaseError, ParameterServer
    from support.e2e_cases import ShmDir
    from support.ports import free_port
    from safetensors.torch import save_file

    shm = ShmDir()
    gen = torch.Generator().manual_seed(4)
    a = {"w": torch.randn(256, generator=gen).bfloat16(), "v": torch.randn(64, generator=gen).bfloat16()}
    b = {n: t.clone() for n, t in a.items()}
    b["w"][:5] += 1
    try:
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                             master_port=free_port()) as ps:
            path_a = shm.write("a.safetensors", a)
            ps.register_checkpoint("A", files=[path_a])
            ps.register_checkpoint("B", files=[shm.write("b.safetensors", b)], base="A")   # untouched base: fine
            assert ps.deltas.figures["B"]["changed_elements"] == 5
            tmp = path_a + ".tmp"   # write-then-rename: A's mapping keeps the old file
            save_file(b, tmp)
            os.replace(tmp, path_a)
            ps.register_checkpoint("B2", files=[shm.write("b2.safetensors", b)], base="A")
            assert ps.deltas.figures["B2"]["changed_elements"] == 5
            path_c = shm.write("c.safetensors", a)
            ps.register_checkpoint("C", files=[path_c])
            with open(path_c, "r+b") as f:   # the same file written in place: C's mapped bytes change
                f.seek(-8, os.SEEK_END)
                f.write(b"\x01" * 8)
            with pytest.raises(DeltaBaseError, match="'C' of 'D' changed since it was registered.*was written"):
                ps.register_checkpoint("D", files=[shm.write("d.safetensors", b)], base="C")
            assert "D" not in ps.deltas.figures
    finally:
        shm.close()


def test_a_version_whose_companion_cannot_be_built_keeps_no_base_and_registers_again(monkeypatch):
    """The delta is encoded, then building its companion checkpoint fails (here: no memory for it): the
    registration raises that error, keeps nothing of the version (no base, no figures, no checkpoint),
    and the same name registers again, with or without the base."""
    import torch

    import ckpt_core.delta.dispatch as dispatch
    from ckpt_core import ParameterServer
    from support.ports import free_port

    gen = torch.Generator().manual_seed(5)
    a = {"w": torch.randn(512, generator=gen).bfloat16()}
    b = {"w": a["w"].clone()}
    b["w"][:7] += 1
    real = dispatch.build_packed

    def no_memory(*args, **kwargs):
        raise MemoryError("no pinned memory for the companion")
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=free_port()) as ps:
        ps.register_checkpoint("A", named_tensors=a)
        monkeypatch.setattr(dispatch, "build_packed", no_memory)
        with pytest.raises(MemoryError, match="companion"):
            ps.register_checkpoint("B", named_tensors=b, base="A")
        assert "B" not in ps.deltas.bases and "B" not in ps.deltas.figures
        assert "B" not in ps.checkpoints()
        monkeypatch.setattr(dispatch, "build_packed", real)
        ps.register_checkpoint("B", named_tensors=b)
        assert "B" not in ps.deltas.bases   # registered whole this time: no stale base from the failed try
        ps.unregister_checkpoint("B")
        ps.register_checkpoint("B", named_tensors=b, base="A")
        assert ps.deltas.bases["B"] == "A" and ps.deltas.figures["B"]["changed_elements"] == 7
