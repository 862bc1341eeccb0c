"""A registration's delta, encoded for all its tensors together (``versions.DeltaVersions.encode``).

``encode_tensor`` per tensor reads the new tensor twice (compare, then its ``lin64`` digest) and the
base once, and pays numpy's and Python's per-call costs many times per tensor (a MoE checkpoint has
thousands of small tensors). Here, for every tensor whose base has its dtype and shape and whose
bytes lie 8-byte aligned in both versions' host memory:

1. **The digest from the base's.** ``lin64`` is linear in the words (``lin64.py``): the new tensor's
   sum is its base's plus ``sum (new_word - old_word) * c_i`` over the changed words only. The base's
   sums are kept on its registered checkpoint (``RegisteredCheckpoint.digests``), and a version
   registered with a base keeps its own, so along a chain of versions no small tensor is digested
   whole again (a base registered whole has none at first: they are computed then, once, and kept).
   Large tensors (``LARGE_BYTES``) are derived too by the compiled pass (``_scan.scan(derive=True)``:
   the change summed over the changed words it visits anyway; dense16 x0.05 on the 2-core machine,
   compare 226 -> 160 ms) when their base's sum is kept, else digested block by block as they are
   compared (their bytes read once): in numpy that streaming pass costs less than the derivation's
   gathers. Only
   regions this process filled keep sums (not in-place file maps, which their file's owner could
   rewrite): nothing writes them, so a kept sum stays the sum of the bytes the next compare reads.
2. **Small tensors (below ``LARGE_BYTES``) batched.** Tensors laid out alike in both versions' regions
   (successive versions of one model are) are compared as one run of uint64 words per span, in
   cache-sized blocks, the span cut into pieces over ``PS_FAULT_THREADS`` threads (numpy releases the
   GIL); each piece maps its changed words to tensors, sums their lin64 change, and expands them to
   changed elements per item size. Gaps, largest gaps and run counts then come for all tensors at
   once by segment reductions, the encodings are chosen for all at once (``Sizes.best``'s rule), and
   the ``idx`` and ``gap16`` payloads (the usual ones) are written together into one buffer
   (``Encoded.payload_list``, ``_Vector.write``: headers formatted as ``encode.Planned.write`` writes them,
   each section and the values by one scatter, the body checks as one segmented ``lin64``).
3. **Large tensors on their own**, one per thread job: ``_changes.changed_positions`` block by block in
   cache, each changed block digested while there, ``encode._encoded``.

Every payload is byte for byte ``encode_tensor``'s (``encode._encoded`` is its second half, and
``tests/unit/test_delta_batch.py`` compares them over dtypes, densities, shapes and encodings). Any
other tensor (new, retyped, reshaped, unaligned, items of 16 bytes) goes through ``encode_tensor``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ckpt_core._settings import delta_threads
from ckpt_core.delta._changes import Changes, changed_positions
from ckpt_core.delta._direct_payload import plan
from ckpt_core.delta._payload_vector import _MASK, _ROW_BITS, _UINT, _VECTOR, Encoded, _size_term, _Vector
from ckpt_core.delta._scan import kernel, scan, span_changes
from ckpt_core.delta.encode import _encoded, as_words, encode_tensor
from ckpt_core.delta.lin64 import ROW, HostDigest, _fmt, _host_ab, _sum_numpy, raw_of
from ckpt_core.planning.buckets import TensorMeta
from ckpt_core.planning.pieces import meta_key

BLOCK_WORDS = 1 << 15          # words per compare block: 256 KiB of each version, in cache together
_PIECE_WORDS = 1 << 20         # words per thread job (8 MiB of each version): long enough that the Python
                               # around each job's compiled pass holds the GIL a small fraction of the time
_THREADS_MIN_WORDS = 1 << 20   # below: one thread (a pool costs more than it saves)
_SPAN_GAP = 1 << 20
# tensors from this size are encoded each on its own, block by block (their changes found and digested
# in cache, where the batched path's arrays of every changed word outgrow the caches); below it they are
# batched (per-tensor numpy calls on threads contend for the GIL: moe8 x0.05, 87 KB tensors, 2 threads
# under load: 4.6 s with 64 KiB here, 0.84 s with 1 MiB; dense16 x0.005, 220 KB tensors, one thread:
# 84 ms on their own, 107 ms batched)
LARGE_BYTES = 1 << 20


class _Pair(NamedTuple):
    at: int          # index in the registration's metas
    new: TensorMeta   # in the new version
    old: TensorMeta   # its base's (None: no base tensor of that name)


def _cacheable_regions(ckpt) -> set[int]:
    """Regions whose tensors' lin64 sums may be kept: filled here, not in-place file maps (their file's
    owner could rewrite them)."""
    return {rid for rid, region in ckpt.regions.items() if region.source_check is None}


def _eligible(ckpt, base_ckpt, new, old) -> bool:
    return (old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape)
            and new.itemsize in _UINT and new.nbytes > 0 and new.base_offset % 8 == 0 and old.base_offset % 8 == 0
            and new.base in ckpt.regions and old.base in base_ckpt.regions)


def _spans(pairs: list[_Pair]) -> list[list[_Pair]]:
    """Runs of tensors laid out alike in both versions (same regions, same distance between their
    offsets, little room between them), in the new version's order."""
    spans: list[list[_Pair]] = []
    for p in sorted(pairs, key=lambda p: (p.new.base, p.new.base_offset)):
        if spans:
            q = spans[-1][-1]
            if (q.new.base == p.new.base and q.old.base == p.old.base
                    and q.new.base_offset - q.old.base_offset == p.new.base_offset - p.old.base_offset
                    and 0 <= p.new.base_offset - (q.new.base_offset + q.new.nbytes) <= _SPAN_GAP):
                spans[-1].append(p)
                continue
        spans.append([p])
    return spans


def _words(region_tensor: torch.Tensor, start: int, end: int) -> np.ndarray:
    """Bytes ``[start, end)`` of a region (8-byte aligned ``start``) as uint64 words, the last one
    whole even if ``end`` falls inside it (regions' tensors start 8-aligned; the padding after a
    tensor's last byte is masked out by the caller)."""
    end8 = min(-(-end // 8) * 8, region_tensor.numel())
    raw = region_tensor[start:end8].numpy()
    n = raw.size // 8
    if n * 8 < raw.size:   # the region ends inside the word: a padded copy of the last word
        out = np.zeros(n + 1, dtype=np.uint64)
        out[:n] = raw[: 8 * n].view(np.uint64)
        out.view(np.uint8)[8 * n: raw.size] = raw[8 * n:]
        return out
    return raw.view(np.uint64)


class _Span(NamedTuple):
    """Tensors laid out alike in both versions, compared as one run of words: the new and old words, and
    per tensor (in order) its index in the encode's order, first word (in the run), bytes, item size."""
    new_w: np.ndarray
    old_w: np.ndarray
    tensors: np.ndarray   # int64, the encode's order
    starts: np.ndarray    # int64 words from the run's start
    nbytes: np.ndarray
    sizes: np.ndarray
    tails: bool           # some word of the run is not wholly a tensor's (a tensor's odd end, padding)


def _changed_words_numpy(new_w: np.ndarray, old_w: np.ndarray, lo: int, hi: int):
    """The indices of the words ``[lo, hi)`` that differ, and their new and old words: numpy, block by
    block (each block compared while in cache; its changed words kept)."""
    idx, nws, ows = [], [], []
    mask = np.empty(min(BLOCK_WORDS, hi - lo), dtype=np.bool_)
    for s in range(lo, hi, BLOCK_WORDS):
        e = min(s + BLOCK_WORDS, hi)
        m = mask[: e - s]
        np.not_equal(new_w[s:e], old_w[s:e], out=m)
        found = np.flatnonzero(m)
        if found.size:
            found += s
            idx.append(found)
            nws.append(new_w[found])
            ows.append(old_w[found])
    if not idx:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
    return np.concatenate(idx), np.concatenate(nws), np.concatenate(ows)


def _job(span: _Span, lo: int, hi: int, a: np.ndarray, b: np.ndarray):
    """Words ``[lo, hi)`` of a span: the positions of its changed elements (in order), its changed tensors
    (in order), each one's number of changed elements and ``sum (new_word - old_word) * c_i`` (lin64's, mod
    2**64); on a thread."""
    new_w, old_w = span.new_w, span.old_w
    lib = kernel()
    if lib is not None:   # all of it in one compiled pass (_scan.py)
        pos, dt, counts, dsum = span_changes(lib, new_w, old_w, lo, hi, span.starts, span.nbytes, span.sizes, a, b)
        return pos, span.tensors[dt], counts, dsum
    w, nw, ow = _changed_words_numpy(new_w, old_w, lo, hi)
    empty = np.empty(0, dtype=np.int64)
    if not w.size:
        return empty, empty, empty, np.empty(0, dtype=np.uint64)
    t = np.searchsorted(span.starts, w, side="right") - 1   # the tensor of each word (spans start with one)
    local = w - span.starts[t]
    tail = (span.nbytes[t] - local * 8 < 8) if span.tails else None   # a tensor's last word, or padding after it
    if tail is not None and tail.any():   # only the tensor's own bytes count: the rest masked out of both
        valid = np.maximum(span.nbytes[t[tail]] - local[tail] * 8, 0).astype(np.uint64)
        keep = (np.uint64(1) << (valid * np.uint64(8))) - np.uint64(1)   # valid < 8 bytes
        nw[tail] &= keep
        ow[tail] &= keep
        real = nw != ow
        w, t, local, nw, ow = w[real], t[real], local[real], nw[real], ow[real]
        if not t.size:
            return empty, empty, empty, np.empty(0, dtype=np.uint64)
    # lin64: each changed tensor's change of sum
    firsts = np.flatnonzero(np.diff(t, prepend=-1))
    with np.errstate(over="ignore"):
        terms = (nw - ow) * (a[local & (ROW - 1)] * b[local >> _ROW_BITS])
    dsum = np.add.reduceat(terms, firsts)
    dt = span.tensors[t[firsts]]
    # elements: per item size, element k of a changed word whose k-th item differs
    groups = np.unique(span.sizes[t[firsts]]).tolist()   # the item sizes of the changed tensors
    sizes = span.sizes[t] if len(groups) > 1 else None
    tids, poss = [], []
    for size in groups:
        sel = sizes == size if sizes is not None else slice(None)
        k_per = 8 // size
        hit = np.flatnonzero(nw[sel].view(_UINT[size]) != ow[sel].view(_UINT[size]))
        row = hit // k_per
        poss.append(local[sel][row] * k_per + (hit - row * k_per))
        tids.append(t[sel][row])
    tid, pos = (np.concatenate(tids), np.concatenate(poss)) if len(tids) > 1 else (tids[0], poss[0])
    if len(tids) > 1:   # back in tensor order (stable: each tensor's positions stay sorted)
        o = np.argsort(tid, kind="stable")
        tid, pos = tid[o], pos[o]
    counts = np.diff(np.append(np.flatnonzero(np.diff(tid, prepend=-1)), tid.size))   # per changed tensor
    return pos, dt, counts, dsum


def _large(ckpt, base_ckpt, p: _Pair):
    """A large tensor on its own (one thread): its changed positions found block by block in cache
    (``_changes.changed_positions``) and, once a block changed, each block digested while in cache (its
    bytes read once: on large tensors this streaming ``lin64`` costs less than deriving the sum from
    the base's over the changed words, which numpy does in a dozen passes of gathers: 2 % of a 8 MiB
    bf16 tensor, 1.0 ms against 6.6 ms). Returns ``(payload or None, info, its lin64 sum or None)``,
    with ``encode_tensor``'s payload."""
    new, prev = ckpt.host_tensor(p.new), base_ckpt.host_tensor(p.old)
    words = as_words(new).numpy()
    size = p.new.itemsize
    lib = kernel()
    if lib is not None:   # changes and digest in one compiled pass (_scan.py); unchanged: its sum kept too
        raw = raw_of(new)[0].numpy()
        keep = p.old.base in _cacheable_regions(base_ckpt)
        known = base_ckpt.digests.get(meta_key(p.new)) if keep else None
        positions, change, old_sum = scan(lib, raw, raw_of(prev)[0].numpy(), size, *_host_ab(raw.size // 8),
                                          derive=known is not None)
        if old_sum is not None:   # the base's sum, found on the way: kept for the next version's derivation
            known = old_sum
            if keep:
                base_ckpt.digests[meta_key(p.new)] = old_sum
        total = (int(known or 0) + change) & _MASK   # the base's sum plus the change over the changed words
        if positions.size == 0:
            return None, {"encoding": None, "count": 0, "numel": p.new.nbytes // size, "bytes": 0}, total
        digest = _fmt(total + _size_term(p.new.nbytes, size))
        direct, info = plan(lib, p.new, raw, positions, digest)   # idx, gap16: written into the companion later
        if direct is not None:
            return direct, info, total
        return (*_encoded(new, words, Changes.of(positions), digest, None), total)
    host = HostDigest(new)

    def digest_block(end: int, changed: bool) -> None:   # once it changed: each block as it is compared
        if changed:
            host.upto(end * size)
    positions = changed_positions(words, as_words(prev).numpy(), digest_block)
    if positions.size == 0:
        return None, {"encoding": None, "count": 0, "numel": p.new.nbytes // size, "bytes": 0}, None
    digest = host.digest()
    total = (int(digest[len("lin64:"):], 16) - _size_term(p.new.nbytes, size)) & _MASK
    payload, info = _encoded(new, words, Changes.of(positions), digest, None)
    return payload, info, total


def _run_jobs(jobs, threads: int, large=()) -> tuple[list, list]:
    """The span jobs' results, and the large tensors' (``(fn, args)`` each), on ``threads`` threads."""
    if threads > 1 and len(jobs) + len(large) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-delta-compare") as pool:
            big = [pool.submit(fn, *args) for fn, args in large]   # the long ones first
            return list(pool.map(lambda j: _job(*j), jobs)), [f.result() for f in big]
    return [_job(*j) for j in jobs], [fn(*args) for fn, args in large]


def encode_registration(ckpt, base_ckpt, old: dict) -> Encoded:
    """``encode_tensor(new, old)`` of every tensor of ``ckpt`` (old: ``old[meta_key(meta)]`` in ``base_ckpt``:
    a whole tensor's of its name, a piece's of its box; None when missing), in ``ckpt.metas`` order, with the
    same payloads (module doc). Digests (``base_ckpt.digests``, the result's) are keyed by ``meta_key`` too."""
    clock = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock
        clock = now

    metas = ckpt.metas
    results: list = [None] * len(metas)
    pairs = [_Pair(i, m, old.get(meta_key(m))) for i, m in enumerate(metas)]   # type: ignore[arg-type]
    eligible = [p for p in pairs if _eligible(ckpt, base_ckpt, p.new, p.old)]
    by_name = {meta_key(p.new): p.new for p in eligible}
    batched = {p.at for p in eligible}
    for p in pairs:   # the rest one by one, as before
        if p.at not in batched:
            prev = base_ckpt.host_tensor(p.old) if p.old is not None else None
            results[p.at] = encode_tensor(ckpt.host_tensor(p.new), prev)
    lap("other")

    large = [p for p in eligible if p.new.nbytes >= LARGE_BYTES]
    order, parts, done = _compare(ckpt, base_ckpt, [p for p in eligible if p.new.nbytes < LARGE_BYTES], large)
    digests: dict[str, int] = {}
    for p, (payload, info, total_sum) in zip(large, done):
        results[p.at] = (payload, info)
        if total_sum is not None:
            digests[meta_key(p.new)] = total_sum
    lap("compare")
    _derive_digests(base_ckpt, order, parts, digests)
    lap("digest")
    found = _positions(parts, order)
    lap("positions")
    vec, payloads = _encode_changed(ckpt, order, found, digests, results)
    lap("payloads")
    keep_new = _cacheable_regions(ckpt)
    return Encoded([info for _, info in results], payloads, vec,
                   {n: d for n, d in digests.items() if by_name[n].base in keep_new}, phases)


def _compare(ckpt, base_ckpt, fused: list[_Pair], large: list[_Pair]):
    """Spans of tensors laid out alike, each cut into pieces, and the large tensors: one job each, over
    threads. Returns the batched tensors' order, the span jobs' results (in order) and the large ones'."""
    order: list[_Pair] = []
    jobs = []
    longest = 1
    for group in _spans(fused):
        first, last = group[0], group[-1]
        shift = first.new.base_offset - first.old.base_offset
        start, end = first.new.base_offset, last.new.base_offset + last.new.nbytes
        span = _Span(_words(ckpt.regions[first.new.base].tensor, start, end),
                     _words(base_ckpt.regions[first.old.base].tensor, start - shift, end - shift),
                     np.arange(len(order), len(order) + len(group), dtype=np.int64),
                     np.array([(p.new.base_offset - start) // 8 for p in group], dtype=np.int64),
                     np.array([p.new.nbytes for p in group], dtype=np.int64),
                     np.array([p.new.itemsize for p in group], dtype=np.int64),
                     any(p.new.nbytes % 8 or (q is not None and q.new.base_offset != p.new.base_offset + p.new.nbytes)
                         for p, q in zip(group, [*group[1:], None])))
        order += group
        longest = max(longest, max(p.new.nbytes for p in group) // 8 + 1)
        for lo in range(0, span.new_w.size, _PIECE_WORDS):
            jobs.append([span, lo, min(lo + _PIECE_WORDS, span.new_w.size)])
    a, b = _host_ab(longest)
    for j in jobs:
        j += [a, b]
    total = sum(j[2] - j[1] for j in jobs)
    total += sum(p.new.nbytes // 8 for p in large)
    threads = min(delta_threads(), os.cpu_count() or 1, len(jobs) + len(large)) if total >= _THREADS_MIN_WORDS else 1
    parts, done = _run_jobs(jobs, threads, [(_large, (ckpt, base_ckpt, p)) for p in large])
    return order, parts, done


def _derive_digests(base_ckpt, order: list[_Pair], parts: list, digests: dict[str, int]) -> None:
    """Each batched tensor's sum into ``digests``: its base's plus its change (a tensor cut between jobs:
    its parts added); a base's sum not kept yet is computed and kept where its region allows it."""
    base_sums: dict[str, int] = base_ckpt.digests
    keep_base = _cacheable_regions(base_ckpt)
    change: dict[int, int] = {}
    for _, dt, _, dsum in parts:
        for ti, d in zip(dt.tolist(), dsum.tolist()):
            change[ti] = change.get(ti, 0) + d
    for ti, p in enumerate(order):
        name = meta_key(p.new)
        keep = p.old.base in keep_base
        known = base_sums.get(name) if keep else None
        if ti in change or known is not None:
            if known is None:
                known = _sum_numpy(raw_of(base_ckpt.host_tensor(p.old))[0])
                if keep:
                    base_sums[name] = known
            digests[name] = (known + change.get(ti, 0)) & _MASK


class _Found(NamedTuple):
    """The batched tensors' changed elements: per element its position and gap to the previous one (its
    position for a tensor's first), in tensor order; per changed tensor (``ct``, in order) its first
    element's index, count, largest gap and runs; per tensor its elements and item size."""
    ct: np.ndarray
    pos: np.ndarray
    gaps: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    max_gaps: np.ndarray
    runs: np.ndarray
    numel_t: np.ndarray
    size_t: np.ndarray


def _positions(parts: list, order: list[_Pair]) -> _Found:
    """Gaps, largest gap and runs per changed tensor, by segment reductions over every changed element."""
    empty = np.empty(0, dtype=np.int64)
    if len(parts) == 1:
        pos, ct, counts = parts[0][0], parts[0][1], parts[0][2]
    else:
        pos, ct, counts = (np.concatenate([q[k] for q in parts]) if parts else empty for k in range(3))
    if ct.size > 1:   # a tensor cut between jobs is in both: one entry
        keep = np.flatnonzero(np.diff(ct, prepend=-1))
        if keep.size < ct.size:
            ct, counts = ct[keep], np.add.reduceat(counts, keep)
    nbytes = np.array([p.new.nbytes for p in order], dtype=np.int64)
    size_t = np.array([p.new.itemsize for p in order], dtype=np.int64)
    numel_t = nbytes // np.maximum(size_t, 1)
    counts = counts.astype(np.int64, copy=False)
    firsts = np.cumsum(counts) - counts
    gaps = np.empty_like(pos)
    if pos.size:
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[firsts] = pos[firsts]
        breaks = (gaps != 1).astype(np.int64)
        breaks[firsts] = 1
        max_gaps = np.maximum.reduceat(gaps, firsts)
        runs = np.add.reduceat(breaks, firsts)
    else:
        max_gaps = runs = empty
    return _Found(ct, pos, gaps, firsts, counts, max_gaps, runs, numel_t, size_t)


def _encode_changed(ckpt, order: list[_Pair], f: _Found, digests: dict[str, int], results: list):
    """Each changed tensor's encoding: ``idx`` and ``gap16`` bodies planned for all tensors at once
    (written by ``Encoded.write``), the others encoded one by one (``encode._encoded``); ``results``
    filled. Returns the plan and every payload made here or before (meta index -> payload)."""
    ct = f.ct   # changed tensors, in ``order``
    vec = _Vector.plan(order, ct, f.counts, f.max_gaps, f.runs, f.numel_t, f.size_t)
    payloads: dict[int, torch.Tensor] = {}
    for ti, p in enumerate(order):
        results[p.at] = (None, {"encoding": None, "count": 0, "numel": int(f.numel_t[ti]), "bytes": 0})
    bodies = vec.sizes[vec.enc, np.arange(ct.size)].tolist()
    lists = (ct.tolist(), f.firsts.tolist(), f.counts.tolist(), f.max_gaps.tolist(), f.runs.tolist(),
             vec.enc.tolist(), bodies)
    for c, (ti, s, n, mg, r, enc, body) in enumerate(zip(*lists)):
        p = order[ti]
        digest = _fmt(digests[meta_key(p.new)] + _size_term(p.new.nbytes, p.new.itemsize))
        if enc in _VECTOR:
            results[p.at] = vec.header(c, p.at, p.new, digest, enc, body, n)
            continue
        new = ckpt.host_tensor(p.new)
        ch = Changes(f.pos[s: s + n], f.gaps[s: s + n], mg, r)
        payload, info = _encoded(new, as_words(new).numpy(), ch, digest, None)
        payloads[p.at] = payload
        results[p.at] = (None, info)
    vec.elements(f.pos, f.gaps, f.firsts)
    for i, (payload, _) in enumerate(results):
        if payload is not None:   # encode_tensor's (the tensors not batched)
            payloads[i] = payload
    return vec, payloads


__all__ = ["Encoded", "encode_registration"]
