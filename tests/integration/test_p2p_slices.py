"""Sliced P2P updates (``update(name, req, ranks=[...], slices=plan)``) over Mooncake's real TCP
transport on loopback: a 3-rank PS world whose every rank owns part of the checkpoint, two of
its ranks targets (the targets in rank order are engine ranks 0, 1, whatever the order of
``ranks``), real engine workers, each told its engine rank of the plan as a vLLM worker knows its
tensor-parallel rank. Each target's engine holds exactly its rows, its columns and the whole
tensors, bit for bit; a worker of another engine rank or plan refuses, and so does every rank;
rewritten owner memory is refused before any engine loads it; a bad plan moves nothing. A joining
world pulls its slices through metas saved with the plan's box digests."""

from __future__ import annotations

import json

import pytest
import torch

from support.asserts import assert_every_rank_failed, assert_healthy_workers_aborted
from support.data import digest, fresh_tensor
from support.engine import EngineFront, make_req_func
from support.world import PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed")

# name -> (shape, dtype, split dim or None: read whole by every engine rank); 3 owners
TENSORS = {
    "rows": ((96, 64), torch.float32, 0),           # a dim-0 slice: one run per target
    "cols": ((64, 96), torch.bfloat16, 1),          # a dim-1 slice: one run per row
    "experts": ((4, 32, 16), torch.float32, 1),     # a MoE-like dim-1 slice of a 3-d tensor
    "norm": ((96,), torch.float32, None),
    "embed": ((80, 48), torch.bfloat16, None),
    "last": ((8, 10), torch.float32, 0),
}
OWNED = {0: ("rows", "norm"), 1: ("cols", "embed"), 2: ("experts", "last")}
DTYPE = {torch.float32: ("F32", 4), torch.bfloat16: ("BF16", 2)}


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: fresh_tensor(shape, dtype, gen) for n, (shape, dtype, _) in TENSORS.items()}


def plan_doc(tp: int = 2, *, shapes: dict | None = None) -> dict:
    from ckpt_core.planning.slices import SliceKey, plan_to_json, split_plan
    specs = {n: (DTYPE[dt][0], tuple((shapes or {}).get(n, s)), DTYPE[dt][1]) for n, (s, dt, _) in TENSORS.items()}
    plan = split_plan(SliceKey("p2p-slices", f"tp={tp}", "test"), specs, tp, {n: d for n, (_, _, d) in TENSORS.items()})
    return plan_to_json(plan)


def want(seed: int, engine_rank: int, tp: int = 2) -> dict[str, str]:
    """The digests engine rank ``engine_rank`` must hold: its part of each split tensor, the others whole."""
    out = {}
    for n, t in tensors(seed).items():
        d = TENSORS[n][2]
        if d is not None:
            k = t.shape[d] // tp
            t = t.narrow(d, engine_rank * k, k).contiguous()
        out[n] = digest(t)
    return out


# ---------------------------------------------------------------- steps run inside the PS processes
def sliced_p2p(ps, rank, name, address, timeout, ranks, doc):
    """update(..., ranks=ranks, slices=plan) on every rank; the first of ``ranks`` posts the handles."""
    from ckpt_core.planning.slices import plan_from_json
    req = make_req_func(address) if rank == ranks[0] and address is not None else (lambda h: None)
    return ps.update(name, req, ranks=ranks, timeout=timeout, slices=None if doc is None else plan_from_json(doc))


def metas_doc(ps, rank):
    return ps.get_metas()


def save_sliced(ps, rank, path, doc):
    """save_metas(path, slices=plan) on every rank (a collective: each owner digests its boxes)."""
    from ckpt_core.planning.slices import plan_from_json
    ps.save_metas(path, slices=plan_from_json(doc))
    return ps.get_metas()


def call(world, fn, *args, timeout=120, module="test_p2p_slices"):
    return world.all("call", (module, fn, args), timeout=timeout)


def register(world: PsWorld, name: str, seed: int, size: int = 3) -> None:
    """Owner r % size of ``size`` ranks registers OWNED[r]."""
    t = tensors(seed)
    per_rank = {r: [] for r in range(size)}
    for r, names in OWNED.items():
        per_rank[r % size] += names
    world.all("register", per_rank={r: (name, {"named_tensors": {n: t[n] for n in names}})
                                    for r, names in per_rank.items()})
    world.all("gather", name)


def slice_pointer(doc: dict, name: str, tensor: str, engine_rank: int) -> tuple[str, int, int]:
    """(owner's store address, remote pointer, bytes) of engine rank ``engine_rank``'s rows of a
    dim-0 split tensor, from the owners' metas: where a foreign peer would aim."""
    for owner in doc["checkpoints"][name]["owners"]:
        for n, _, shape, nbytes, _, region, offset in owner["tensors"]:
            if n == tensor:
                half = nbytes // 2
                ptr = owner["p2p"]["regions"][str(region)][0] + offset + engine_rank * half
                return owner["p2p"]["address"], ptr, half
    raise KeyError(tensor)


@pytest.fixture
def world():
    with PsWorld("cpu", 3, init=SMALL, env=OWNERS) as w:
        yield w


def digest_of(doc: dict) -> str:
    from ckpt_core.planning.slices import plan_from_json
    return plan_from_json(doc).digest


def case_sliced(kind: str, world: PsWorld, size: int, ranks: list[int]) -> dict:
    """A sliced P2P update into ``ranks`` of a world of ``size``: each engine holds its slices and the
    whole tensors, bit for bit; the figures add up. Returns every rank's outcome."""
    register(world, "c", 7, size)
    targets = sorted(ranks)   # engine rank i is the i-th target in rank order, whatever the order of ranks
    # front worker i is PS rank targets[i]'s engine, of engine rank i (it refuses the slices of another)
    front = EngineFront(kind, len(ranks), devices=targets, slices=(digest_of(plan_doc()), [0, 1]))
    try:
        got = all_ok(call(world, "sliced_p2p", "c", front.address, 60, ranks, plan_doc()))
        for engine_rank, r in enumerate(targets):
            assert front.digests(engine_rank) == want(7, engine_rank), f"engine rank {engine_rank} (PS rank {r})"
        from ckpt_core.planning.slices import plan_from_json
        plan = plan_from_json(plan_doc())
        total = sum(t.numel() * t.element_size() for t in tensors(7).values())
        for r in ranks:
            s = got[r].value["slices"]
            assert s["targets"] == targets and s["plan"] == plan.digest
            assert s["received_bytes"] == [plan.rank_bytes(0), plan.rank_bytes(1)]
            assert s["whole_bytes"] == total
            assert [got[t].value["read_bytes"] for t in targets] == s["read_bytes"], "planned != read"
            # each byte of the checkpoint crosses the network once (each slice to its target, whole tensors to one
            # reader), plus the holes between the rows of column slices that are read with them (p2p/slices.py)
            assert total <= sum(s["read_bytes"]) < 1.5 * total, s
            assert got[r].value["buckets"] >= 3
    finally:
        front.close()
    return got


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("ranks", [[1, 2], [2, 1]])
def test_each_target_receives_exactly_its_slices_and_the_whole_tensors_and_reads_what_was_planned(world, ranks):
    """ranks [2, 1] is the update [1, 2]: PS rank 1 is engine rank 0 either way (before, [2, 1] sent engine
    rank 0's slices to PS rank 2's worker). Rank 0 (an owner, not a target) touches no engine."""
    got = case_sliced("cpu", world, 3, ranks)
    assert got[0].value["target"] is False
    assert world.all("ipc_buffer", ranks=[0])[0].value is None, "a non-target allocated a buffer"


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [[0, 1], [1, 0]])
def test_on_cuda_each_target_reads_its_slices_into_its_ipc_buffer_bit_exact(ranks):
    """The same on 2 GPUs: Mooncake reads into CUDA IPC buffers, the gathers run on the device."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    with PsWorld("cuda", 2, init=SMALL, env=OWNERS) as w:
        case_sliced("cuda", w, 2, ranks)


def test_a_rewritten_slice_is_refused_by_its_target_and_rewritten_tensors_are_never_digested(world):
    """Bytes inside engine rank 1's rows rewritten after the owners digested the plan's boxes: that
    target refuses its bucket; rewritten before: the owner's check against the registration digest
    refuses. Both fail every rank before any engine loads; the next sliced update is bit-exact."""
    from support.exposure_cases import ForeignPeer
    for name, seed in (("a", 11), ("b", 12), ("c", 13), ("d", 14)):
        register(world, name, seed)
    doc = all_ok(call(world, "metas_doc"))[0].value
    front = EngineFront("cpu", 2, devices=[1, 2], slices=(digest_of(plan_doc()), [0, 1]))
    foreign = ForeignPeer()
    try:
        for name in ("a", "b"):   # a's box digests are taken (and cached) on its owners; engines hold b
            all_ok(call(world, "sliced_p2p", name, front.address, 60, [1, 2], plan_doc()))
        addr, ptr, n = slice_pointer(doc, "a", "rows", 1)
        assert foreign.write(addr, ptr + 64, 16) == 0   # inside engine rank 1's rows, on owner rank 0
        fanouts = front.fanouts
        got = call(world, "sliced_p2p", "a", front.address, 60, [1, 2], plan_doc())
        assert_every_rank_failed(got, "TransportError", "rank 2:", "the slice of tensor 'rows' does not match")
        for i in range(2):
            assert front.digests(i) == want(12, i), "an engine loaded bytes of the tampered checkpoint"

        addr, ptr, n = slice_pointer(doc, "c", "rows", 1)
        assert foreign.write(addr, ptr + 64, 16) == 0   # before any sliced update of c
        got = call(world, "sliced_p2p", "c", front.address, 60, [1, 2], plan_doc())
        assert_every_rank_failed(got, "TransportError", "owner rank 0", "tensor 'rows' no longer matches")
        assert front.fanouts == fanouts + 1, "the owner check's refusal came after the engines were asked"
        for i in range(2):
            assert front.digests(i) == want(12, i)

        all_ok(call(world, "sliced_p2p", "d", front.address, 60, [1, 2], plan_doc()))
        for i in range(2):
            assert front.digests(i) == want(14, i), "the sliced update after the failed ones is bit-exact"
    finally:
        foreign.close()
        front.close()


def test_a_worker_of_another_engine_rank_or_plan_refuses_the_slices_on_every_rank_and_keeps_its_weights(world):
    """The hello of a sliced update names the plan and the engine rank the PS routed to that worker. Workers
    whose engine ranks are the other way round (an engine whose rank 0 sits beside PS rank 2), a worker
    told another plan, and workers loading whole tensors each refuse it before loading anything (a
    ConfigError naming both sides), every rank raises, the engines keep their weights; so does a whole
    update into workers that expect slices. Then the right update is bit-exact. Before the fix the
    swapped engines loaded each other's rows and every rank reported success."""
    register(world, "c", 41)
    register(world, "d", 42)
    plan = digest_of(plan_doc())
    front = EngineFront("cpu", 2, devices=[1, 2], slices=(plan, [0, 1]))
    try:
        all_ok(call(world, "sliced_p2p", "c", front.address, 60, [1, 2], plan_doc()))
        before = {i: want(41, i) for i in range(2)}
        # both workers refuse [1, 0]: a rank raises whichever refusal reaches it first
        refusals = [((plan, [1, 0]), "sliced", (0, 1), "but its parameter-server rank sends the slices of engine rank"),
                    ((plan, [0, 0]), "sliced", (1,), "the slices of engine rank 1"),
                    (("0" * 40, [0, 1]), "sliced", (0, 1), "routes the update by slice plan " + plan[:12]),
                    (None, "sliced", (0, 1), "told of no slice plan"),
                    ((plan, [0, 1]), "whole", (0, 1), "the parameter server sends whole tensors")]
        for told, how, failing, needle in refusals:
            front.expect_slices(told)
            since = front.fanouts
            got = (call(world, "sliced_p2p", "d", front.address, 60, [2, 1], plan_doc()) if how == "sliced" else
                   call(world, "p2p_update", "d", front.address, 60, [1, 2], module="support.p2p_cases"))
            assert_every_rank_failed(got, "RemoteWorkerError", "ConfigError", needle)
            # the refusing workers raised ConfigError, the others RemoteWorkerError (aborted); none loaded
            assert_healthy_workers_aborted(front, since, before, failing=failing)
            # each refusing worker refused, unless its PS rank gave the update up (another worker's refusal
            # reached it first) before sending its hello: then it was aborted before its hello, or (the PS's
            # connection closed before its abort arrived) told the PS closed the connection; untouched either way
            texts = [str(front.worker_outcomes(since)[i][1]) for i in failing]
            assert any("ConfigError" in t for t in texts), front.last_results
            assert all("ConfigError" in t or "aborted by the parameter server before its hello" in t
                       or "closed the connection (waiting for hello/abort)" in t for t in texts), front.last_results
        front.expect_slices((plan, [0, 1]))
        all_ok(call(world, "sliced_p2p", "d", front.address, 60, [2, 1], plan_doc()))
        for i in range(2):
            assert front.digests(i) == want(42, i), "the sliced update after the refused ones is bit-exact"
    finally:
        front.close()


def test_a_plan_for_other_targets_or_another_checkpoint_is_a_config_error_on_every_rank_before_a_byte_moves(world):
    register(world, "c", 21)
    front = EngineFront("cpu", 2, devices=[1, 2], slices=(digest_of(plan_doc()), [0, 1]))
    try:
        got = call(world, "sliced_p2p", "c", front.address, 60, [2], plan_doc(2))
        assert_every_rank_failed(got, "ConfigError", "2 engine ranks but the P2P update has 1 target(s)")
        got = call(world, "sliced_p2p", "c", front.address, 60, [1, 2], plan_doc(2, shapes={"norm": (48,)}))
        assert_every_rank_failed(got, "ConfigError", "recorded for another checkpoint", "'norm'")
        assert front.fanouts == 0, "no engine was asked to load anything"
        all_ok(call(world, "sliced_p2p", "c", front.address, 60, [1, 2], plan_doc()))
        for i in range(2):
            assert front.digests(i) == want(21, i), "the sliced update after the refused ones is bit-exact"
    finally:
        front.close()


def test_a_joining_world_pulls_its_slices_through_metas_saved_with_the_plan_and_checks_each_against_them(
        world, tmp_path):
    """Owners save their metas with the plan's box digests; a separate world of 2 ranks that owns
    nothing loads the file and each target (ranks [1, 0]: PS rank 0 is engine rank 0) pulls exactly
    its rows, columns and whole tensors, bit for bit. Bytes rewritten in an owner's memory inside
    engine rank 1's rows after saving are refused by that target, the engines keep their weights.
    Metas saved without the plan refuse a sliced update on every rank before a byte moves, naming
    the fix, and still serve an unsliced one."""
    from support.exposure_cases import ForeignPeer
    from ckpt_core.planning.slices import plan_from_json
    for name, seed in (("a", 31), ("b", 32), ("c", 33)):
        register(world, name, seed)
    plain, sliced = str(tmp_path / "plain.json"), str(tmp_path / "sliced.json")
    doc = all_ok(world.all("call", ("support.p2p_cases", "save_metas", (plain,)), ranks=[0]))[0].value
    foreign = ForeignPeer()
    try:   # c's rows rewritten before the owners digest the boxes: the owner's check refuses, nothing is saved
        addr, ptr, n = slice_pointer(doc, "c", "rows", 1)
        assert foreign.write(addr, ptr + 64, 16) == 0
        got = call(world, "save_sliced", sliced, plan_doc())
        assert_every_rank_failed(got, "TransportError", "owner rank 0", "tensor 'rows' no longer matches")
        assert not (tmp_path / "sliced.json").exists()
        all_ok(world.all("unregister", ("c", {})))
        doc = all_ok(call(world, "save_sliced", sliced, plan_doc()))[0].value
    finally:
        foreign.close()
    assert sorted(doc["checkpoints"]) == ["a", "b"]
    digest_ = plan_from_json(plan_doc()).digest
    assert doc["version"] == 2 and json.load(open(plain))["version"] == 1
    for name in ("a", "b"):
        owners = doc["checkpoints"][name]["owners"]
        assert [sorted(o["p2p"]["slices"][digest_]) for o in owners] == [["rows"], ["cols"], ["experts", "last"]]
    ranks = [1, 0]
    with PsWorld("cpu", 2, init=SMALL, env=JOINERS) as joiners:
        all_ok(joiners.all("call", ("support.p2p_cases", "load_metas", (sliced,))))
        front = EngineFront("cpu", 2, devices=[0, 1], slices=(digest_, [0, 1]))
        foreign = ForeignPeer()
        try:
            got = all_ok(call(joiners, "sliced_p2p", "a", front.address, 60, ranks, plan_doc()))
            for r in range(2):
                assert front.digests(r) == want(31, r), f"engine rank {r} (PS rank {r})"
            plan = plan_from_json(plan_doc())
            s = got[0].value["slices"]
            assert s["targets"] == [0, 1] and s["received_bytes"] == [plan.rank_bytes(0), plan.rank_bytes(1)]
            assert [got[t].value["read_bytes"] for t in (0, 1)] == s["read_bytes"], "planned != read"
            assert sum(s["read_bytes"]) >= s["whole_bytes"]

            addr, ptr, n = slice_pointer(doc, "b", "rows", 1)
            assert foreign.write(addr, ptr + 64, 16) == 0   # inside engine rank 1's rows, on owner rank 0, after saving
            got = call(joiners, "sliced_p2p", "b", front.address, 60, ranks, plan_doc())
            assert_every_rank_failed(got, "TransportError", "rank 1:", "the slice of tensor 'rows' does not match")
            for r in range(2):
                assert front.digests(r) == want(31, r), "an engine loaded bytes of the tampered checkpoint"

            all_ok(joiners.all("call", ("support.p2p_cases", "load_metas", (plain,))))
            fanouts = front.fanouts
            got = call(joiners, "sliced_p2p", "a", front.address, 60, ranks, plan_doc())
            assert_every_rank_failed(got, "ConfigError", "owner rank 0 published none for slice plan",
                                     "save_metas(path, slices=plan)")
            assert front.fanouts == fanouts, "an engine was asked to load after the refusal"
            front.expect_slices(None)   # the engines load whole tensors from now on
            all_ok(call(joiners, "p2p_update", "a", front.address, 60, [0, 1], module="support.p2p_cases"))
            whole = {n: digest(t) for n, t in tensors(31).items()}
            assert front.digests(0) == whole and front.digests(1) == whole, "the unsliced join is bit-exact"
        finally:
            foreign.close()
            front.close()
