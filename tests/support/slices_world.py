"""A slice plan for the CPU routing tests: tensors split by rows, by columns, and read whole, as
two engine ranks' loaders would read them (``planning/slices.py``); used through ``PsWorld``'s
``call`` command inside each PS process."""

from __future__ import annotations

import math

import torch

from ckpt_core.planning.slices import RankSlices, SliceKey, SlicePlan, Write, box_extent, plan_from_json, plan_to_json
from support.data import digest
from support.engine import EngineFront, make_req_func
from support.world import PsWorld

SHAPES = {"rows": (6, 4), "cols": (4, 6), "norm": (5,), "emb": (8, 4)}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def plan(tp: int = 2) -> SlicePlan:
    """Engine rank t of ``tp`` (1 or 2) reads its rows of ``rows`` and ``emb``, its columns of ``cols``
    and the whole ``norm``."""
    ranks = []
    for r in range(tp):
        n, e = 6 // tp, 8 // tp
        needs = {"rows": ((0, n * r, n),) if tp > 1 else None, "cols": ((1, n * r, n),) if tp > 1 else None,
                 "norm": None, "emb": ((0, e * r, e),) if tp > 1 else None}
        params = {"p_rows": (n, 4), "p_cols": (4, n), "p_norm": (5,), "p_emb": (e, 4)}
        writes = tuple(Write(f"p_{x}", (), x) for x in SHAPES)
        ranks.append(RankSlices(r, needs, params, writes))
    return SlicePlan(SliceKey("slices-world", f"tp={tp}", "test"),
                     {n: ("F32", s, 4) for n, s in SHAPES.items()}, tuple(ranks))


def want(seed: int, rank: int, tp: int = 2) -> dict[str, torch.Tensor]:
    """What engine rank ``rank`` must receive: its rows, its columns, the whole norm."""
    return slice_of(tensors(seed), plan(tp).ranks[rank])


def slice_of(full: dict[str, torch.Tensor], rs: RankSlices) -> dict[str, torch.Tensor]:
    """The boxes ``rs`` needs of the whole tensors ``full``, each as one contiguous tensor."""
    out = {}
    for name, box in rs.needs.items():
        t = full[name]
        for d, s, n in box or ():
            t = t.narrow(d, s, n)
        out[name] = t.contiguous()
    return out


def sliced_update(ps, rank, name, address, timeout, doc):
    """An update routed by the plan ``doc`` (None: this rank passes no plan)."""
    req = make_req_func(address) if rank == 0 else (lambda h: None)
    return ps.update(name, req, timeout=timeout, slices=None if doc is None else plan_from_json(doc))


def plan_doc(tp: int = 2) -> dict:
    return plan_to_json(plan(tp))


def _register(world: PsWorld, t: dict) -> None:
    world.all("register", per_rank={0: ("c", {"named_tensors": {"rows": t["rows"], "norm": t["norm"]}}),
                                    1: ("c", {"named_tensors": {"cols": t["cols"], "emb": t["emb"]}})})
    world.all("gather", "c")


def sliced_update_lands(world: PsWorld, front: EngineFront, name: str, seed: int, timeout: float = 60) -> dict:
    """Every rank's sliced update of ``name`` (by ``plan()``) succeeds and each of the 2 workers then
    holds exactly its slices of ``tensors(seed)``; returns the ranks' outcomes."""
    got = world.all("call", (__name__, "sliced_update", (name, front.address, timeout, plan_doc())))
    assert all(o.ok for o in got.values()), got
    for r in range(2):
        assert front.digests(r) == {n: digest(x) for n, x in want(seed, r).items()}, f"worker {r}"
    return got


def case_each_worker_receives_its_slices(kind: str) -> None:
    """Each worker holds exactly its rows, its columns and the whole norm; the result says how many
    bytes each rank received."""
    front = EngineFront(kind, 2, slices=(plan().digest, [0, 1]))
    try:
        with PsWorld(kind, 2) as world:
            _register(world, tensors(7))
            got = sliced_update_lands(world, front, "c", 7)
            for r in range(2):
                result = got[r].value["slices"]
                assert result["received_bytes"] == [plan().rank_bytes(0), plan().rank_bytes(1)] == [180, 180]
                assert result["whole_bytes"] == 340
    finally:
        front.close()


def whole_update_works(world: PsWorld, front: EngineFront, t: dict, ranks: int) -> None:
    """After a refused sliced update: an update of checkpoint "c" without a plan succeeds on every
    rank and every worker then holds ``t`` whole."""
    again = world.all("update", ("c", front.address, 30, None))
    assert all(again[r].ok for r in range(ranks)), again
    for r in range(ranks):
        assert front.digests(r) == {n: digest(x) for n, x in t.items()}


def case_disagreeing_ranks_refuse(kind: str) -> None:
    """A rank without the plan: every rank refuses before any engine is asked; the next update works."""
    front = EngineFront(kind, 2)
    try:
        with PsWorld(kind, 2) as world:
            t = tensors(8)
            _register(world, t)
            got = world.all("call", per_rank={0: (__name__, "sliced_update", ("c", front.address, 30, plan_doc())),
                                              1: (__name__, "sliced_update", ("c", front.address, 30, None))})
            for r in range(2):
                assert not got[r].ok and got[r].error == "ConfigError" and "disagree on the slice plan" in got[r].message
            assert front.fanouts == 0, "no engine was asked to load anything"
            whole_update_works(world, front, t, 2)
    finally:
        front.close()


def case_file_and_shm_sources(kind: str, tmp_path) -> None:
    """The same slices from checkpoint files: rank 0's tensors from a safetensors file on disk, rank
    1's from one in /dev/shm registered in place; each worker holds exactly its slices, twice over."""
    from ckpt_core.checkpoint.safetensors import write_file
    from support.e2e_cases import ShmDir

    front = EngineFront(kind, 2, slices=(plan().digest, [0, 1]))
    shm = ShmDir()
    try:
        with PsWorld(kind, 2) as world:
            for seed in (21, 22):   # a second checkpoint replaces the first in the same engines
                t = tensors(seed)
                disk = str(tmp_path / f"rows-norm-{seed}.safetensors")
                write_file(disk, {"rows": t["rows"], "norm": t["norm"]})
                in_shm = shm.write(f"cols-emb-{seed}.safetensors", {"cols": t["cols"], "emb": t["emb"]})
                name = f"f{seed}"
                world.all("register", per_rank={0: (name, {"files": [disk]}), 1: (name, {"files": [in_shm]})})
                world.all("gather", name)
                got = sliced_update_lands(world, front, name, seed)
                for r in range(2):
                    assert got[r].value["slices"]["received_bytes"] == [plan().rank_bytes(0), plan().rank_bytes(1)]
    finally:
        front.close()
        shm.close()


# The replica layout: a PS world of 4 ranks feeds 2 replicas of a 2-rank engine (PS rank p feeds
# engine rank p % 2). Each rank owns one tensor; all but the norm are read in slices.
OWNERS = {"rows": 0, "cols": 1, "norm": 2, "emb": 3}


def _register_four(world: PsWorld, t: dict) -> None:
    world.all("register", per_rank={r: ("c", {"named_tensors": {n: t[n] for n, o in OWNERS.items() if o == r}})
                                    for r in range(4)})
    world.all("gather", "c")


def case_replicas_share_one_transfer(kind: str) -> None:
    """Every worker holds exactly its engine rank's slices, bit for bit (the two replicas the same),
    and every slice leaves its owner once: each rank sent the bytes of what it owns, once; a slice
    for a replica group its owner is not in is sent to the group's first rank, which re-broadcasts
    it in the group."""
    front = EngineFront(kind, 4, slices=(plan().digest, [0, 1, 0, 1]))
    try:
        with PsWorld(kind, 4) as world:
            t = tensors(11)
            _register_four(world, t)
            got = world.all("call", (__name__, "sliced_update", ("c", front.address, 60, plan_doc())))
            assert all(got[r].ok for r in range(4)), got
            p = plan()
            for r in range(4):
                result = got[r].value["slices"]
                assert result["received_bytes"] == [p.rank_bytes(q % 2) for q in range(4)] == [180] * 4
                owned = sum(t[n].numel() * 4 for n, o in OWNERS.items() if o == r)
                assert result["sent"]["bytes"] == owned, (r, result["sent"])
            # rank 0 re-broadcasts to rank 2 the cols and emb slices of engine rank 0 (from ranks 1 and
            # 3), rank 1 to rank 3 the rows slice of engine rank 1 (from rank 0)
            assert [got[r].value["slices"]["sent"]["forwarded_bytes"] for r in range(4)] == \
                [(12 + 16) * 4, 12 * 4, 0, 0]
            # rank 0: rows to {0, 2} (broadcast), rows to rank 1 (send), two re-broadcasts; rank 1 the
            # same with cols; rank 2: the norm to all; rank 3: emb to {1, 3} and emb to rank 0
            assert [got[r].value["slices"]["sent"]["sends"] for r in range(4)] == [4, 3, 1, 2]
            for q in range(4):
                assert front.digests(q) == {n: digest(x) for n, x in want(11, q % 2).items()}, f"worker {q}"
            # a second update reuses the two replica groups: made once per ParameterServer
            assert all(o.ok for o in world.all("unregister", ("c", {})).values())
            _register_four(world, tensors(13))
            got = world.all("call", (__name__, "sliced_update", ("c", front.address, 60, plan_doc())))
            assert all(got[r].ok for r in range(4)), got
            for q in range(4):
                assert front.digests(q) == {n: digest(x) for n, x in want(13, q % 2).items()}, f"worker {q}"
            groups = world.all("call", (__name__, "own_groups", ()))
            assert [groups[r].value for r in range(4)] == [[[0, 2], [1, 3]]] * 4, groups
    finally:
        front.close()


def own_groups(ps, rank):
    """The groups of ranks this rank's Collectives made by ``group`` (in the order made)."""
    return [list(g) for g in ps._coll._groups_of]


def case_world_not_a_multiple_of_the_engine_refuses(kind: str) -> None:
    """A 3-rank PS world with a 2-rank plan: a ConfigError naming both numbers on every rank, before
    any engine is asked to load; the next (whole) update works."""
    front = EngineFront(kind, 3)
    try:
        with PsWorld(kind, 3) as world:
            t = tensors(12)
            world.all("register", per_rank={r: ("c", {"named_tensors": {n: t[n] for n, o in OWNERS.items()
                                                                          if o % 3 == r}}) for r in range(3)})
            world.all("gather", "c")
            got = world.all("call", (__name__, "sliced_update", ("c", front.address, 30, plan_doc())))
            for r in range(3):
                assert not got[r].ok and got[r].error == "ConfigError", got[r]
                assert "2 engine ranks" in got[r].message and "3 ranks" in got[r].message, got[r].message
            assert front.fanouts == 0
            whole_update_works(world, front, t, 3)
    finally:
        front.close()


# Trainer shards as the source: tensors registered in pieces (TensorShard boxes), read in slices.
PIECED = {"w": (6, 8), "u": (10, 4), "m": (4, 6), "n": (7,), "n2": (5,), "b": (4, 4)}


def pieced_plan(tp: int = 2) -> SlicePlan:
    """Engine rank t of 2: columns of ``w`` (its pieces are rows: every slice crosses owners), rows
    0-4 / 5-9 of ``u`` (pieces of rows 0-3 and 4-9: the borders do not align), rows of ``m`` (its
    pieces are columns: each intersection is strided in the slice), the whole ``n`` and ``n2``
    (pieces, read whole by every rank: one bucket, two segments per owner), rows of ``b``
    (registered whole)."""
    assert tp == 2
    ranks = []
    for r in range(2):
        needs = {"w": ((1, 4 * r, 4),), "u": ((0, 5 * r, 5),), "m": ((0, 2 * r, 2),), "n": None, "n2": None,
                 "b": ((0, 2 * r, 2),)}
        params = {f"p_{n}": box_extent(PIECED[n], b) for n, b in needs.items()}
        ranks.append(RankSlices(r, needs, params, tuple(Write(f"p_{n}", (), n) for n in needs)))
    return SlicePlan(SliceKey("slices-pieces", "tp=2", "test"), {n: ("F32", s, 4) for n, s in PIECED.items()},
                     tuple(ranks))


def pieced_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in PIECED.items()}


def pieced_layout(world: int) -> dict[str, list]:
    """name -> [(rank, offsets, extent)] (one entry of offsets None: registered whole on that rank).
    Two ranks: dim-0 halves of w, uneven rows of u, dim-1 pieces of m, uneven pieces of n. Four
    ranks: w and u cut in four uneven row ranges (one of u's empty), m in 2 x 2 boxes."""
    if world == 2:
        return {"w": [(0, (0, 0), (3, 8)), (1, (3, 0), (3, 8))], "u": [(0, (0, 0), (4, 4)), (1, (4, 0), (6, 4))],
                "m": [(0, (0, 0), (4, 2)), (1, (0, 2), (4, 4))], "n": [(0, (0,), (3,)), (1, (3,), (4,))],
                "n2": [(0, (0,), (2,)), (1, (2,), (3,))], "b": [(1, None, None)]}
    return {"w": [(0, (0, 0), (1, 8)), (1, (1, 0), (2, 8)), (2, (3, 0), (1, 8)), (3, (4, 0), (2, 8))],
            "u": [(3, (0, 0), (4, 4)), (0, (4, 0), (3, 4)), (1, (7, 0), (3, 4)), (2, (10, 0), (0, 4))],
            "m": [(0, (0, 0), (2, 3)), (1, (0, 3), (2, 3)), (2, (2, 0), (2, 3)), (3, (2, 3), (2, 3))],
            "n": [(2, (0,), (5,)), (3, (5,), (2,))], "n2": [(3, (0,), (2,)), (2, (2,), (3,))],
            "b": [(1, None, None)]}


def register_pieces(world: PsWorld, full: dict, layout: dict) -> dict[int, int]:
    """Register ``layout`` (``pieced_layout``); the bytes each rank registered."""
    from ckpt_core import TensorShard
    spec: dict[int, dict] = {r: {} for r in range(world.size)}
    owned = {r: 0 for r in range(world.size)}
    for name, pieces in layout.items():
        for rank, offsets, extent in pieces:
            if offsets is None:
                spec[rank][name] = full[name]
                owned[rank] += full[name].numel() * 4
                continue
            local = full[name]
            for d, (o, e) in enumerate(zip(offsets, extent)):
                local = local.narrow(d, o, e)
            spec[rank][name] = TensorShard(local.clone(), tuple(full[name].shape), offsets)
            owned[rank] += local.numel() * 4
    got = world.all("register", per_rank={r: ("c", {"named_tensors": spec[r]}) for r in range(world.size)})
    assert all(o.ok for o in got.values()), got
    got = world.all("gather", "c")
    assert all(o.ok for o in got.values()), got
    return owned


def kept_bytes(plan: SlicePlan, layout: dict, world_size: int) -> dict[int, int]:
    """Per rank, the bytes of its own pieces that its own engine rank reads in slices and that so
    never leave it: with one replica (PS rank r feeds engine rank r) a slice's part owned by its own
    PS rank is only staged; with several, every part goes to the replica group at least once."""
    kept = {r: 0 for r in range(world_size)}
    if world_size > len(plan.ranks):
        return kept
    for name, pieces in layout.items():
        _, shape, itemsize = plan.tensors[name]
        if all(name in rs.needs and not rs.needs[name] for rs in plan.ranks):
            continue   # read whole by every rank: broadcast from its owner(s)
        for rank, offsets, extent in pieces:
            if name not in plan.ranks[rank].needs:
                continue
            offsets, extent = offsets or (0,) * len(shape), extent or shape
            lo, hi = list(offsets), [o + e for o, e in zip(offsets, extent)]
            for d, s, n in plan.ranks[rank].needs[name] or ():
                lo[d], hi[d] = max(lo[d], s), min(hi[d], s + n)
            kept[rank] += math.prod(max(0, h - l) for l, h in zip(lo, hi)) * itemsize
    return kept


def case_slices_of_trainer_shards(kind: str, world_size: int = 2) -> None:
    """Each worker holds exactly its engine rank's slices (p % 2), bit for bit, assembled from the
    pieces of every owner; the bytes per rank are the plan's; every rank sent what it registered,
    once (each piece's intersections with the slices leave their owner once)."""
    front = EngineFront(kind, world_size, slices=(pieced_plan().digest, [q % 2 for q in range(world_size)]))
    try:
        with PsWorld(kind, world_size) as world:
            full = pieced_tensors(21)
            owned = register_pieces(world, full, pieced_layout(world_size))
            p = pieced_plan()
            doc = plan_to_json(p)
            kept = kept_bytes(p, pieced_layout(world_size), world_size)
            for seed in (21, 22):   # twice: the second update reuses the plan; fresh bytes must arrive
                if seed == 22:
                    full = pieced_tensors(22)
                    assert all(o.ok for o in world.all("unregister", ("c", {})).values())
                    register_pieces(world, full, pieced_layout(world_size))
                got = world.all("call", (__name__, "sliced_update", ("c", front.address, 60, doc)))
                assert all(got[r].ok for r in range(world_size)), got
                for r in range(world_size):
                    result = got[r].value["slices"]
                    assert result["received_bytes"] == [p.rank_bytes(q % 2) for q in range(world_size)]
                    assert result["sent"]["bytes"] == owned[r] - kept[r], (r, result["sent"], owned, kept)
                for q in range(world_size):
                    assert front.digests(q) == {n: digest(x) for n, x in slice_of(full, p.ranks[q % 2]).items()}, \
                        f"worker {q}"
    finally:
        front.close()


# --- a real engine: trainer shards of a safetensors checkpoint, updated by the engine's slice plan --

def fsdp_rows(t: torch.Tensor, rank: int, world: int):
    """This rank's FSDP2 shard of ``t``: its ``torch.chunk`` of the rows (the last ones smaller or
    empty), as a TensorShard; a 0-d tensor goes whole to rank 0 (None elsewhere)."""
    from ckpt_core import TensorShard
    if t.dim() == 0:
        return t.clone() if rank == 0 else None
    chunks = torch.chunk(t, world, dim=0)
    start = sum(c.shape[0] for c in chunks[:rank])
    local = chunks[rank] if rank < len(chunks) else t.narrow(0, t.shape[0], 0)
    return TensorShard(local.clone(), tuple(t.shape), (start,) + (0,) * (t.dim() - 1))


def shards_sliced_update(ps, rank, name, weights, endpoint, timeout):
    """Every rank registers its FSDP2-style shard of every tensor of ``weights`` (half the rows at
    2 ranks); rank 0 records the slice plan from the vLLM server at ``endpoint``
    (``VllmClient.slice_plan``) and shares it; the update is routed by it. Returns the update's
    result, the plan (JSON) and the bytes this rank registered."""
    from safetensors.torch import load_file

    from ckpt_vllm import VllmClient
    named = {}
    for n, t in load_file(str(weights)).items():
        shard = fsdp_rows(t, rank, ps.world_size)
        if shard is not None:
            named[n] = shard
    ps.register_checkpoint(name, named_tensors=named)
    ps.gather_metas(name)
    client = VllmClient(endpoint, timeout=timeout) if rank == 0 else None
    try:
        plan = ps.share_slice_plan(client.slice_plan(ps.tensor_specs(name)) if client is not None else None)
        req = (lambda h: client.update(h, path="extension", timeout=timeout, slices=plan.digest)) if client else \
            (lambda h: None)
        result = ps.update(name, req, timeout=timeout, slices=plan)
    finally:
        if client is not None:
            client.close()
    local = {n: getattr(s, "local", s) for n, s in named.items()}
    layout = {n: [(rank, tuple(getattr(s, "offsets", (0,) * t.dim())), tuple(t.shape))] for n, (s, t) in
              ((n, (named[n], local[n])) for n in named)}
    return {"result": result, "plan": plan_to_json(plan), "layout": layout,
            "registered": sum(t.numel() * t.element_size() for t in local.values())}
