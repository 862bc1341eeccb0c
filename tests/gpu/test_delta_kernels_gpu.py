"""The delta's fused Triton kernels (``ckpt_core/delta/_kernels.py``) against the torch ops they replace:
lin64's row sums and the apply's gather-and-scatter, bit for bit, and the kernels actually run."""

import pytest
import torch

from ckpt_core.delta import _kernels
from ckpt_core.delta.encode import Decoded, apply_decoded, as_words, undo_decoded
from ckpt_core.delta.lin64 import CHUNK, ROW, lin64, lin64_many

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def triton_on_cuda(monkeypatch):
    monkeypatch.setenv("CKPT_DELTA_TRITON", "1")   # both kernels (the default, check, leaves the scatters to torch)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if _kernels.kernels(torch.device("cuda")) is None:
        pytest.skip("Triton does not import here: the torch ops are the only path")
    yield
    assert not _kernels._STATE["failed"], "a kernel failed and the torch ops took over"


def _bytes(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("n", [8 * ROW * 3 + 5, 8 * CHUNK + 8 * ROW + 3, 8 * ROW - 8, 16 * ROW + 4, 8])
def test_the_fused_row_sums_give_the_torch_ops_and_the_hosts_digest(n, monkeypatch):
    """At row and chunk borders, with a zero-padded last word, on an aligned and a misaligned view."""
    raw = _bytes(n + 8, seed=n).cuda()
    for view in (raw[:n], raw[3: n + 3]):
        fused = lin64(view)
        monkeypatch.setenv("CKPT_DELTA_TRITON", "0")
        assert lin64(view) == fused == lin64(view.cpu())   # torch ops on the device; numpy on the host
        monkeypatch.setenv("CKPT_DELTA_TRITON", "1")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64], ids=str)
def test_the_fused_swap_writes_what_the_torch_ops_write_and_returns_the_old_values(dtype, monkeypatch):
    n = 1_000_003
    gen = torch.Generator().manual_seed(7)
    size = torch.empty(0, dtype=dtype).element_size()
    base = _bytes(n * size, seed=11).view(dtype).cuda()
    pos = torch.randperm(n, generator=gen)[: n // 37].sort().values.cuda()
    values = _bytes(pos.numel() * size, seed=13).view(dtype).cuda()
    word = as_words(base).dtype   # what decode gives: the item size's integers (uint8 for 1 byte)
    d = Decoded("idx", dtype, (n,), pos.numel(), "lin64:0", pos, values.view(word))
    got, want = base.clone(), base.clone()
    old = apply_decoded(got, d)
    monkeypatch.setenv("CKPT_DELTA_TRITON", "0")
    old_torch = apply_decoded(want, d)
    monkeypatch.setenv("CKPT_DELTA_TRITON", "1")
    assert torch.equal(got.view(word), want.view(word)) and torch.equal(old, old_torch)
    assert torch.equal(got.view(word)[pos], values.view(word))
    undo_decoded(got, d, old)
    assert torch.equal(got.view(word), base.view(word))
    assert _kernels.scatter_swap(base.clone().view(word), pos, values.view(word)) is not None, "the kernel did not run"


def test_the_one_launch_row_sums_of_many_tensors_give_each_ones_digest(monkeypatch):
    """``lin64_many`` batches a device's aligned whole-word tensors into one kernel (``lin64_rows_many``):
    each digest equals the host's and the torch ops', small, empty, row- and chunk-sized, a tail that is
    not whole words (the per-tensor path) mixed in, and across two batches (``_BATCH_BYTES``)."""
    from ckpt_core.delta import lin64 as lin64_mod

    sizes = [8 * ROW * 3, 16, 8 * ROW + 8, 0, 13, 8 * CHUNK + 24, 2, 8 * 5000]
    ts = [_bytes(n, seed=n + 1).cuda() for n in sizes] + [torch.randn(333, 7, device="cuda").to(torch.bfloat16)]
    want = [lin64(t.cpu()) for t in ts]
    assert lin64_many(ts) == want
    monkeypatch.setattr(lin64_mod, "_BATCH_BYTES", 8 * ROW)
    assert lin64_many(ts) == want
    monkeypatch.setenv("CKPT_DELTA_TRITON", "0")
    assert lin64_many(ts) == want
    monkeypatch.setenv("CKPT_DELTA_TRITON", "1")
    words = [t.view(torch.int64) for t in ts[:3]]
    assert _kernels.lin64_rows_many(words, lin64_mod._a(words[0].device), ROW) is not None, "the kernel did not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64], ids=str)
def test_the_one_launch_swap_of_many_tensors_writes_each_and_returns_each_ones_old_values(dtype):
    gen = torch.Generator().manual_seed(5)
    size = torch.empty(0, dtype=dtype).element_size()
    word = as_words(torch.empty(0, dtype=dtype)).dtype
    lens = [1_000_003, 7, 0, 4099, 65_536]
    bases = [_bytes(n * size, seed=17 + n).view(word).cuda() for n in lens]
    pos = [torch.randperm(n, generator=gen)[: max(n // 29, min(n, 1))].sort().values.cuda() for n in lens]
    values = [_bytes(p.numel() * size, seed=3 + p.numel()).view(word).cuda() for p in pos]
    got = [b.clone() for b in bases]
    olds = _kernels.scatter_swap_many(got, pos, values)
    assert olds is not None, "the kernel did not run"
    for b, g, p, v, old in zip(bases, got, pos, values, olds):
        want = b.clone()
        want[p] = v
        assert torch.equal(g, want) and torch.equal(old, b[p])


def test_a_receivers_bucket_is_scattered_in_one_launch_checked_and_undone_byte_for_byte():
    """``DeltaReceiver``: a bucket of bf16, float32 and fp8 deltas into live CUDA tensors goes through the
    batched swap (one kernel per item size); the post-apply check passes; a failure later undoes it all."""
    from support.data import mixed_delta_bucket

    from ckpt_core.delta.apply import DeltaReceiver
    from ckpt_core.delta.encode import encode_tensor
    from ckpt_core.delta.versions import PAYLOAD

    bases, news = mixed_delta_bucket()
    live = {k: v.cuda() for k, v in bases.items()}
    payloads = [(PAYLOAD + k, encode_tensor(news[k], bases[k])[0].cuda()) for k in bases]
    rx = DeltaReceiver(live=live.get, held="A")
    with rx.update(run=None, version="B") as cb:
        cb.delta = ("A", "B")
        cb.ran = True
        cb._apply(payloads)
        assert cb.figures["scattered"] == len(bases)
        for k in bases:
            assert torch.equal(as_words(live[k].cpu()), as_words(news[k]))
        cb.undo()
        cb.undo_log.clear()
    for k in bases:
        assert torch.equal(as_words(live[k].cpu()), as_words(bases[k]))


def _packed(payloads):
    """The payloads copied into one CUDA buffer at 256-byte aligned offsets (as a bucket of the IPC buffer
    holds them), each a view of it."""
    offsets, at = [], 0
    for _, p in payloads:
        offsets.append(at)
        at += -(-p.numel() // 256) * 256
    buf = torch.zeros(at, dtype=torch.uint8, device="cuda")
    out = []
    for (name, p), off in zip(payloads, offsets):
        buf[off: off + p.numel()].copy_(p)
        out.append((name, buf[off: off + p.numel()]))
    return out


@pytest.mark.parametrize("mode", ["gaps", "1"])
def test_a_bucket_of_gap16_deltas_goes_the_two_pass_route_equal_to_the_torch_ops_and_undone(mode, monkeypatch):
    """``CKPT_DELTA_TRITON=gaps`` (and ``1``): a bucket's gap16 payloads (2 % of 1M-element tensors: lists over
    hundreds of blocks; bf16 and float32; one payload in another encoding beside them) are applied by the two
    passes of ``_gap_route.py``: the live tensors equal the new version and what the torch ops (``0``) give,
    the post-apply check passes, the undo gives the base back; a corrupted value is refused, nothing written."""
    from ckpt_core.delta._gap_route import GapRoute
    from ckpt_core.delta.apply import DeltaReceiver
    from ckpt_core.delta.encode import encode_tensor
    from ckpt_core.delta.versions import PAYLOAD
    from ckpt_core.errors import CheckpointFormatError

    monkeypatch.setenv("CKPT_DELTA_TRITON", mode)
    gen = torch.Generator().manual_seed(21)
    bases, news = {}, {}
    for i, (n, dtype) in enumerate([(1 << 20, torch.bfloat16), (999_983, torch.bfloat16), (300_001, torch.float32),
                                    (4096, torch.bfloat16)]):
        base = torch.randn(n, generator=gen).to(dtype)
        new = base.clone()
        as_words(new)[torch.randperm(n, generator=gen)[: n // 50].sort().values] ^= 1
        bases[f"t{i}"], news[f"t{i}"] = base, new
    payloads = _packed([(PAYLOAD + k, encode_tensor(news[k], bases[k], force="idx" if k == "t3" else "gap16")[0])
                        for k in bases])

    def run(items, triton):
        monkeypatch.setenv("CKPT_DELTA_TRITON", triton)
        live = {k: v.cuda() for k, v in bases.items()}
        rx = DeltaReceiver(live=live.get, held="A")
        with rx.update(run=None, version="B") as cb:
            cb.delta, cb.ran = ("A", "B"), True
            try:
                cb._apply(items)
            except CheckpointFormatError as exc:
                for k in bases:
                    assert torch.equal(as_words(live[k].cpu()), as_words(bases[k])), k
                cb.undo_log.clear()
                return exc, None
            routes = [e for e in cb.undo_log if isinstance(e, GapRoute)]
            got = {k: v.clone() for k, v in live.items()}
            cb.undo()
            cb.undo_log.clear()
        for k in bases:
            assert torch.equal(as_words(live[k].cpu()), as_words(bases[k])), k
        return routes, got

    routes, got = run(payloads, mode)
    assert len(routes) == 1 and sorted(it.name for it in routes[0].items) == ["t0", "t1", "t2"]
    _, torch_ops = run(payloads, "0")
    for k in bases:
        assert torch.equal(as_words(got[k].cpu()), as_words(news[k])), k
        assert torch.equal(as_words(got[k]), as_words(torch_ops[k])), k
    corrupt = [(n, p.clone()) for n, p in payloads]
    corrupt[1][1][-3] ^= 0x40
    exc, _ = run(corrupt, mode)
    assert isinstance(exc, CheckpointFormatError) and "t1" in str(exc), exc
    assert not _kernels._STATE["failed"]


@pytest.mark.parametrize("mode", ["1", "gaps"])
def test_a_tied_name_in_a_bucket_is_written_apart_from_the_launch_and_undone_to_the_base(mode, monkeypatch):
    """A second name of one live tensor (a tied embedding) in a bucket, ahead of its first name: the batched
    launch (``1``: the scatter, ``gaps``: the gap16 route) takes one of them and the other is written after it
    (``_kernels.disjoint``), so the old values kept for the undo are the base's, not values written by the
    same launch's other blocks (on a GPU those run at once). 4M-element tensors, 2 % changed: the live
    tensors equal the new version, and the undo gives the base back byte for byte."""
    from ckpt_core.delta.apply import DeltaReceiver
    from ckpt_core.delta.encode import encode_tensor
    from ckpt_core.delta.versions import PAYLOAD

    monkeypatch.setenv("CKPT_DELTA_TRITON", mode)
    gen = torch.Generator().manual_seed(33)
    bases, news = {}, {}
    for k, n in (("embed", 4 << 20), ("w1", 3 << 20), ("w2", 1 << 20)):
        base = torch.randn(n, generator=gen).to(torch.bfloat16)
        new = base.clone()
        as_words(new)[torch.randperm(n, generator=gen)[: n // 50].sort().values] ^= 5
        bases[k], news[k] = base, new
    own = {k: encode_tensor(news[k], bases[k], force="gap16")[0] for k in bases}
    items = _packed([(PAYLOAD + "lm_head", own["embed"])] + [(PAYLOAD + k, p) for k, p in own.items()])
    live = {k: v.cuda() for k, v in bases.items()}
    rx = DeltaReceiver(live=lambda n: live["embed" if n == "lm_head" else n], held="A")
    with rx.update(run=None, version="B") as cb:
        cb.delta, cb.ran = ("A", "B"), True
        cb._apply(items)
        assert cb.figures["scattered"] == 4
        for k in bases:
            assert torch.equal(as_words(live[k].cpu()), as_words(news[k])), k
        cb.undo()
        cb.undo_log.clear()
    for k in bases:
        assert torch.equal(as_words(live[k].cpu()), as_words(bases[k])), k


@pytest.mark.parametrize("bad", [None, "body", "past the end"])
def test_pipelined_buckets_of_gap16_deltas_overlap_and_a_bad_one_writes_nothing(bad, monkeypatch):
    """``DeltaReceiver.update(pipelined=True)`` on CUDA (the default ``gaps``): each bucket's run() returns it
    unfinished, the next bucket's headers are read on a side stream while the previous bucket's kernels may
    still run, and each finish reads its checks and digests back behind an event. Two buckets of 2 % deltas of
    1M-element tensors: finished, the live tensors equal the new version. A corrupted body or a list past the
    tensor's end in the second bucket: its tensors are not written at all (the device-side guard), its finish
    names the tensor, and the update's undo gives the base back byte for byte."""
    from ckpt_core.delta.apply import DeltaReceiver
    from ckpt_core.delta.encode import encode_tensor, read_header
    from ckpt_core.delta.versions import PAYLOAD
    from ckpt_core.errors import CheckpointFormatError
    from ckpt_core.wire.worker import Unfinished

    monkeypatch.setenv("CKPT_DELTA_TRITON", "gaps")
    gen = torch.Generator().manual_seed(44)
    bases, news = {}, {}
    for i, n in enumerate([1 << 20, 999_983, 1 << 19, 1 << 20]):
        base = torch.randn(n, generator=gen).to(torch.bfloat16)
        new = base.clone()
        as_words(new)[torch.randperm(n, generator=gen)[: n // 50].sort().values] ^= 3
        bases[f"t{i}"], news[f"t{i}"] = base, new
    own = {k: encode_tensor(news[k], bases[k], force="gap16")[0] for k in bases}
    if bad == "body":
        own["t3"] = own["t3"].clone()
        own["t3"][-5] ^= 0x20
    elif bad == "past the end":   # the last gap raised past the tensor's end, the body's check made to match
        from ckpt_core.delta import encode as enc
        header, start = read_header(own["t3"])
        body = own["t3"][start:].clone().numpy()
        body[: 2 * header["count"]].view("<u2")[-1] = 65535
        own["t3"] = enc._payload({k: v for k, v in header.items() if k not in ("body", "check")}, body)
    buckets = [_packed([(PAYLOAD + k, own[k]) for k in ("t0", "t1")]),
               _packed([(PAYLOAD + k, own[k]) for k in ("t2", "t3")])]
    live = {k: v.cuda() for k, v in bases.items()}
    rx = DeltaReceiver(live=live.get, held="A")
    try:
        with rx.update(run=None, version="B", pipelined=True) as cb:
            cb.delta, cb.ran = ("A", "B"), True
            outs = [cb.run(b) for b in buckets]
            assert all(isinstance(o, Unfinished) for o in outs)
            torch.cuda.synchronize()
            written = {k for k in bases if not torch.equal(as_words(live[k].cpu()), as_words(bases[k]))}
            for o in outs:
                o.finish()
    except CheckpointFormatError as exc:
        assert bad is not None and "t3" in str(exc), exc
        assert written == {"t0", "t1"}, written
        for k in bases:
            assert torch.equal(as_words(live[k].cpu()), as_words(bases[k])), k
        assert rx.held == "A"
        return
    assert bad is None and rx.held == "B" and written == set(bases)
    for k in bases:
        assert torch.equal(as_words(live[k].cpu()), as_words(news[k])), k
