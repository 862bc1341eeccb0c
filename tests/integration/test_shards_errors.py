"""TensorShard pieces from several ranks, mixed with whole tensors and files; bad tilings, Partial
placements and dtype disagreements get typed errors on every rank, and nothing stays half-done."""

import torch

from ckpt_core import TensorShard
from ckpt_core.checkpoint.safetensors import write_file
from support.data import digest, fresh_tensor
from support.engine import EngineFront
from support.world import PsWorld

WORLD = 3


def _boxes(full: torch.Tensor, boxes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> dict:
    """rank -> [TensorShard] cut from ``full``: each box is (offsets, extent)."""
    out = {}
    for r, bs in boxes.items():
        out[r] = []
        for off, ext in bs:
            view = full
            for d, (o, e) in enumerate(zip(off, ext)):
                view = view.narrow(d, o, e)
            out[r].append(TensorShard(view.clone(), tuple(full.shape), off))
    return out


def _spec(tmp_path, gen, layout: dict[str, tuple[torch.Tensor, dict]], whole: dict[int, dict] | None = None):
    """register kwargs per rank: each rank's pieces of every tensor of ``layout`` (one box each) plus
    its whole tensors; rank 1 also registers a safetensors file."""
    spec = {r: {"named_tensors": dict((whole or {}).get(r, {}))} for r in range(WORLD)}
    for name, (full, boxes) in layout.items():
        for r, shards in _boxes(full, boxes).items():
            (shard,) = shards
            spec[r]["named_tensors"][name] = shard
    f = tmp_path / "rank1.safetensors"
    if not f.exists():
        write_file(str(f), {"file.t": fresh_tensor((5, 3), torch.float16, gen)})
    spec[1]["files"] = [str(f)]
    return spec


def test_pieces_from_three_ranks_mixed_with_whole_tensors_and_a_file_arrive_whole(tmp_path):
    gen = torch.Generator().manual_seed(23)
    w = fresh_tensor((10, 6), torch.float32, gen)           # rows, then two column boxes (strided)
    v = fresh_tensor((7,), torch.bfloat16, gen)
    e = fresh_tensor((4, 3, 5), torch.float8_e4m3fn, gen)   # a 3-D box split in the middle dimension
    layout = {
        "w": (w, {0: [((0, 0), (4, 6))], 1: [((4, 0), (6, 3))], 2: [((4, 3), (6, 3))]}),
        "v": (v, {0: [((0,), (3,))], 2: [((3,), (4,))]}),
        "e": (e, {0: [((0, 0, 0), (4, 1, 5))], 1: [((0, 1, 0), (4, 2, 5))]}),
    }
    whole = {0: {"lm_head.weight": fresh_tensor((3, 4), torch.bfloat16, gen)}}
    spec = _spec(tmp_path, gen, layout, whole)
    want = {n: digest(full) for n, (full, _) in layout.items()}
    want["lm_head.weight"] = digest(whole[0]["lm_head.weight"])
    from ckpt_core.checkpoint.safetensors import read_header  # noqa: F401  (the file's tensor, read back below)
    front = EngineFront("cpu", WORLD)
    try:
        with PsWorld("cpu", WORLD) as world:
            for step in range(2):   # the second step reuses the plan
                assert all(o.ok for o in world.all("register", None, per_rank={
                    r: (f"s{step}", spec[r]) for r in range(WORLD)}).values())
                assert all(o.ok for o in world.all("gather", f"s{step}").values())
                res = world.update(f"s{step}", front)
                assert all(o.ok for o in res.values()), res
            for i in range(WORLD):
                got = front.digests(i)
                assert {n: got[n] for n in want} == want, f"worker {i}"
                assert "file.t" in got
            assert res[0].value["bytes"] == sum(t.numel() * t.element_size() for t in (w, v, e)) + 3 * 4 * 2 + 5 * 3 * 2
    finally:
        front.close()


def _gather_fails(world, name: str, spec) -> dict:
    assert all(o.ok for o in world.all("register", None, per_rank={r: (name, spec[r]) for r in range(WORLD)}).values())
    got = world.all("gather", name)
    assert all(not o.ok for o in got.values()), got
    return got


def test_bad_tilings_and_dtype_or_shape_disagreements_fail_gather_on_every_rank_naming_tensor_and_ranks(tmp_path):
    gen = torch.Generator().manual_seed(7)
    w = fresh_tensor((10, 6), torch.float32, gen)
    cases = {
        "overlap": ({"w": (w, {0: [((0, 0), (5, 6))], 1: [((4, 0), (6, 6))]})}, ["overlap", "rank 0", "rank 1"]),
        "gap": ({"w": (w, {0: [((0, 0), (4, 6))], 2: [((5, 0), (5, 6))]})}, ["cover 54 of its 60 elements", "[0, 2]"]),
    }
    front = EngineFront("cpu", WORLD)
    try:
        with PsWorld("cpu", WORLD) as world:
            for case, (layout, needles) in cases.items():
                got = _gather_fails(world, case, _spec(tmp_path, gen, layout))
                for o in got.values():
                    assert o.error == "CheckpointFormatError", o
                    for n in needles + ["'w'"]:
                        assert n in o.message, (case, o.message)
                # nothing installed: an update is refused alike on every rank, before anything moves
                upd = world.update(case, front)
                assert all(o.error == "ConfigError" and "gather_metas" in o.message for o in upd.values()), upd
                assert all(o.ok for o in world.all("unregister", (case, {})).values())
            # dtype and global-shape disagreements
            half = {0: TensorShard(w[:5].clone(), (10, 6), (0, 0)), 1: TensorShard(w[5:].half(), (10, 6), (5, 0))}
            wrong = {0: TensorShard(w[:5].clone(), (10, 6), (0, 0)), 1: TensorShard(w[5:].clone(), (11, 6), (5, 0))}
            for case, pieces, needle in (("dtype", half, "dtype: F32 on rank 0, F16 on rank 1"),
                                         ("shape", wrong, "global shape: [10, 6] on rank 0, [11, 6] on rank 1")):
                spec = {r: {"named_tensors": {"w": pieces[r]} if r in pieces else {}} for r in range(WORLD)}
                got = _gather_fails(world, case, spec)
                assert all(o.error == "CheckpointFormatError" and needle in o.message and "'w'" in o.message
                           for o in got.values()), got
                assert all(o.ok for o in world.all("unregister", (case, {})).values())
            # a whole tensor on one rank and pieces of the same name on another
            spec = {0: {"named_tensors": {"w": w}}, 1: {"named_tensors": {"w": TensorShard(w[:5].clone(), (10, 6), (0, 0))}},
                    2: {"named_tensors": {}}}
            got = _gather_fails(world, "mixed", spec)
            assert all(o.error == "CheckpointFormatError" and "whole on rank 0 and in pieces on rank(s) [1]" in o.message
                       for o in got.values()), got
            assert all(o.ok for o in world.all("unregister", ("mixed", {})).values())
            # after all that the world works: a good tiling updates every engine
            good = {"w": (w, {0: [((0, 0), (4, 6))], 1: [((4, 0), (6, 3))], 2: [((4, 3), (6, 3))]})}
            spec = _spec(tmp_path, gen, good)
            assert all(o.ok for o in world.all("register", None, per_rank={r: ("ok", spec[r]) for r in range(WORLD)}).values())
            assert all(o.ok for o in world.all("gather", "ok").values())
            assert all(o.ok for o in world.update("ok", front).values())
            assert all(front.digests(i)["w"] == digest(w) for i in range(WORLD))
    finally:
        front.close()


def test_a_partial_dtensor_is_a_config_error_that_says_to_reduce_and_registers_nothing():
    with PsWorld("cpu", 2) as world:
        got = world.all("call", ("support.shards_world", "register_dtensor", ("p", "partial")))
        for r, o in got.items():
            assert o.ok and not o.value["ok"], o
            assert o.value["error"] == "ConfigError" and "Partial" in o.value["message"]
            assert "reduce first" in o.value["message"] and o.value["checkpoints"] == []
        # a Replicate DTensor is kept by one rank only: stored and sent once
        got = world.all("call", ("support.shards_world", "register_dtensor", ("r", "replicate")))
        assert got[0].value["ok"] and got[1].value["ok"]
        assert got[0].value["bytes"] == 3 * 4 * 4 + 2 * 4 and got[1].value["bytes"] == 0
        assert all(o.ok for o in world.all("gather", "r").values())
