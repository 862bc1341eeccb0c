"""Deltas of versions registered in pieces (``delta/pieces.py``), in process: each piece's payload is
``encode_tensor`` of the piece's contiguous bytes against its base piece, named by its box; a version pieced
unlike its base gets no delta (and why is kept); an engine worker that holds the tensor whole writes each
piece into its box (scattered into the live tensor, or into the tensor rebuilt from its kept copy), checks
the piece's digest there, and undoes it all when the update fails."""

import pytest
import torch
from support.data import random_bits

from ckpt_core import TensorShard
from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta.apply import DeltaReceiver, delta_of_plan
from ckpt_core.delta.encode import decode, encode_tensor
from ckpt_core.delta.pieces import parse_piece_name, piece_name
from ckpt_core.delta.versions import MANIFEST, DeltaVersions, manifest_name
from ckpt_core.devices import get_backend
from ckpt_core.errors import CheckpointFormatError

# rows [0, 5) of w, and its rows [5, 12) as two column boxes (a strided piece each); v whole
BOXES = {"w": [((0, 0), (5, 16)), ((5, 0), (7, 9)), ((5, 9), (7, 7))], "u": [((0,), (40,)), ((40,), (24,))]}


def _sparse_change(t: torch.Tensor, gen: torch.Generator, density: float) -> torch.Tensor:
    new = t.clone()
    flat = new.reshape(-1).view(torch.uint8).view(t.numel(), -1)
    pos = torch.randperm(t.numel(), generator=gen)[: max(1, int(t.numel() * density))]
    flat[pos, 0] ^= (torch.randint(1, 256, (pos.numel(),), generator=gen)).to(torch.uint8)
    return new


def _cut(full: torch.Tensor, off, ext) -> torch.Tensor:
    view = full
    for d, (o, e) in enumerate(zip(off, ext)):
        view = view.narrow(d, o, e)
    return view


def _pieced(full: dict[str, torch.Tensor], boxes=BOXES) -> dict:
    """Named tensors of one rank holding every box of ``boxes`` (several boxes of a name: ``name#i``) and v."""
    out: dict = {"v": full["v"].clone()}
    for name, bs in boxes.items():
        for i, (off, ext) in enumerate(bs):
            out[f"{name}#{i}" if i else name] = TensorShard(_cut(full[name], off, ext).clone(), tuple(full[name].shape),
                                                            off)
    return out


def _versions(seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = {"w": random_bits((12, 16), torch.bfloat16, gen), "u": random_bits((64,), torch.float32, gen),
         "v": random_bits((9, 3), torch.float16, gen)}
    b = {n: _sparse_change(t, gen, 0.05) for n, t in a.items()}
    return a, b


def _checkpoint(name: str, full: dict, boxes=BOXES, whole=()):
    """One rank's registration of ``full`` in ``boxes`` (tensors in ``whole``: whole). Several boxes of one
    tensor on one rank (what a DTensor of uneven strided shards registers) are registered under ``name#i``
    and named back to their tensor, as ``shards.boxes_of`` names them."""
    named = _pieced(full, boxes)
    named.update({n: full[n].clone() for n in whole})
    ckpt = build_checkpoint(name, get_backend("cpu"), named_tensors=named)
    ckpt.metas = [m._replace(name=m.name.split("#")[0]) for m in ckpt.metas]
    return ckpt


def test_each_piece_s_payload_is_encode_tensor_of_its_bytes_against_its_base_piece():
    a, b = _versions(seed=41)
    ca, cb = _checkpoint("A", a), _checkpoint("B", b)
    out = DeltaVersions(0, 1).encode("B", cb, "A", ca)
    assert out is not None
    want = {}
    for name, bs in BOXES.items():
        for off, ext in bs:
            payload, _ = encode_tensor(_cut(b[name], off, ext).contiguous(), _cut(a[name], off, ext).contiguous())
            want[piece_name(name, a[name].shape, off, ext)] = payload
    want["ckpt.delta:v"] = encode_tensor(b["v"], a["v"])[0]
    got = {n: t for n, t in out.items() if not n.startswith(MANIFEST)}
    assert sorted(got) == sorted(n for n, p in want.items() if p is not None)
    for n, payload in got.items():
        assert torch.equal(payload, want[n]), n
    for n in got:
        if parse_piece_name(n) is not None:
            tensor, shape, box = parse_piece_name(n)
            assert decode(got[n]).shape == tuple(e for _, _, e in box) and shape == tuple(a[tensor].shape)


@pytest.mark.parametrize("boxes_b, why", [
    ({**BOXES, "w": [((0, 0), (6, 16)), ((6, 0), (6, 9)), ((6, 9), (6, 7))]}, "tensor 'w' pieces"),
    ({"w": BOXES["w"]}, "tensor 'u' held in pieces in 'A', whole in 'B'"),
])
def test_a_version_pieced_unlike_its_base_gets_no_delta_and_keeps_why(boxes_b, why):
    a, b = _versions(seed=43)
    ca = _checkpoint("A", a)
    cb = _checkpoint("B", b, boxes_b, whole=[n for n in BOXES if n not in boxes_b])
    versions = DeltaVersions(1, 2)
    assert versions.encode("B", cb, "A", ca) is None
    assert why in versions.refused["B"] and "on rank 1" in versions.refused["B"] and "B" not in versions.bases
    versions.forget("B")
    assert "B" not in versions.refused


def _engine_weights(a: dict, b: dict) -> list:
    out = [(manifest_name("A", "B", 0, 1), torch.zeros(1, dtype=torch.uint8))]
    for name, bs in BOXES.items():
        for off, ext in bs:
            payload, _ = encode_tensor(_cut(b[name], off, ext).contiguous(), _cut(a[name], off, ext).contiguous())
            if payload is not None:
                out.append((piece_name(name, a[name].shape, off, ext), payload))
    return out


def _drive(rx, buckets, fail=False):
    listing = [(n, t.dtype, tuple(t.shape)) for bucket in buckets for n, t in bucket]
    assert delta_of_plan(listing) == ("A", "B")
    with rx.update(run=lambda ws: None) as cb:
        cb.on_plan(listing)
        for bucket in buckets:
            cb.run(bucket)
        if fail:
            raise RuntimeError("another rank failed")
        cb.post_hook()


@pytest.mark.parametrize("defer", [False, True], ids=["reload-per-bucket", "reload-deferred"])
def test_an_engine_holding_whole_tensors_takes_their_pieces_scattered_or_rebuilt_and_undoes_them(defer):
    a, b = _versions(seed=47)
    live = {"w": a["w"].clone()}                                  # w: scattered into (contiguous and strided boxes)
    derived = {"u": a["u"].clone()}                               # u: not live (derived): rebuilt and reloaded
    reloads = []

    def reload(ws):
        reloads.append([n for n, _ in ws])
        derived.update({n: t.clone() for n, t in ws})
    rx = DeltaReceiver(live=live.get, reload=reload, held="A", defer_reload=defer)
    rx.keep("u", a["u"])
    weights = _engine_weights(a, b)
    m, w0, w1, w2, u0, u1 = weights
    buckets = [[m, w0, u0, w1], [w2, u1]]   # u's two pieces in different buckets
    assert any(n.startswith("ckpt.delta.piece:[\"u\"") for n, _ in buckets[0]) and \
        any(n.startswith("ckpt.delta.piece:[\"u\"") for n, _ in buckets[1])
    with pytest.raises(RuntimeError, match="another rank"):
        _drive(rx, buckets, fail=True)
    assert torch.equal(live["w"].view(torch.int16), a["w"].view(torch.int16)) and rx.held == "A"
    assert torch.equal(derived["u"].view(torch.int32), a["u"].view(torch.int32))
    _drive(rx, buckets)
    assert torch.equal(live["w"].view(torch.int16), b["w"].view(torch.int16)) and rx.held == "B"
    assert torch.equal(derived["u"].view(torch.int32), b["u"].view(torch.int32))
    assert torch.equal(rx.kept["u"].view(torch.int32), b["u"].view(torch.int32))   # the next delta's base
    assert rx.last["scattered"] == 3 and rx.last["reloaded"] == 1   # w's three pieces; u rebuilt once
    # per bucket: u reloaded after each bucket (and with its base on the undo); deferred: once, whole
    assert reloads[-(1 if defer else 2):] == [["u"]] * (1 if defer else 2)


def test_a_piece_whose_bytes_do_not_match_its_digest_is_refused_and_nothing_stays_written():
    a, b = _versions(seed=53)
    live = {"w": a["w"].clone(), "u": a["u"].clone()}
    rx = DeltaReceiver(live=live.get, held="A")
    weights = _engine_weights(a, b)
    strided = piece_name("w", (12, 16), (5, 9), (7, 7))   # the last box of w: a column block (strided)
    wrong = _cut(b["w"], (5, 9), (7, 7)).contiguous()
    wrong.view(torch.int16)[6, 6] ^= 1   # one element off, under the piece's true digest
    payload, _ = encode_tensor(wrong, _cut(a["w"], (5, 9), (7, 7)).contiguous(),
                               digest=decode(dict(weights)[strided]).digest)
    bad = [(n, payload if n == strided else p) for n, p in weights]
    with pytest.raises(CheckpointFormatError, match="do not match the version's digest") as err:
        _drive(rx, [bad])
    assert "w[piece [[0, 5, 7], [1, 9, 7]]]" in str(err.value)
    assert torch.equal(live["w"].view(torch.int16), a["w"].view(torch.int16))
    assert torch.equal(live["u"].view(torch.int32), a["u"].view(torch.int32)) and rx.held == "A"
    _drive(rx, [weights])   # the right delta then applies
    assert torch.equal(live["w"].view(torch.int16), b["w"].view(torch.int16)) and rx.held == "B"


@pytest.mark.parametrize("name", [
    'ckpt.delta.piece:["w",[4,4],[[0,2,3],[1,0,4]]]',   # outside the shape
    'ckpt.delta.piece:["w",[4,4],[[0,0,4]]]',           # a box of fewer dimensions than the tensor
    'ckpt.delta.piece:["w",[4,4],[[1,0,4],[0,0,4]]]',   # dimensions out of order
    'ckpt.delta.piece:not json',
])
def test_a_malformed_piece_name_is_a_format_error(name):
    with pytest.raises(CheckpointFormatError, match="malformed"):
        parse_piece_name(name)
