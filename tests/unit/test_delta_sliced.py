"""Sliced deltas on the PS (``delta/sliced.py``): each box's payload, cut from the whole tensor's delta,
is exactly the payload of the box's own delta (``encode_tensor(new box, old box)``), byte for byte, for
boxes on every dim, whole-tensor boxes and every wire dtype; a box without a change sends nothing; the
payloads of a registered version are built from its delta companion alone, and routed to the engine
ranks whose boxes they are."""

import numpy as np
import pytest
import torch

from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta.encode import decode, encode_tensor
from ckpt_core.delta.sliced import (
    box_name,
    box_positions,
    build_box_payloads,
    encode_box,
    parse_box_name,
    region_of,
    routes_of,
)
from ckpt_core.delta.versions import DeltaVersions
from ckpt_core.devices import get_backend
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.slices import RankSlices, SliceKey, SlicePlan, Write

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.float8_e4m3fn]


def _pair(shape, dtype, density, seed):
    """(old, new) of ``shape``: ``new`` differs from ``old`` in about ``density`` of the elements (bits)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    old = raw.view(dtype).reshape(shape)
    flip = torch.rand(old.numel(), generator=g) < density
    new_raw = raw.clone()
    size = old.element_size()
    new_raw.view(-1, size)[flip, 0] ^= 1   # the lowest byte's lowest bit: one ulp, the bytes differ
    return old, new_raw.view(dtype).reshape(shape)


def _boxes(shape):
    """A box on each dim (an inner and a border slice), two dims at once, the whole tensor."""
    out = [None]
    for d, n in enumerate(shape):
        if n >= 2:
            out += [((d, 1, n - 2 if n > 2 else 1),), ((d, n // 2, n - n // 2),)]
    if len(shape) >= 2 and shape[0] >= 2 and shape[-1] >= 2:
        out.append(((0, 0, shape[0] // 2), (len(shape) - 1, 1, shape[-1] - 1)))
    return out


def _whole_positions(old, new):
    payload, _ = encode_tensor(new, old)
    if payload is None:
        return np.empty(0, dtype=np.int64)
    d = decode(payload)
    return None if d.positions is None else d.positions.numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, density", [((37, 29), 0.03), ((6, 9, 11), 0.2), ((301,), 0.6), ((64, 48), 0.001)])
def test_each_box_payload_is_the_payload_of_the_boxs_own_delta(dtype, shape, density):
    old, new = _pair(shape, dtype, density, seed=hash((shape, density)) % 1000)
    positions = _whole_positions(old, new)
    for box in _boxes(shape):
        got, info = encode_box(new, positions, box)
        want, want_info = encode_tensor(region_of(new, box).contiguous(), region_of(old, box).contiguous())
        assert (got is None) == (want is None), box
        if got is not None:
            assert torch.equal(got, want), (box, info, want_info)
            assert info == want_info


def test_a_box_without_a_changed_element_sends_nothing():
    old = torch.randn(10, 8).to(torch.bfloat16)
    new = old.clone()
    new[7, 3] += 1
    positions = _whole_positions(old, new)
    assert encode_box(new, positions, ((0, 0, 5),))[0] is None            # the change lies in the other half
    assert encode_box(new, positions, ((1, 4, 4),))[0] is None            # its column is outside
    got, info = encode_box(new, positions, ((0, 5, 5), (1, 2, 3)))
    d = decode(got)
    assert info["count"] == 1 and d.positions.tolist() == [(7 - 5) * 3 + (3 - 2)] and d.shape == (5, 3)


def test_a_whole_payload_cuts_into_whole_boxes():
    """A tensor new to the version (or whose delta went whole) has no positions: each box goes whole."""
    new = torch.randn(12, 5, dtype=torch.float32)
    box = ((0, 4, 4),)
    got, info = encode_box(new, None, box)
    assert info["encoding"] == "whole" and torch.equal(got, encode_tensor(new[4:8].contiguous(), None)[0])


def test_positions_are_renumbered_in_the_boxs_row_major_coordinates():
    shape = (4, 5, 6)
    every = np.arange(120, dtype=np.int64)
    box = ((1, 1, 3), (2, 2, 2))
    got = box_positions(every, shape, box)
    grid = np.arange(120).reshape(shape)[:, 1:4, 2:4]
    assert got.tolist() == list(range(grid.size))           # every element of the box, in its own order
    sparse = np.array([0, 8, 9, 14, 15, 40, 119], dtype=np.int64)   # (0,1,2) (0,1,3) (0,2,2) (0,2,3) (1,1,4) ...
    assert box_positions(sparse, shape, box).tolist() == [0, 1, 2, 3]


def test_box_names_round_trip_and_a_malformed_one_is_refused():
    for box in (None, ((0, 2, 3),), ((0, 0, 1), (2, 5, 7))):
        assert parse_box_name(box_name("model.layers.0.q_proj.weight", box)) == ("model.layers.0.q_proj.weight", box)
    assert parse_box_name(box_name("w", ())) == ("w", None)
    assert parse_box_name("ckpt.delta:w") is None
    with pytest.raises(CheckpointFormatError):
        parse_box_name('ckpt.delta.box:["w", [[0, 1]]]')


def _plan():
    """Two engine ranks: rows of ``a``, columns of ``b``, ``n`` whole on both, ``e`` whole on rank 1 only."""
    ranks = []
    for r in range(2):
        needs = {"a": ((0, 4 * r, 4),), "b": ((1, 3 * r, 3),), "n": None, **({"e": None} if r else {})}
        ranks.append(RankSlices(r, needs, {"pa": (4, 6), "pb": (5, 3), "pn": (7,), **({"pe": (3, 3)} if r else {})},
                                tuple(Write(f"p{x}", (), x) for x in needs)))
    return SlicePlan(SliceKey("m", "tp=2", "test"), {"a": ("BF16", (8, 6), 2), "b": ("BF16", (5, 6), 2),
                                                     "n": ("F32", (7,), 4), "e": ("BF16", (3, 3), 2)}, tuple(ranks))


def test_a_registered_versions_box_payloads_come_from_its_delta_and_route_to_their_engine_ranks():
    cpu = get_backend("cpu")
    g = torch.Generator().manual_seed(5)
    a = {"a": torch.randn(8, 6, generator=g).bfloat16(), "b": torch.randn(5, 6, generator=g).bfloat16(),
         "n": torch.ones(7), "e": torch.randn(3, 3, generator=g).bfloat16()}
    b = {k: v.clone() for k, v in a.items()}
    b["a"][1, 2] += 0.5          # in rank 0's rows only
    b["b"][:, 4] += 1.0          # in rank 1's columns only
    b["e"][0, 0] += 1.0          # read whole by rank 1 only; n unchanged
    A = build_checkpoint("A", cpu, named_tensors=a)
    B = build_checkpoint("B", cpu, named_tensors=b)
    comp = build_checkpoint("B@delta", cpu, named_tensors=DeltaVersions(0, 1).encode("B", B, "A", A))
    try:
        plan = _plan()
        out, fig = build_box_payloads(B, comp, plan)
        want = {box_name("a", ((0, 0, 4),)), box_name("b", ((1, 3, 3),)), box_name("e", None)}
        assert {n for n in out if n.startswith("ckpt.delta.box:")} == want
        assert fig["changed_boxes"] == 3 and fig["boxes"] == 6   # a, b: 2 each; n and e: 1
        for name in want:
            t, box = parse_box_name(name)
            expect = encode_tensor(region_of(b[t], box).contiguous(), region_of(a[t], box).contiguous())[0]
            assert torch.equal(out[name], expect)
        manifests = [n for n in out if n.startswith("ckpt.delta.manifest:")]
        assert len(manifests) == 1
        companion = build_checkpoint("B@delta[x]", cpu, named_tensors=out)
        try:
            routes = routes_of(plan, [companion.metas])
            assert routes.route_digest == plan.digest != routes.digest
            assert set(routes.ranks[0].needs) == {box_name("a", ((0, 0, 4),)), *manifests}
            assert set(routes.ranks[1].needs) == {box_name("b", ((1, 3, 3),)), box_name("e", None), *manifests}
        finally:
            companion.release()
        other = SlicePlan(plan.key, dict(plan.tensors, a=("BF16", (8, 7), 2)), plan.ranks)
        with pytest.raises(ConfigError, match="'a' is BF16.8, 6. in the version, BF16.8, 7. in the slice plan"):
            build_box_payloads(B, comp, other)
    finally:
        for c in (A, B, comp):
            c.release()


def _box_bucket(old, new, boxes, b="A", v="B"):
    """A sliced delta's bucket: the manifest and each box payload, as the worker receives them."""
    from ckpt_core.delta.versions import manifest_name
    out = [(manifest_name(b, v, 0, 1), torch.zeros(1, dtype=torch.uint8))]
    for name, box in boxes:
        positions = _whole_positions(old[name], new[name])
        payload, _ = encode_box(new[name], positions, box)
        if payload is not None:
            out.append((box_name(name, box), payload))
    return out


def _drive(rx, weights, *, fail=False):
    with rx.update(run=lambda ws: None, version=None) as cb:
        cb.on_plan([(n, t.dtype, tuple(t.shape)) for n, t in weights])
        cb.run(weights)
        if fail:
            raise RuntimeError("another rank failed")
        cb.post_hook()


def _fused(base):
    """An engine rank's parameters: ``gu`` [6, 6] holds rows 4..8 of ``a`` transposed in its first 4
    columns (a strided region); rows 0..4 of ``r`` are ``rows`` (contiguous); ``w`` is held widened to float32, whole."""
    return {"gu": torch.cat([base["a"][4:8].T, torch.zeros(6, 2, dtype=torch.bfloat16)], dim=1),
            "rows": base["r"][0:4].clone(), "w": base["w"].float()}


def test_a_worker_applies_box_deltas_into_contiguous_strided_and_widened_regions_and_undoes_them():
    from ckpt_core.delta.apply import DeltaReceiver
    g = torch.Generator().manual_seed(11)
    base = {"a": torch.randn(8, 6, generator=g).bfloat16(), "r": torch.randn(8, 5, generator=g).bfloat16(),
            "w": torch.randn(9, generator=g).bfloat16()}
    new = {n: t.clone() for n, t in base.items()}
    for n, t in new.items():
        flat = t.view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[: flat.numel() // 3]] += 1
    live = _fused(base)
    gu_block = live["gu"][:, :4]   # a's rows 4..8 as columns 0..4 of gu (transposed): view of [6, 4]

    def live_box(name, box):
        if (name, box) == ("a", ((0, 4, 4),)):
            return gu_block.T   # [4, 6], strided
        if (name, box) == ("r", ((0, 0, 4),)):
            return live["rows"]
        if (name, box) == ("w", None):
            return live["w"]
        raise CheckpointFormatError("not a box of this rank", tensor=name)

    boxes = [("a", ((0, 4, 4),)), ("r", ((0, 0, 4),)), ("w", None)]
    weights = _box_bucket(base, new, boxes)
    before = {n: t.clone() for n, t in live.items()}
    rx = DeltaReceiver(live=lambda n: None, live_box=live_box, held="A")
    with pytest.raises(RuntimeError, match="another rank failed"):
        _drive(rx, weights, fail=True)   # every write undone, the strided region's included
    assert all(torch.equal(live[n], before[n]) for n in live)
    rx.held = "A"
    _drive(rx, weights)
    assert torch.equal(gu_block.T, new["a"][4:8]) and torch.equal(live["rows"], new["r"][0:4])
    assert torch.equal(live["w"], new["w"].float()) and rx.held == "B"
    assert not gu_block.T.is_contiguous() and torch.equal(live["gu"][:, 4:], before["gu"][:, 4:])   # the rest untouched


def test_a_box_without_a_live_region_or_kept_copy_or_of_another_shape_is_refused():
    from ckpt_core.delta.apply import DeltaReceiver
    g = torch.Generator().manual_seed(12)
    base = {"r": torch.randn(8, 5, generator=g).bfloat16()}
    new = {"r": base["r"].clone()}
    new["r"][6, 2] += 1
    weights = _box_bucket(base, new, [("r", ((0, 4, 4),))])
    for live_box, needle in ((None, "kept no copy"), (lambda n, b: None, "kept no copy"),
                             (lambda n, b: torch.zeros(4, 5, dtype=torch.bfloat16)[:, :4], "the live tensor is")):
        rx = DeltaReceiver(live=lambda n: None, live_box=live_box, held="A")
        with pytest.raises(CheckpointFormatError, match=needle):
            _drive(rx, weights)
        assert rx.held == "A"


def test_a_box_without_a_live_region_is_rebuilt_from_its_kept_copy_and_reloaded():
    """An engine that derives its weights (no live region holds the box verbatim) keeps the box it loaded;
    the delta rebuilds it, checks the box's digest and hands it to the reload under the tensor's name."""
    from ckpt_core.delta.apply import DeltaReceiver
    g = torch.Generator().manual_seed(13)
    base = {"r": torch.randn(8, 5, generator=g).bfloat16()}
    new = {"r": base["r"].clone()}
    new["r"][5, 1] += 1
    reloaded = []
    rx = DeltaReceiver(live=lambda n: None, reload=reloaded.extend, held="A")
    rx.keep("r", base["r"][4:8])
    _drive(rx, _box_bucket(base, new, [("r", ((0, 4, 4),))]))
    assert [n for n, _ in reloaded] == ["r"] and torch.equal(reloaded[0][1], new["r"][4:8])
    assert torch.equal(rx.kept["r"], new["r"][4:8]) and rx.held == "B"
    rx.kept["r"] = base["r"][0:4].clone()   # a copy of another box: its digest check fails, nothing reloaded
    rx.held = "A"
    reloaded.clear()
    with pytest.raises(CheckpointFormatError, match="do not match the version's digest"):
        _drive(rx, _box_bucket(base, new, [("r", ((0, 4, 4),))]))
    assert reloaded == [] and rx.held == "A"
