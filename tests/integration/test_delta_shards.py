"""Deltas of a trainer's shards (issue 39): versions registered in pieces (``TensorShard`` boxes) by 2 real
PS processes, updated as deltas into real engine-worker processes.

Each rank holds pieces of most tensors: even halves of rows, an uneven split of rows, column blocks (strided
pieces), and a tensor held whole by one rank. A -> B -> C with random sparse changes (one piece of a tensor
left unchanged) go as deltas: every engine worker ends equal, byte for byte, to the full tensors (scattered
into its live tensors, or rebuilt from its kept copy and reloaded where the engine derives them), with fewer
payload bytes than the version's. A version pieced differently from its base, and a base missing on one
rank, are refused on every rank alike before anything moves, the engines left on their base; the next full
update works.
"""

import pytest
import torch
from support.asserts import assert_every_rank_failed
from support.data import fresh_tensor, random_bits, want_digests
from support.delta_world import DeltaEngine
from support.engine import EngineFront
from support.p2p_cases import all_ok
from support.world import PsWorld

from ckpt_core import TensorShard

pytestmark = pytest.mark.timeout(600)

WORLD = 2
# tensor -> (shape, dtype, {rank: [(offsets, extent)]}); the engine derives "mlp" and "fp8" (kept in its own
# layout: a delta reaches them rebuilt from its kept copy), the others it holds verbatim (scattered into)
LAYOUT = {
    "embed": ((96, 32), torch.bfloat16, {0: [((0, 0), (48, 32))], 1: [((48, 0), (48, 32))]}),
    "down": ((32, 64), torch.bfloat16, {0: [((0, 0), (32, 32))], 1: [((0, 32), (32, 32))]}),
    "mlp": ((64, 32), torch.bfloat16, {0: [((0, 0), (40, 32))], 1: [((40, 0), (24, 32))]}),
    "fp8": ((16, 32), torch.float8_e4m3fn, {0: [((0, 0), (5, 32))], 1: [((5, 0), (11, 32))]}),
    "up": ((48, 16), torch.float32, {0: [((0, 0), (48, 5))], 1: [((0, 5), (48, 11))]}),
    "norm": ((32,), torch.float32, {1: None}),          # whole, on rank 1 only
    "lm_head": ((96, 32), torch.bfloat16, {0: None}),   # whole, on rank 0 only
}
DERIVED = ("mlp", "fp8")
RETILED = dict(LAYOUT, embed=((96, 32), torch.bfloat16, {0: [((0, 0), (50, 32))], 1: [((50, 0), (46, 32))]}))


def _first(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: (fresh_tensor if n in DERIVED else random_bits)(shape, dt, gen) for n, (shape, dt, _) in LAYOUT.items()}


def _next(prev: dict[str, torch.Tensor], seed: int, density: float, keep_rows: dict | None = None) -> dict:
    """Random sparse changes (fresh values at random positions); ``keep_rows``: tensor -> rows left as they were."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in prev.items():
        new = t.clone()
        pos = torch.randperm(t.numel(), generator=gen)[: max(1, int(t.numel() * density))]
        src = (fresh_tensor if n in DERIVED else random_bits)(tuple(t.shape), t.dtype, gen)
        _ints(new)[pos] = _ints(src)[pos]
        if keep_rows and n in keep_rows:
            new[keep_rows[n]] = t[keep_rows[n]]
        out[n] = new
    return out


def _ints(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as integers of its item size, flat (a view: float8 has no indexed writes)."""
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _cut(full: torch.Tensor, off, ext) -> torch.Tensor:
    for d, (o, e) in enumerate(zip(off, ext)):
        full = full.narrow(d, o, e)
    return full.clone()


def _shares(full: dict[str, torch.Tensor], layout=LAYOUT) -> dict[int, dict]:
    """Each rank's named tensors: its pieces as TensorShard boxes, the tensors it holds whole as they are."""
    out: dict[int, dict] = {r: {} for r in range(WORLD)}
    for n, (shape, _, owners) in layout.items():
        for r, boxes in owners.items():
            if boxes is None:
                out[r][n] = full[n].clone()
                continue
            ((off, ext),) = boxes
            out[r][n] = TensorShard(_cut(full[n], off, ext), shape, off)
    return out


def _register(world, name, full, base=None, layout=LAYOUT):
    shares = _shares(full, layout)
    extra = {} if base is None else {"base": base}
    all_ok(world.all("register", per_rank={r: (name, {"named_tensors": shares[r], **extra}) for r in range(WORLD)}))
    all_ok(world.all("gather", name))


def _delta(world, front, name, mode=True, timeout=60):
    return world.all("call", ("support.delta_world", "delta_update", (name, front.address, timeout, None, mode)),
                     timeout=timeout + 60)


def _engines(front):
    return [front.digests(i) for i in range(WORLD)]


def _changed(a, b) -> float:
    from ckpt_core.delta.encode import changed_mask
    return sum(int(changed_mask(b[n], a[n]).sum()) for n in a) / sum(t.numel() for t in a.values())



def test_a_chain_of_deltas_of_pieces_leaves_every_engine_equal_to_the_full_tensors(world_and_front):
    world, front = world_and_front
    v = {"A": _first(seed=3901)}
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    assert all(d == want_digests(v["A"]) for d in _engines(front))

    # C leaves rank 0's half of embed as it was: that piece sends nothing
    v["B"] = _next(v["A"], seed=3902, density=0.03)
    v["C"] = _next(v["B"], seed=3903, density=0.01, keep_rows={"embed": slice(0, 48)})
    prev = "A"
    for name in ("B", "C"):
        assert 0 < _changed(v[prev], v[name]) < 0.05
        _register(world, name, v[name], base=prev)
        fanouts = front.fanouts
        got = all_ok(_delta(world, front, name))
        figs = {r: o.value["delta"] for r, o in got.items()}
        for r, fig in figs.items():
            assert fig["base"] == prev and fig["companion"] == f"{name}@delta", (name, r, fig)
            assert 0 < fig["payload_bytes"] < fig["full_bytes"], (name, r, fig)
        payload = sum(f["payload_bytes"] for f in figs.values())
        full = sum(t.numel() * t.element_size() for t in v[name].values())
        assert payload < full / 4, (name, payload, full)
        for i, digests in enumerate(_engines(front)):
            assert digests == want_digests(v[name]), f"engine worker {i} differs from {name} after its delta"
        for status, result in front.worker_outcomes(fanouts):
            assert status == "ok" and result["delta"] and (result["base"], result["version"]) == (prev, name), result
            assert result["scattered"] >= 1 and result["reloaded"] == len(DERIVED), result   # both paths ran
            assert result["payload_bytes"] == payload, result   # every worker received every piece's payload
        assert all(front.call(i, "held")[1] == name for i in range(WORLD))
        prev = name
    # rank 0's half of embed did not change in C: no payload of it (each rank's figures count its pieces)
    assert figs[0]["changed_tensors"] == figs[0]["tensors"] - 1, figs[0]


def test_pieces_tiled_unlike_the_base_or_a_base_missing_on_one_rank_are_refused_alike(world_and_front):
    world, front = world_and_front
    v = {"A": _first(seed=3911)}
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    v["B"] = _next(v["A"], seed=3912, density=0.02)

    # B's embed is split at row 50, A's at 48: each rank registers B (it is a whole version) without a delta;
    # the delta update is refused on every rank with the same message, before any engine is asked
    _register(world, "B", v["B"], base="A", layout=RETILED)
    fanouts = front.fanouts
    got = assert_every_rank_failed(_delta(world, front, "B"), "DeltaBaseError", "is not pieced as its base 'A'",
                                   "tensor 'embed' pieces", "on rank 0", "on rank 1")
    assert len({o.message for o in got.values()}) == 1, got
    assert front.fanouts == fanouts and all(d == want_digests(v["A"]) for d in _engines(front))
    assert all(front.call(i, "held")[1] == "A" for i in range(WORLD))
    # with fallback the same call sends B whole
    got = all_ok(_delta(world, front, "B", mode="fallback"))
    assert all("is not pieced as its base" in o.value["delta"]["fallback"] for o in got.values())
    assert all(d == want_digests(v["B"]) for d in _engines(front))

    # C's base B is missing on rank 1 (unregistered there): rank 1 cannot encode it, registers C whole; the
    # delta is refused on every rank alike, the engines keep B; the next full update of C works
    v["C"] = _next(v["B"], seed=3913, density=0.02)
    all_ok(world.all("unregister", ("B", {}), ranks=[1]))
    shares = _shares(v["C"], RETILED)
    got = world.all("register", per_rank={r: ("C", {"named_tensors": shares[r], "base": "B"}) for r in range(WORLD)})
    assert got[0].ok and got[1].error == "DeltaBaseError" and "not registered on rank 1" in got[1].message, got
    all_ok(world.all("register", ("C", {"named_tensors": shares[1]}), ranks=[1]))
    all_ok(world.all("gather", "C"))
    fanouts = front.fanouts
    got = assert_every_rank_failed(_delta(world, front, "C"), "DeltaBaseError",
                                   "not registered with a base on rank(s) [1]")
    assert len({o.message for o in got.values()}) == 1, got
    assert front.fanouts == fanouts and all(d == want_digests(v["B"]) for d in _engines(front))
    all_ok(world.update("C", front, behaviors={i: {"version": "C"} for i in range(WORLD)}))
    assert all(d == want_digests(v["C"]) for d in _engines(front))
    assert all(front.call(i, "held")[1] == "C" for i in range(WORLD))


def test_a_fold_of_pieced_deltas_brings_engines_that_hold_the_oldest_version_to_the_newest(world_and_front):
    """A is live, then unregistered; B and C are pieced deltas. ``fold_delta("C", base="A")`` folds B's and
    C's payloads piece by piece (``fold.py`` from the chain, A being gone), and one delta update brings the
    engines from A to C byte for byte."""
    world, front = world_and_front
    v = {"A": _first(seed=3921)}
    _register(world, "A", v["A"])
    all_ok(world.update("A", front, behaviors={i: {"version": "A"} for i in range(WORLD)}))
    v["B"] = _next(v["A"], seed=3922, density=0.02)
    v["C"] = _next(v["B"], seed=3923, density=0.02)
    _register(world, "B", v["B"], base="A")
    _register(world, "C", v["C"], base="B")
    all_ok(world.all("unregister", ("A", {})))
    folded = all_ok(world.all("call", ("support.delta_world", "fold_delta", ("C", "A"))))
    assert all(o.value["fold"] == "A -> B -> C" for o in folded.values()), folded
    got = all_ok(_delta(world, front, "C"))
    assert all(o.value["delta"]["companion"] == "C@delta:A" for o in got.values()), got
    assert all(d == want_digests(v["C"]) for d in _engines(front))
    assert all(front.call(i, "held")[1] == "C" for i in range(WORLD))


def test_p2p_deltas_of_pieces_read_only_the_payloads_and_leave_the_engine_bit_exact():
    """Owners 0 and 1 hold A, B, C in pieces; the engine beside rank 1 takes A whole over P2P, then B and C
    as P2P deltas: it reads each piece's payload from the rank that holds it."""
    pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed")
    from support.p2p_cases import OWNERS, SMALL

    v = {"A": _first(seed=3931)}
    v["B"] = _next(v["A"], seed=3932, density=0.02)
    v["C"] = _next(v["B"], seed=3933, density=0.01)
    with PsWorld("cpu", WORLD, init=SMALL, env=OWNERS) as world:
        front = EngineFront("cpu", 1, devices=[1], behavior={"derived": DERIVED}, engine_cls=DeltaEngine)
        try:
            prev = None
            for name in ("A", "B", "C"):
                _register(world, name, v[name], base=prev)
                per = {0: {"version": name}}
                got = all_ok(world.all("call", ("support.delta_world", "p2p_delta_update",
                                                (name, front.address, 60, [1], per, bool(prev))), timeout=150))
                assert front.digests(0) == want_digests(v[name]), f"the engine differs from {name}"
                if prev is not None:
                    fig = got[1].value["delta"]
                    assert fig["base"] == prev and 0 < got[1].value["read_bytes"] < fig["version_bytes"], fig
                    [(status, result)] = front.worker_outcomes(front.fanouts - 1)
                    assert status == "ok" and result["scattered"] >= 1 and result["reloaded"] == len(DERIVED), result
                prev = name
        finally:
            front.close()


@pytest.mark.parametrize("world, tp", [(2, 1), (4, 2)], ids=["fsdp2", "fsdp2-x-tp"])
def test_a_trainers_fsdp2_and_tp_dtensors_take_deltas_without_a_gather(world, tp):
    """Real FSDP2 (and FSDP2 x TP on a 2-D mesh: strided pieces, replicas kept once) on gloo, the PS inside
    each trainer process: each step's bf16 state dict is registered as it lies (DTensors, ``full_tensor`` and
    ``redistribute`` patched to raise) with the previous step as its base, and updated as a delta; every
    engine worker holds every full tensor bit-exact, from fewer payload bytes than the step's."""
    from support.shards_world import run_trainers

    front = EngineFront("cpu", world, engine_cls=DeltaEngine)
    try:
        res = run_trainers(world, front.address, tp=tp, steps=3, delta=True, timeout=360)
        for r in range(world):
            assert all(isinstance(x, dict) for x in res[r]), res[r]
        for step in (1, 2):
            figs = [res[r][step]["delta"] for r in range(world)]
            assert all(f["base"] == f"step-{step - 1}" and f["companion"] == f"step-{step}@delta" for f in figs), figs
            payload, full = sum(f["payload_bytes"] for f in figs), sum(f["full_bytes"] for f in figs)
            assert 0 < payload < full, (step, payload, full)
        final = res[0][2]["want"]
        for i in range(world):
            assert front.digests(i) == final, f"engine worker {i} differs from the trainer's full tensors"
            assert front.call(i, "held")[1] == "step-2"
        assert front.fanouts == 3
    finally:
        front.close()


def test_a_pieced_delta_over_the_stock_wire_is_refused_before_anything_moves():
    """The stock wire's workers (SGLang's loader) know whole-tensor payloads only: a delta of a version
    registered in pieces is refused there (``ConfigError``), asked before anything moves; the version
    itself still goes whole."""
    from support.ports import free_port

    from ckpt_core import ConfigError, ParameterServer
    from ckpt_core.delta.versions import accepts_deltas

    a = _first(seed=3941)
    b = _next(a, seed=3942, density=0.02)
    pieces = {n: TensorShard(t.clone(), tuple(t.shape), (0,) * t.dim()) for n, t in a.items()}
    with ParameterServer(rank=0, world_size=1, device="cpu", wire="stock", master_addr="127.0.0.1",
                         master_port=free_port()) as ps:
        ps.register_checkpoint("A", named_tensors=pieces)
        ps.register_checkpoint("B", base="A", named_tensors={
            n: TensorShard(t.clone(), tuple(t.shape), (0,) * t.dim()) for n, t in b.items()})
        ps.gather_metas("B")
        asked = []
        with pytest.raises(ConfigError, match="registered in pieces, moves on our wire only"):
            ps.update("B", accepts_deltas(lambda handles: asked.append(handles)), delta=True, timeout=30)
        assert asked == [] and ps.deltas.engines_hold is None
