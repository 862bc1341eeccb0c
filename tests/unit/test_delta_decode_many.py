"""A bucket's payloads are decoded together (``encode.decode_many``): every check of every payload
runs before anything is written, the device results are read back once for the bucket, and a
refused payload is named, with the same error ``decode`` gives it alone."""

import struct

import pytest
import torch

import ckpt_core.delta.encode as enc
import ckpt_core.delta.lin64 as lin
from ckpt_core.checkpoint.safetensors import WIRE_CODES
from ckpt_core.delta.apply import DeltaReceiver
from ckpt_core.delta.encode import ENCODINGS, apply_decoded, decode, decode_many, encode_tensor
from ckpt_core.delta.versions import PAYLOAD, manifest_name
from ckpt_core.errors import CheckpointFormatError


def _pair(n, density, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=gen).to(dtype)
    new = base.clone()
    new.view(torch.int16)[torch.randperm(n, generator=gen)[: max(1, int(n * density))]] ^= 1
    return base, new


def _crafted(enc_name, positions, values, numel, *, runs=0, body=None):
    """A payload whose body check is right but whose positions are not (what a buggy encoder would send)."""
    header = {"dtype": WIRE_CODES[torch.int16], "shape": [numel], "enc": enc_name, "count": len(values),
              "runs": runs, "digest": "lin64:0123456789abcdef"}
    if body is None:
        idx = struct.pack(f"<{len(positions)}i", *positions)
        body = idx + b"\0" * (-len(idx) % 8)
        vals = struct.pack(f"<{len(values)}h", *values)
        body += vals + b"\0" * (-len(vals) % 8)
    return enc._payload(header, body)


def _count_read_backs(monkeypatch, *modules) -> tuple[list[int], list[int]]:
    """``read_ints`` of ``modules`` (the bucket's one read-back) patched to record each call's size;
    returns (sizes, inside): ``inside`` is non-empty while such a read-back runs."""
    reads: list[int] = []
    inside: list[int] = []
    real = lin.read_ints

    def read_ints(values):
        reads.append(len(values))
        inside.append(1)
        try:
            return real(values)
        finally:
            inside.pop()
    for module in modules:
        monkeypatch.setattr(module, "read_ints", read_ints)
    return reads, inside


def _forbid_host_reads(monkeypatch, inside: list[int], where: str) -> None:
    """Tensor.item/__bool__/__int__/tolist fail the test unless a counted read-back runs (``inside``)."""
    for name in ("item", "__bool__", "__int__", "tolist"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _o=orig, _n=name, **k: _o(*a, **k) if inside
                            else pytest.fail(f"Tensor.{_n} {where}"))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_decode_many_equals_decode_one_by_one(encoding):
    pairs = [_pair(n, d, s) for n, d, s in [(5000, 0.02, 1), (64, 0.3, 2), (70_000, 0.001, 3)]]
    payloads = []
    for i, (base, new) in enumerate(pairs):
        force = None if encoding == "whole" else encoding
        if encoding == "gap16" and i == 2:
            force = "idx"   # gaps of 70,000 elements do not fit
        p, _ = encode_tensor(new, None if encoding == "whole" else base, force=force)
        payloads.append((f"t{i}", p))
    together = decode_many(payloads)
    for (name, p), d, (base, new) in zip(payloads, together, pairs):
        alone = decode(p, name)
        assert (d.encoding, d.count, d.digest, d.shape) == (alone.encoding, alone.count, alone.digest, alone.shape)
        live = base.clone()
        apply_decoded(live, d)
        assert torch.equal(live.view(torch.int16), new.view(torch.int16))


def test_a_bucket_reads_its_checks_back_once(monkeypatch):
    pairs = [_pair(4096 + i, 0.02, i) for i in range(12)]
    payloads = [(f"t{i}", encode_tensor(new, base, force=e)[0])
                for i, ((base, new), e) in enumerate(zip(pairs, ["idx", "gap16", "bitmap", "runs"] * 3))]
    reads, inside = _count_read_backs(monkeypatch, enc)   # the one read-back allowed: its own tolist()
    _forbid_host_reads(monkeypatch, inside, "in decode_many: a per-payload read-back")
    decoded = decode_many(payloads)
    monkeypatch.undo()
    assert len(decoded) == 12 and len(reads) == 1
    assert reads[0] == 12 + 3 + 1   # the body checks, the runs' lengths, one flag for every position list


def test_the_first_refused_payload_is_named_and_nothing_is_written():
    pairs = {n: _pair(4096, 0.05, i) for i, n in enumerate("abc")}
    weights = [(manifest_name("A", "B", 0, 1), torch.zeros(1, dtype=torch.uint8))]
    for n, (base, new) in pairs.items():
        weights.append((PAYLOAD + n, encode_tensor(new, base)[0]))
    weights[2] = (weights[2][0], weights[2][1].clone())
    weights[2][1][-3] ^= 0x10   # b's body: its check fails
    weights[3][1][-3] ^= 0x10   # c's too: b comes first
    live = {n: base.clone() for n, (base, _) in pairs.items()}
    rx = DeltaReceiver(live=live.get, held="A")
    with pytest.raises(CheckpointFormatError, match="body's check") as err:
        with rx.update(run=lambda ws: None, version=None) as cb:
            cb.on_plan([(n, t.dtype, tuple(t.shape)) for n, t in weights])
            cb.run(weights)
    assert err.value.tensor == "b"
    assert all(torch.equal(live[n], pairs[n][0]) for n in live) and rx.held == "A"   # a too: decoded, not written


@pytest.mark.parametrize("positions, why", [
    ([3, 3, 9], "not strictly increasing"), ([5, 2, 9], "not strictly increasing"),
    ([1, 2, 64], "out of range"), ([-1, 2, 9], "out of range")])
def test_bad_positions_behind_a_good_body_check_are_refused(positions, why):
    good = _crafted("idx", [1, 2, 9], [7, 8, 9], 64)
    bad = _crafted("idx", positions, [7, 8, 9], 64)
    assert decode(good, "w").positions.tolist() == [1, 2, 9]
    with pytest.raises(CheckpointFormatError, match="positions out of range or not strictly increasing") as err:
        decode_many([("v", good), ("w", bad)])
    assert err.value.tensor == "w", why


def test_runs_whose_lengths_do_not_add_up_are_refused_and_expand_in_range():
    def runs_body(starts, lengths, values):
        idx = struct.pack(f"<{len(starts)}i", *starts) + b"\0" * (-4 * len(starts) % 8)
        idx += struct.pack(f"<{len(lengths)}i", *lengths) + b"\0" * (-4 * len(lengths) % 8)
        vals = struct.pack(f"<{len(values)}h", *values)
        return idx + vals + b"\0" * (-len(vals) % 8)
    ok = _crafted("runs", [], [1, 2, 3, 4], 64, runs=2, body=runs_body([3, 10], [1, 3], [1, 2, 3, 4]))
    assert decode(ok).positions.tolist() == [3, 10, 11, 12]
    for lengths in ([2, 3], [0, 4], [-1, 5], [5, -1]):
        bad = _crafted("runs", [], [1, 2, 3, 4], 64, runs=2, body=runs_body([3, 10], lengths, [1, 2, 3, 4]))
        with pytest.raises(CheckpointFormatError, match="run lengths do not add up"):
            decode(bad, "w")


def test_a_bitmap_marking_other_than_its_count_is_refused():
    base, new = _pair(4096, 0.1, 5)
    payload, _ = encode_tensor(new, base, force="bitmap")
    header, start = enc.read_header(payload)
    body = bytes(payload[start:].numpy())
    at = next(i for i, b in enumerate(body) if b != 0xFF)
    body = body[:at] + bytes([body[at] | (body[at] + 1)]) + body[at + 1:]   # one more element marked
    bad = enc._payload({k: v for k, v in header.items() if k not in ("body", "check")}, body)
    with pytest.raises(CheckpointFormatError, match=r"bitmap marks \d+ elements, header says"):
        decode(bad, "w")


def test_a_long_header_is_read_past_the_peek(monkeypatch):
    monkeypatch.setattr(enc, "_PEEK", 16)
    base, new = _pair(300, 0.1, 6)
    p, _ = encode_tensor(new, base)
    d = decode_many([("w", p)])[0]
    assert d.digest == lin.lin64(new)


def test_runs_of_no_run_with_changes_are_refused_as_before():
    bad = _crafted("runs", [], [1, 2], 64, runs=0, body=struct.pack("<2h", 1, 2) + b"\0" * 4)
    with pytest.raises(CheckpointFormatError, match="0 positions, header says 2"):
        decode(bad, "w")


def test_each_list_is_checked_against_its_own_tensor_within_the_bucket():
    """The bucket's position lists are checked together: a position valid for a larger tensor is out of
    range for its own, each list must rise on its own (a next list may start lower), the first bad is named."""
    big = _crafted("idx", [5, 100, 900], [1, 2, 3], 1000)
    small_ok = _crafted("idx", [0, 1, 63], [1, 2, 3], 64)
    small_bad = _crafted("idx", [0, 1, 64], [1, 2, 3], 64)   # 64 is in range for big, not for its own
    got = decode_many([("big", big), ("ok", small_ok), ("big2", big)])
    assert [d.positions.tolist() for d in got] == [[5, 100, 900], [0, 1, 63], [5, 100, 900]]
    for order in (["big", "bad", "ok"], ["bad", "big", "bad2"]):
        named = {"big": big, "ok": small_ok, "bad": small_bad, "bad2": small_bad}
        with pytest.raises(CheckpointFormatError, match="positions out of range") as err:
            decode_many([(n, named[n]) for n in order])
        assert err.value.tensor == "bad"


def test_the_bodies_digested_together_on_the_device_path_refuse_the_corrupted_one(monkeypatch):
    real = enc.queue_many
    monkeypatch.setattr(enc, "queue_many", lambda ts: real(ts, engine="torch"))   # as on a GPU
    pairs = [_pair(3000 + 100 * i, 0.03, i) for i in range(6)]
    payloads = [(f"t{i}", encode_tensor(new, base)[0].clone()) for i, (base, new) in enumerate(pairs)]
    assert [d.count for d in decode_many(payloads)] == [decode(p).count for _, p in payloads]
    payloads[4][1][-2] ^= 0x40
    with pytest.raises(CheckpointFormatError, match="body's check") as err:
        decode_many(payloads)
    assert err.value.tensor == "t4"


def test_a_bucket_s_whole_apply_reads_back_three_times_whatever_its_tensor_count(monkeypatch):
    """Decode, scatter and post-apply digests of a bucket on the device path: the headers in one copy,
    the checks in one read-back, the digests in one; no per-tensor item()/bool()/int()/tolist()."""
    import ckpt_core.delta.apply as apply_mod

    real_many, real_qm = lin.lin64_many, enc.queue_many
    monkeypatch.setattr(apply_mod, "lin64_many", lambda ts: real_many(ts, engine="torch"))
    monkeypatch.setattr(enc, "queue_many", lambda ts: real_qm(ts, engine="torch"))
    reads, inside = _count_read_backs(monkeypatch, lin, enc)
    peeks = []
    real_peek = enc.peek_heads
    monkeypatch.setattr(enc, "peek_heads", lambda raws, n, aside=False: peeks.append(len(raws)) or real_peek(raws, n, aside))
    for n in (3, 17):
        pairs = {f"t{i}": _pair(2000 + 50 * i, 0.03, i) for i in range(n)}
        weights = [(manifest_name("A", "B", 0, 1), torch.zeros(1, dtype=torch.uint8))]
        weights += [(PAYLOAD + k, encode_tensor(new, base)[0]) for k, (base, new) in pairs.items()]
        live = {k: base.clone() for k, (base, _) in pairs.items()}
        rx = DeltaReceiver(live=live.get, held="A")
        reads.clear()
        peeks.clear()
        with rx.update(run=lambda ws: None) as cb:
            cb.on_plan([(w, t.dtype, tuple(t.shape)) for w, t in weights])
            _forbid_host_reads(monkeypatch, inside, "outside the bucket's read-backs")
            cb.run(weights)
            cb.post_hook()
        assert peeks == [n] and reads == [n + 1, n], (n, peeks, reads)   # checks + one position flag; digests
        assert all(torch.equal(live[k].view(torch.int16), new.view(torch.int16)) for k, (_, new) in pairs.items())


@pytest.mark.parametrize("offset", range(8))
def test_payloads_at_any_offset_of_their_buffer_decode_alike_and_own_their_positions(offset):
    """Values and gaps are read through views where aligned, copies where not; the positions are the
    decode's own (the undo keeps them after the bucket's buffer is reused)."""
    base, new = _pair(5000, 0.03, offset)
    payloads = {e: encode_tensor(new, base, force=e)[0] for e in ("idx", "gap16", "bitmap", "runs")}
    for e, p in payloads.items():
        buf = torch.zeros(p.numel() + 16, dtype=torch.uint8)
        buf[offset: offset + p.numel()] = p
        d = decode_many([("w", buf[offset: offset + p.numel()])])[0]
        live = base.clone()
        apply_decoded(live, d)
        assert torch.equal(live.view(torch.int16), new.view(torch.int16)), (e, offset)
        kept = d.positions.clone()
        buf.zero_()   # the bucket's buffer reused
        assert torch.equal(d.positions, kept), (e, offset)


def test_positions_read_as_int64_words_are_copied_not_views_of_the_payload():
    """Tensors of 2**31 elements and more carry int64 positions: read where they lie they would alias the
    bucket's buffer, which the next bucket overwrites while the undo log still holds them."""
    raw = torch.arange(16, dtype=torch.int64).view(torch.uint8)
    got = enc._ints(raw, 16, 8)
    raw.zero_()
    assert got.tolist() == list(range(16))
