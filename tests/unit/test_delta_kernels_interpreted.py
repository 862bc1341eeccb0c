"""The delta's one-launch-per-bucket Triton kernels (``delta/_kernels.py``: ``lin64_rows_many``,
``scatter_swap_many``, and ``_gap_route.py``'s two passes over a bucket's gap16 lists) run by Triton's
interpreter on the CPU, against the torch ops they replace.

CI has no GPU; Triton's interpreter (``TRITON_INTERPRET=1``) runs the same kernel source with numpy,
device addresses included, so the kernels' logic (the address tables, the blocks, the masks, where old
values go) is checked on every run. ``kernels()`` answers only for CUDA devices, so the tests hand the
interpreted kernels to the code for CPU tensors; on a GPU ``tests/gpu/test_delta_kernels_gpu.py`` runs
the compiled ones. Triton reads ``TRITON_INTERPRET`` when it is imported, so each check runs in a fresh
process of its own (this file run as a script), whatever this pytest process imported before.
"""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.data import mixed_delta_bucket

from ckpt_core.delta import _kernels
from ckpt_core.delta import apply as apply_mod
from ckpt_core.delta import lin64 as lin64_mod
from ckpt_core.delta.encode import as_words, encode_tensor
from ckpt_core.delta.lin64 import ROW, lin64, lin64_many
from ckpt_core.delta.versions import PAYLOAD

CHECKS = ["row_sums", "lin64_many", "swap", "receiver", "gap_route", "pipelined"]
REPO = Path(__file__).resolve().parents[2]
_REAL = {name: getattr(_kernels, name) for name in ("lin64_rows_many", "scatter_swap_many")}


def test_under_triton_s_interpreter():
    """Every check in one process where Triton's interpreter runs the kernels (see the module's doc)."""
    pytest.importorskip("triton", reason="Triton is not installed here (scripts/_common.sh installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH"))
                                         if p)}
    done = subprocess.run([sys.executable, __file__, *CHECKS], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, out
    assert [line for line in done.stdout.splitlines() if line.startswith("PASS ")] == [f"PASS {c}" for c in CHECKS], out


def _interpreted() -> list[bool]:
    """The interpreted kernels offered for CPU tensors (``kernels()`` answers for CUDA devices only), with a
    record of the batched launches that ran (True) or fell back (False)."""
    torch.cuda.device = lambda device: contextlib.nullcontext()
    built = _kernels._build()
    assert built is not None
    _kernels.kernels = lin64_mod.kernels = apply_mod.kernels = lambda device, use="check": built
    ran: list[bool] = []
    for name, real in _REAL.items():
        for mod in (_kernels, lin64_mod, apply_mod):
            if hasattr(mod, name):
                setattr(mod, name, _spy(real, ran))
    return ran


def _spy(fn, ran):
    def call(*args):
        out = fn(*args)
        ran.append(out is not None)
        return out
    return call


def check_row_sums(interpreted):
    gen = torch.Generator().manual_seed(0)
    words = [torch.randint(-2**62, 2**62, (n,), dtype=torch.int64, generator=gen)
             for n in (ROW * 3, 5, ROW + 7, 0, 2 * ROW, ROW - 1)]
    got = _kernels.lin64_rows_many(words, lin64_mod._a(torch.device("cpu")), ROW)
    assert got is not None
    for w, rows in zip(words, got):
        want = lin64_mod._rows_torch(w.view(torch.uint8)) if w.numel() else torch.empty(0, dtype=torch.int64)
        assert torch.equal(rows, want), w.numel()


def check_lin64_many(interpreted):
    gen = torch.Generator().manual_seed(1)
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in (8 * ROW * 3, 16, 8 * ROW + 8, 0, 13)]
    ts.append(torch.randn(333, 7, generator=gen).to(torch.bfloat16))   # 4,662 bytes: a tail, the per-tensor path
    want = [lin64(t, engine="numpy") for t in ts]
    assert lin64_many(ts, engine="torch") == want
    assert interpreted == [True]
    interpreted.clear()
    lin64_mod._BATCH_BYTES, saved = 100, lin64_mod._BATCH_BYTES   # a launch per tensor or two
    try:
        assert lin64_many(ts, engine="torch") == want
    finally:
        lin64_mod._BATCH_BYTES = saved
    assert len(interpreted) >= 2 and all(interpreted)


def check_swap(interpreted):
    for word in (torch.uint8, torch.int16, torch.int32, torch.int64):
        _swap(word)
    assert interpreted == [True] * 4


def _swap(word):
    """One launch writes each tensor and returns each one's old values."""
    gen = torch.Generator().manual_seed(2)
    targets = [torch.randint(0, 100, (n,), generator=gen).to(word) for n in (5000, 3, 0, 2500, 1024)]
    bases = [t.clone() for t in targets]
    pos = [torch.randperm(t.numel(), generator=gen)[: max(t.numel() // 3, min(t.numel(), 1))].sort().values
           for t in targets]
    values = [torch.randint(100, 120, (p.numel(),), generator=gen).to(word) for p in pos]
    olds = _kernels.scatter_swap_many(targets, pos, values)
    assert olds is not None
    for t, b, p, v, old in zip(targets, bases, pos, values, olds):
        want = b.clone()
        want[p] = v
        assert torch.equal(t, want) and torch.equal(old, b[p])


def _applied_then_undone(bases, news, items, check=None):
    """``items`` applied as one bucket of a delta A -> B (the name ``tied`` is a second name of ``w0``): the live
    tensors then equal ``news`` (``check(cb)`` runs first), and the undo gives ``bases`` back byte for byte.
    Returns None, or the ``CheckpointFormatError`` of a bucket refused (then nothing was written)."""
    from ckpt_core.errors import CheckpointFormatError
    live = {k: v.clone() for k, v in bases.items()}
    rx = apply_mod.DeltaReceiver(live=lambda n: live["w0" if n == "tied" else n], held="A")
    with rx.update(run=None, version="B") as cb:
        cb.delta, cb.ran = ("A", "B"), True
        try:
            cb._apply(items)
        except CheckpointFormatError as exc:
            for k in bases:   # refused before any write
                assert torch.equal(as_words(live[k]), as_words(bases[k])), k
            cb.undo_log.clear()
            return exc
        if check is not None:
            check(cb)
        for k in bases:
            assert torch.equal(as_words(live[k]), as_words(news[k])), k
        cb.undo()
        cb.undo_log.clear()
    for k in bases:
        assert torch.equal(as_words(live[k]), as_words(bases[k])), k
    return None


def check_receiver(interpreted):
    """bf16, float32 and fp8 deltas of one bucket: one launch per item size, the live tensors equal the new
    version (the post-apply check passes, batched too), and the undo gives the base back byte for byte."""
    bases, news = mixed_delta_bucket()
    payloads = [(PAYLOAD + k, encode_tensor(news[k], bases[k])[0]) for k in bases]

    def launched(cb):
        assert cb.figures["scattered"] == len(bases)
        assert interpreted == [True] * 3   # a swap per item size (2, 4, 1); a CPU tensor's check runs numpy
    assert _applied_then_undone(bases, news, payloads, launched) is None
    # a second name of one live tensor (tied): one launch takes the first, the other is written after it, one by
    # one; the undo (in the order of the writes) gives the base back
    def one_more(cb):
        assert cb.figures["scattered"] == len(bases) + 1
    assert _applied_then_undone(bases, news, [(PAYLOAD + "tied", payloads[0][1])] + payloads, one_more) is None


def _gap_payload(new: torch.Tensor, base: torch.Tensor, edit=None) -> torch.Tensor:
    """A gap16 payload of ``new`` against ``base``; ``edit(gaps)`` changes its uint16 gaps in place first (its
    body check recomputed, so only the route's position checks can refuse it)."""
    from ckpt_core.delta import encode as enc
    payload = encode_tensor(new, base, force="gap16")[0]
    if edit is None:
        return payload
    header, start = enc.read_header(payload)
    body = payload[start:].clone().numpy()
    edit(body[: 2 * header["count"]].view("<u2"))
    return enc._payload({k: v for k, v in header.items() if k not in ("body", "check")}, body)


def check_gap_route(interpreted):
    """gap16 payloads of one bucket applied by the two passes (lists over several blocks, three item sizes, one
    payload of another encoding beside them): the live tensors equal the new version, the undo gives the base
    back; a corrupted body, a 0 gap and a list past the tensor's end are each refused naming their tensor
    before anything is written."""
    from ckpt_core.delta import _gap_route
    built = _kernels._build()
    real, _gap_route.kernels = _gap_route.kernels, lambda device, use="check": built
    try:
        _gap_route_checks(_gap_route)

        class Broken:   # a kernel that fails to build: the bucket goes the usual way, nothing lost
            word = built.word
            gap_sums = gap_swap = property(lambda self: (_ for _ in ()).throw(RuntimeError("no compiler")))
        _gap_route.kernels = lambda device, use="check": Broken()
        bases, news = mixed_delta_bucket()
        live = {k: v.clone() for k, v in bases.items()}
        rx = apply_mod.DeltaReceiver(live=live.get, held="A")
        with rx.update(run=None, version="B") as cb:
            cb.delta, cb.ran = ("A", "B"), True
            cb._apply([(PAYLOAD + k, _gap_payload(news[k], bases[k])) for k in bases])
            assert not any(isinstance(e, _gap_route.GapRoute) for e in cb.undo_log)
        for k in bases:
            assert torch.equal(as_words(live[k]), as_words(news[k])), k
        assert _kernels._STATE["failed"]
        _kernels._STATE["failed"] = False
    finally:
        _gap_route.kernels = real


def _gap_route_checks(_gap_route):
    bases, news = mixed_delta_bucket()
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(9000, generator=gen).to(torch.bfloat16)
    new = big.clone()
    as_words(new)[torch.randperm(9000, generator=gen)[:2600].sort().values] ^= 3   # 2,600 changes: 3 blocks
    bases["big"], news["big"] = big, new
    payloads = [(PAYLOAD + k, encode_tensor(news[k], bases[k], force="idx")[0] if k == "w3"
                 else _gap_payload(news[k], bases[k])) for k in bases]

    def apply(items, expect=("big", "w0", "w1", "w2")):
        def routed(cb):
            routes = [e for e in cb.undo_log if isinstance(e, _gap_route.GapRoute)]
            assert len(routes) == 1 and sorted(it.name for it in routes[0].items) == list(expect)
            assert cb.figures["scattered"] == len(items)
        return _applied_then_undone(bases, news, items, routed)

    assert apply(payloads) is None
    # a second name of one live tensor (tied): the route takes the first, the other goes the usual way
    assert apply([(PAYLOAD + "tied", payloads[0][1])] + payloads, expect=("big", "tied", "w1", "w2")) is None
    corrupt = [(n, p.clone()) for n, p in payloads]
    corrupt[-1][1][-1] ^= 0x10   # a value byte of "big"
    exc = apply(corrupt)
    assert exc is not None and "body's check" in str(exc) and "big" in str(exc), exc

    def zero(g):
        g[5] = 0

    def past_end(g):
        g[-1] = g[-1] + 9000   # the last position past the tensor's 9,000 elements (gaps stay < 65,536)
    for edit in (zero, past_end):
        bad = payloads[:-1] + [(PAYLOAD + "big", _gap_payload(news["big"], bases["big"], edit))]
        exc = apply(bad)
        assert exc is not None and "strictly increasing" in str(exc) and "big" in str(exc), (edit, exc)


def check_pipelined(interpreted):
    """A delta's buckets wholly of the gap16 route, pipelined (``DeltaReceiver.update(pipelined=True)``): run()
    returns each bucket unfinished, its writes already queued and guarded on the device by its checks' verdict.
    Finished, the live tensors equal the new version and the worker holds it. A corrupted body, a list past the
    tensor's end or a 0 gap writes nothing at all (the live tensors are the base's before anything was read
    back), and its finish names the tensor; a dropped element fails the post-apply digest; a bucket nobody
    finished is finished when the update ends; every failure leaves the base, byte for byte."""
    from ckpt_core.delta import _gap_route
    from ckpt_core.errors import CheckpointFormatError
    from ckpt_core.wire.worker import Unfinished
    built = _kernels._build()
    real, _gap_route.kernels = _gap_route.kernels, lambda device, use="check": built
    try:
        _pipelined_checks(CheckpointFormatError, Unfinished)
    finally:
        _gap_route.kernels = real


def _pipelined_checks(CheckpointFormatError, Unfinished):
    bases, news = mixed_delta_bucket()
    gen = torch.Generator().manual_seed(6)
    big = torch.randn(9000, generator=gen).to(torch.bfloat16)
    new = big.clone()
    as_words(new)[torch.randperm(9000, generator=gen)[:2600].sort().values] ^= 3   # 3 blocks of gaps
    bases["big"], news["big"] = big, new
    good = {k: (PAYLOAD + k, _gap_payload(news[k], bases[k])) for k in bases}
    first, second = ["w0", "w1", "w2"], ["w3", "big"]

    def run(buckets, finish=True, drop=False):
        """The buckets through one pipelined update; returns its error (None: committed) and the live tensors."""
        live = {k: v.clone() for k, v in bases.items()}
        rx = apply_mod.DeltaReceiver(live=live.get, held="A")
        os.environ["CKPT_TEST_DELTA_DROP_ONE"] = "1" if drop else ""
        try:
            with rx.update(run=None, version="B", pipelined=True) as cb:
                cb.delta, cb.ran = ("A", "B"), True
                outs = []
                for bucket in buckets:
                    out = cb.run(bucket)
                    assert isinstance(out, Unfinished), "a bucket wholly of the gap16 route is left unfinished"
                    outs.append(out)
                written = {k for k in live if not torch.equal(as_words(live[k]), as_words(bases[k]))}
                if finish:
                    for out in outs:
                        out.finish()
        except CheckpointFormatError as exc:
            for k in bases:   # undone, or never written
                assert torch.equal(as_words(live[k]), as_words(bases[k])), k
            assert rx.held == "A"
            return exc, written
        finally:
            os.environ.pop("CKPT_TEST_DELTA_DROP_ONE", None)
        for k in bases:
            assert torch.equal(as_words(live[k]), as_words(news[k])), k
        assert rx.held == "B" and rx.last["scattered"] == len(bases)
        return None, written

    exc, written = run([[good[k] for k in first], [good[k] for k in second]])
    assert exc is None and written == set(bases)
    exc, written = run([[good[k] for k in first], [good[k] for k in second]], finish=False)   # finished at the end
    assert exc is None

    def zero(g):
        g[5] = 0

    def past_end(g):
        g[-1] = g[-1] + 9000
    corrupt = good["big"][1].clone()
    corrupt[-1] ^= 0x10   # a value byte of "big": its body's check fails
    bad = {"body's check": corrupt, "strictly increasing": _gap_payload(news["big"], bases["big"], zero),
           "strictly increasing ": _gap_payload(news["big"], bases["big"], past_end)}
    for why, payload in bad.items():
        for finish in (True, False):
            exc, written = run([[good[k] for k in first], [good["w3"], (PAYLOAD + "big", payload)]], finish=finish)
            assert exc is not None and why.strip() in str(exc) and "big" in str(exc), (why, exc)
            assert written == set(first), (why, written)   # the bad bucket's guard held: w3 and big untouched
    exc, written = run([[good[k] for k in first], [good[k] for k in second]], drop=True)
    assert exc is not None and "do not match the version's digest" in str(exc), exc


if __name__ == "__main__":   # the checks named, in a process started with TRITON_INTERPRET=1
    for name in sys.argv[1:]:
        launches = _interpreted()
        globals()[f"check_{name}"](launches)
        assert not _kernels._STATE["failed"], "a kernel failed under the interpreter"
        print(f"PASS {name}", flush=True)
