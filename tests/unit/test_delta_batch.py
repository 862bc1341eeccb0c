"""The batched encode of a registration (``delta/batch.py``) writes exactly the payloads that
``encode_tensor`` writes for each tensor alone, whatever the dtypes, densities, shapes (0-d, empty,
odd byte counts), and for unchanged, new, retyped and reshaped tensors; and the lin64 sums it keeps
(derived from the base's) are each tensor's own; every test runs with the compiled pass and with numpy
alone."""

import numpy as np
import pytest
import torch

from support.data import random_bits

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta import _payload_vector as payload_vector
from ckpt_core.delta import _scan, batch
from ckpt_core.delta.batch import encode_registration
from ckpt_core.delta.encode import encode_tensor
from ckpt_core.delta.lin64 import _sum_numpy, raw_of
from ckpt_core.devices import get_backend

DTYPES = sorted({dt for dt in WIRE_DTYPES.values()}, key=str)




def _mutate(t, density, gen, *, last=False):
    new = t.clone()
    n = t.numel()
    words = new.reshape(-1).view(torch.uint8).view(n, -1) if n else None
    k = int(round(n * density))
    if k:
        pos = torch.randperm(n, generator=gen)[:k]
        words[pos, 0] ^= 1
    if last and n:   # the last element: a tensor's tail word
        words[n - 1, 0] ^= 1
    return new


def _pairs(gen):
    """(name, base or None, new) over dtypes, densities, shapes, and the kinds of tensors."""
    out = []
    shapes = [(), (0,), (1,), (3,), (5, 3), (37, 11), (4097,), (300, 70)]
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(shapes):
            density = [0.0, 0.0005, 0.02, 0.3, 1.0][(i + j) % 5]
            base = random_bits(shape, dtype, gen)
            out.append((f"t{i}.{j}", base, _mutate(base, density, gen, last=(i + j) % 3 == 0)))
    base = random_bits((64, 33), torch.bfloat16, gen)
    out += [("unchanged", base, base.clone()), ("new", None, random_bits((10, 3), torch.float32, gen)),
            ("retyped", base, base.view(torch.int16).clone()), ("reshaped", base, base.reshape(33, 64).clone()),
            ("large", random_bits((1 << 21,), torch.bfloat16, gen), None)]
    name, b, _ = out[-1]
    out[-1] = (name, b, _mutate(b, 0.02, gen))
    sparse = random_bits((1 << 18,), torch.int32, gen)   # gaps above 2**16: idx
    far = sparse.clone()
    far[[5, 100_000, 200_000]] ^= 1
    block = random_bits((5000,), torch.float16, gen)      # one run: runs
    run = block.clone()
    run.view(torch.int16)[100:300] ^= 1
    return out + [("sparse", sparse, far), ("run", block, run)]


@pytest.fixture(autouse=True, params=["compiled", "numpy"])
def way(request, monkeypatch):
    """Every test both ways: the compiled pass (``_scan.py``) and numpy alone (``PS_DELTA_KERNEL=numpy``)."""
    monkeypatch.setenv("PS_DELTA_KERNEL", "auto" if request.param == "compiled" else "numpy")
    if request.param == "compiled" and _scan.kernel() is None:
        pytest.skip("no C compiler here: the compiled pass is not built")
    assert (_scan.kernel() is None) == (request.param == "numpy")
    return request.param


@pytest.fixture(params=[1, 2, "large"], ids=["one-thread", "threads", "large-on-their-own"])
def threads(request, monkeypatch):
    if request.param == 1:
        monkeypatch.setattr(batch, "_THREADS_MIN_WORDS", 1 << 62)
    elif request.param == "large":   # most tensors on their own (changed_positions), on threads
        monkeypatch.setattr(batch, "_THREADS_MIN_WORDS", 0)
        monkeypatch.setattr(batch, "LARGE_BYTES", 2048)
        monkeypatch.setenv("PS_DELTA_THREADS", "2")
    else:   # small pieces: many jobs, spans cut between them
        monkeypatch.setattr(batch, "_THREADS_MIN_WORDS", 0)
        monkeypatch.setattr(payload_vector, "_THREADS_MIN_ELEMENTS", 0)
        monkeypatch.setattr(batch, "_PIECE_WORDS", 1 << 10)
        monkeypatch.setattr(batch, "BLOCK_WORDS", 1 << 7)
        monkeypatch.setenv("PS_DELTA_THREADS", "3")
    return request.param


def _register(pairs):
    backend = get_backend("cpu")
    a = build_checkpoint("A", backend, named_tensors={n: b for n, b, _ in pairs if b is not None})
    b = build_checkpoint("B", backend, named_tensors={n: new for n, _, new in pairs})
    return a, b


def _payloads(got, b):
    """Each tensor's payload (None: unchanged) as ``Encoded.write`` writes them into one zeroed buffer."""
    sizes = [(i, info["bytes"]) for i, info in enumerate(got.infos) if info["encoding"] is not None]
    offsets, pos = {}, 0
    for i, n in sizes:
        offsets[i] = pos
        pos += (n + 255) // 256 * 256
    buf = np.zeros(pos, dtype=np.uint8)
    got.write(buf, offsets, {r: region.tensor.numpy() for r, region in b.regions.items()})
    return [torch.from_numpy(buf[offsets[i]: offsets[i] + info["bytes"]].copy()) if i in offsets else None
            for i, info in enumerate(got.infos)]


def _encode(b, a):
    got = encode_registration(b, a, {m.name: m for m in a.metas})
    return got, _payloads(got, b)


def _check(a, b, pairs, known_base):
    old = {m.name: m for m in a.metas}
    if known_base:
        for m in a.metas:
            a.digests[m.name] = _sum_numpy(raw_of(a.host_tensor(m))[0])
    got, payloads = _encode(b, a)
    for m, payload, info in zip(b.metas, payloads, got.infos):
        new = b.host_tensor(m)
        prev = a.host_tensor(old[m.name]) if m.name in old else None
        want, want_info = encode_tensor(new, prev)
        assert info == want_info, m.name
        if want is None:
            assert payload is None, m.name
        else:
            assert torch.equal(payload, want), m.name
    for name, s in got.digests.items():
        m = next(x for x in b.metas if x.name == name)
        assert s == _sum_numpy(raw_of(b.host_tensor(m))[0]), name
    return got, payloads


@pytest.mark.parametrize("known_base", [False, True], ids=["base-digests-computed", "base-digests-known"])
def test_batched_payloads_equal_encode_tensor_per_tensor(threads, known_base):
    pairs = _pairs(torch.Generator().manual_seed(5))
    a, b = _register(pairs)
    try:
        got, payloads = _check(a, b, pairs, known_base)
        changed = {m.name for m, p in zip(b.metas, payloads) if p is not None}
        assert "unchanged" not in changed and {"new", "retyped", "reshaped", "large"} <= changed
        assert {info["encoding"] for info in got.infos} == {None, "whole", "idx", "gap16", "bitmap", "runs"}
        assert "large" in got.digests   # digested as it was compared (a large tensor)
        if batch.LARGE_BYTES > 10_000:   # a batched tensor's base sum is kept once computed
            assert "run" in a.digests
    finally:
        a.release()
        b.release()


def test_a_chain_of_versions_uses_each_versions_derived_sums(threads, monkeypatch):
    """A -> B -> C: C's encode finds B's sums (derived when B was encoded), digests nothing whole."""
    gen = torch.Generator().manual_seed(9)
    backend = get_backend("cpu")
    v0 = {f"w{i}": random_bits((257, 9 + i), torch.bfloat16, gen) for i in range(6)}
    v1 = {n: _mutate(t, 0.02, gen) for n, t in v0.items()}
    v2 = {n: _mutate(t, 0.02, gen, last=True) for n, t in v1.items()}
    cks = [build_checkpoint(f"v{i}", backend, named_tensors=v) for i, v in enumerate((v0, v1, v2))]
    try:
        first, _ = _encode(cks[1], cks[0])
        cks[1].digests.update(first.digests)
        whole = []
        monkeypatch.setattr(batch, "_sum_numpy", lambda raw: whole.append(raw) or _sum_numpy(raw))
        _, payloads = _encode(cks[2], cks[1])
        assert whole == []
        for m, payload in zip(cks[2].metas, payloads):
            want, _ = encode_tensor(cks[2].host_tensor(m), cks[1].host_tensor(m))
            assert torch.equal(payload, want), m.name
    finally:
        for c in cks:
            c.release()


def test_a_base_laid_out_differently_is_compared_tensor_by_tensor(threads):
    """The base's tensors in another order (other offsets): spans of one tensor each, same payloads."""
    gen = torch.Generator().manual_seed(3)
    backend = get_backend("cpu")
    v0 = {f"w{i}": random_bits((129, 7 + i), torch.float16, gen) for i in range(5)}
    v1 = {n: _mutate(v0[n], 0.05, gen) for n in reversed(list(v0))}
    a = build_checkpoint("A", backend, named_tensors=v0)
    b = build_checkpoint("B", backend, named_tensors=v1)
    try:
        _check(a, b, [(n, v0[n], v1[n]) for n in v1], known_base=False)
    finally:
        a.release()
        b.release()


def test_tensors_packed_without_padding_are_compared_without_tail_masks(threads):
    """Tensors of whole 256-byte multiples lie back to back: a span without odd ends or padding."""
    gen = torch.Generator().manual_seed(4)
    backend = get_backend("cpu")
    v0 = {f"w{i}": random_bits((128, 64), torch.bfloat16, gen) for i in range(4)}
    v0["r"] = random_bits((64, 16), torch.float32, gen)
    v1 = {n: _mutate(t, 0.03, gen, last=True) for n, t in v0.items()}
    a = build_checkpoint("A", backend, named_tensors=v0)
    b = build_checkpoint("B", backend, named_tensors=v1)
    try:
        assert batch._spans([batch._Pair(i, m, m2) for i, (m, m2) in enumerate(zip(b.metas, a.metas))]).__len__() == 1
        _check(a, b, [(n, v0[n], v1[n]) for n in v1], known_base=False)
    finally:
        a.release()
        b.release()


def test_in_place_file_maps_keep_no_sums(tmp_path):
    """A version mapped in place from /dev/shm (its file's owner could rewrite it) keeps no lin64 sums,
    as base or as new version; the payloads are the same all the same."""
    import os
    import uuid

    from ckpt_core.checkpoint.safetensors import write_file
    gen = torch.Generator().manual_seed(8)
    v0 = {f"w{i}": random_bits((100, 9 + i), torch.bfloat16, gen) for i in range(3)}
    v1 = {n: _mutate(t, 0.05, gen) for n, t in v0.items()}
    paths = [f"/dev/shm/ckpt-test-{uuid.uuid4().hex}-{k}.safetensors" for k in "ab"]
    backend = get_backend("cpu")
    try:
        write_file(paths[0], v0)
        write_file(paths[1], v1)
        a = build_checkpoint("A", backend, files=[paths[0]])
        b = build_checkpoint("B", backend, files=[paths[1]])
        try:
            assert all(r.source_check is not None for r in a.regions.values())   # mapped in place
            got, payloads = _encode(b, a)
            assert got.digests == {} and a.digests == {}
            for m, payload in zip(b.metas, payloads):
                want, _ = encode_tensor(b.host_tensor(m), a.host_tensor(m))
                assert torch.equal(payload, want), m.name
        finally:
            a.release()
            b.release()
    finally:
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


def test_build_packed_lays_payloads_out_as_build_checkpoint_does():
    """The companion of payloads (flat uint8 tensors) registered without a copy job each: the same metas
    and bytes as build_checkpoint; other tensors go through build_checkpoint itself."""
    from ckpt_core.checkpoint.sources import build_packed
    gen = torch.Generator().manual_seed(2)
    named = {f"ckpt.delta:w{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
             for i, n in enumerate([1, 0, 300, 4096, 7])}
    backend = get_backend("cpu")
    want = build_checkpoint("c", backend, named_tensors=named)
    got = build_packed("c", backend, named)
    other = build_packed("d", backend, {"x": torch.ones(3, 5)})   # not payloads: build_checkpoint's way
    try:
        assert got.metas == want.metas and got.nbytes == want.nbytes
        assert all(torch.equal(got.host_tensor(m), want.host_tensor(m)) for m in want.metas)
        assert torch.equal(other.host_tensor(other.metas[0]), torch.ones(3, 5))
    finally:
        for c in (want, got, other):
            c.release()


def test_payloads_written_into_a_packed_region_are_adopted_in_place_and_the_rest_copied():
    """The encode writes its payloads straight into a PackedRegion; build_packed keeps them where they lie
    (the region becomes the companion's region 0, no copy) and copies the others (the manifest) into
    region 1: the same bytes as build_checkpoint's. Released once, by the checkpoint."""
    from ckpt_core.checkpoint.sources import PackedRegion, build_packed
    gen = torch.Generator().manual_seed(3)
    backend = get_backend("cpu")
    packed = PackedRegion(backend)
    buf = packed.alloc(4096)
    assert buf.size == 4096 and not buf.any()                       # zeroed
    whole = torch.from_numpy(buf)
    whole[:] = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    named = {"ckpt.delta:a": whole[8:308], "ckpt.delta:b": whole[1024:4096], "ckpt.delta:empty": whole[0:0],
             "manifest": torch.randint(0, 256, (33,), dtype=torch.uint8, generator=gen)}
    want = build_checkpoint("c", backend, named_tensors=named)
    got = build_packed("c", backend, named, into=packed)
    try:
        assert packed.region is None                                # the checkpoint's now
        by = {m.name: m for m in got.metas}
        assert [m.name for m in got.metas] == list(named)
        assert (by["ckpt.delta:a"].base, by["ckpt.delta:a"].base_offset) == (0, 8)
        assert (by["ckpt.delta:b"].base, by["ckpt.delta:b"].base_offset) == (0, 1024)
        assert by["manifest"].base == 1 and by["ckpt.delta:empty"].base == 1
        assert got.host_tensor(by["ckpt.delta:a"]).data_ptr() == whole[8:].data_ptr()   # not copied
        for m in want.metas:
            assert torch.equal(got.host_tensor(by[m.name]), want.host_tensor(m)), m.name
        packed.release()                                            # nothing left to free: no effect
        assert torch.equal(got.host_tensor(by["ckpt.delta:b"]), named["ckpt.delta:b"])
    finally:
        got.release()
        want.release()
    assert got.regions == {}


def _edge_dtypes():
    out = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.int64]
    return out + [dt for dt in (getattr(torch, "float8_e4m3fn", None),) if dt is not None]


def _changed_at(base, where):
    new = base.clone()
    w = new.reshape(-1).view(torch.uint8).view(base.numel(), -1)
    w[where, 0] ^= 1
    return new


@pytest.mark.parametrize("dtype", _edge_dtypes(), ids=str)
def test_large_payloads_written_straight_into_the_buffer_equal_encode_tensor(dtype, monkeypatch):
    """Large tensors' idx and gap16 payloads, written by one compiled call each into the payloads' buffer
    (``_direct_payload.py``), are ``encode_tensor``'s byte for byte: a change at the first and the last
    element, on both sides of a boundary of the scan's chunks of 4,096 words, gaps of 65,535 (gap16) and 65,536
    (idx), odd sizes; every element changed and none changed go their own ways."""
    monkeypatch.setattr(batch, "LARGE_BYTES", 2048)
    monkeypatch.setenv("PS_DELTA_THREADS", "2")
    gen = torch.Generator().manual_seed(17)
    n = 200_003   # odd: the tensor ends inside a word
    k = 8 // dtype.itemsize if dtype.itemsize < 8 else 1
    base = random_bits((n,), dtype, gen)
    cases = {
        "ends": [0, n - 1],
        "block-edge": [4096 * k - 1, 4096 * k, 8192 * k],   # ckd_scan's chunks of 4,096 words
        "gap16-max": [3, 3 + 65_535, 3 + 2 * 65_535],
        "idx-gap": [3, 3 + 65_536],
        "spread": torch.randperm(n, generator=gen)[: n // 50].sort().values.tolist(),
        "all": list(range(n)),
        "none": [],
    }
    pairs = [(name, base, _changed_at(base, where)) for name, where in cases.items()]
    pairs.append(("odd", random_bits((4099,), dtype, gen), None))
    pairs[-1] = ("odd", pairs[-1][1], _changed_at(pairs[-1][1], [0, 4098]))
    a, b = _register(pairs)
    try:
        got, _ = _check(a, b, pairs, known_base=False)
        direct = {b.metas[i].name for i, p in got.payloads.items() if not isinstance(p, torch.Tensor)}
        enc = {m.name: info["encoding"] for m, info in zip(b.metas, got.infos)}
        if _scan.kernel() is not None:
            assert direct == {name for name, e in enc.items() if e in ("idx", "gap16")}
            assert {"ends", "gap16-max", "idx-gap", "spread"} <= direct
        else:
            assert not direct
        assert enc["gap16-max"] == "gap16" and enc["idx-gap"] == "idx"
        assert enc["none"] is None and enc["all"] not in ("idx", "gap16")
    finally:
        a.release()
        b.release()
