"""P2P test cases shared by the CPU and GPU tests, and the PS-side steps they run inside PS
processes (through ``PsWorld``'s ``call`` command)."""

from __future__ import annotations

import itertools
import json
import sys

from support.engine import EngineFront, make_req_func
from support.world import FreshCheckpoints, PsWorld

# simulated host A (TCP on loopback), serving its checkpoints over P2P (opt-in)
OWNERS = {"PS_P2P_HOST": "127.0.0.2", "NCCL_IB_DISABLE": "1", "PS_P2P_SERVE": "1"}
JOINERS = {"PS_P2P_HOST": "127.0.0.3", "NCCL_IB_DISABLE": "1"}   # simulated host B
SMALL = {"max_bucket_gb": 0.00005}   # ~52 KiB buckets: every update spans many buckets


def call(world, fn, *args, ranks=None, timeout=120):
    """Run ``fn(ps, rank, *args)`` of this module in the PS processes of ``world``."""
    return world.all("call", (__name__, fn, args), ranks=ranks, timeout=timeout)


def all_ok(got):
    assert all(o.ok for o in got.values()), got
    return got


def owners_with(w, n=1, **kw):
    ck = FreshCheckpoints(w, seed=23, **kw)
    return ck, [ck.new() for _ in range(n)]


def subsets(world: int) -> list[list[int]]:
    return [list(c) for k in range(1, world + 1) for c in itertools.combinations(range(world), k)]


# ---------------------------------------------------------------- cases
def case_every_subset(kind: str, world: int) -> None:
    """An owner world; P2P into every non-empty subset of its ranks, bit-exact; the others untouched."""
    with PsWorld(kind, world, init=SMALL, env=OWNERS) as w:
        _, [(name, want)] = owners_with(w, per_rank=16)   # > 2 buckets of SMALL even with one owner
        for targets in subsets(world):
            front = EngineFront(kind, len(targets), devices=targets)
            try:
                got = all_ok(call(w, "p2p_update", name, front.address, 60, targets))
                for r in range(world):
                    assert got[r].value["target"] == (r in targets), got[r]
                for i in range(len(targets)):
                    assert front.digests(i) == want, f"targets {targets}: worker {i}"
                for r in set(range(world)) - set(targets):
                    assert w.all("ipc_buffer", ranks=[r])[r].value is None, "a non-target allocated a buffer"
                assert all(got[r].value["buckets"] >= 2 for r in targets), "the case must span several buckets"
            finally:
                front.close()


def case_joiner_world(kind: str, world: int, tmp_path) -> None:
    """Owners on 127.0.0.2 save their metas; a separate world on 127.0.0.3 pulls through the file."""
    path = str(tmp_path / "metas.json")
    with PsWorld(kind, world, init=SMALL, env=OWNERS) as owners:
        _, [(name, want)] = owners_with(owners)
        all_ok(call(owners, "save_metas", path, ranks=[0]))
        doc = json.load(open(path))
        assert doc["format"] == "ckpt-engine/metas" and doc["version"] == 1
        addrs = [o["p2p"]["address"] for o in doc["checkpoints"][name]["owners"]]
        assert all(a.startswith("127.0.0.2:") for a in addrs) and len(set(addrs)) == world, addrs
        with PsWorld(kind, world, init=SMALL, env=JOINERS) as joiners:
            all_ok(call(joiners, "load_metas", path))
            front = EngineFront(kind, world)
            try:
                got = all_ok(call(joiners, "p2p_update", name, front.address, 60, list(range(world))))
                assert sum(got[r].value["read_bytes"] for r in range(world)) == got[0].value["bytes"]
                for i in range(world):
                    assert front.digests(i) == want
                info = all_ok(call(joiners, "p2p_info"))
                assert all(info[r].value["address"].startswith("127.0.0.3:") for r in range(world)), info
                assert all(info[r].value["registered"] == 0 for r in range(world)), "staging stays registered"
            finally:
                front.close()


# ---------------------------------------------------------------- steps run inside the PS processes
def p2p_update(ps, rank, name, address, timeout, ranks, behaviors=None):
    """update(..., ranks=ranks) on every rank; the first target posts the targets' handles to the front."""
    first = min(ranks) if ranks else 0
    req = make_req_func(address, behaviors) if rank == first and address is not None else (lambda h: None)
    return ps.update(name, req, ranks=ranks, timeout=timeout)


def save_metas(ps, rank, path):
    if rank == 0:
        ps.save_metas(path)
    return ps.get_metas()


def load_metas(ps, rank, metas):
    return ps.load_metas(metas)


def hide_mooncake(ps, rank):
    """Make this process behave as if Mooncake were not installed."""
    for mod in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        del sys.modules[mod]
    sys.modules["mooncake"] = None   # import mooncake -> ImportError
    return None


def p2p_info(ps, rank):
    st = ps._p2p.store
    if st is None:
        return None
    fixed = {st._stamps.data_ptr(), st._scratch.data_ptr()}   # registered for the store's life
    return {"address": st.address, "transport": st.transport, "quarantined": len(st.quarantine),
            "registered": len(set(st.registered) - fixed)}


def p2p_update_as(ps, rank, name, address, timeout, ranks, req="post"):
    """``p2p_update`` with this rank's own, possibly bad, arguments; ``req="none"``: req_func=None."""
    if req == "none":
        return ps.update(name, None, ranks=ranks, timeout=timeout)
    return p2p_update(ps, rank, name, address, timeout, ranks)


def break_next_read(ps, rank):
    """Fault injection at the transport seam: this rank's next P2P read raises a plain (untyped)
    exception, as a bug or a third-party library would, instead of returning."""
    store = ps._p2p.ensure_store(required=True)
    real = store.read

    def read(*args, **kwargs):
        store.read = real
        raise RuntimeError("injected: a local failure inside this target's read")
    store.read = read


def set_wire(ps, rank, wire):
    """This rank's engine wire (normally fixed at construction): lets a test make ranks disagree."""
    ps.wire = wire
