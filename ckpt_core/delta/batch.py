"""A registration's delta, encoded for all its tensors together (``versions.DeltaVersions.encode``).

``encode_tensor`` per tensor reads the new tensor twice (compare, then its ``lin64`` digest) and the
base once, and pays numpy's and Python's per-call costs several times per tensor (a MoE checkpoint has
thousands of small tensors). Here, for every tensor whose base has its dtype and shape and whose
bytes lie 8-byte aligned in both versions' host memory:

1. **One compare of 8-byte words over spans of many tensors.** Tensors laid out alike in both
   versions' regions (successive versions of one model are) are compared as one run of uint64 words
   per span, in cache-sized blocks, the span cut into pieces over ``PS_FAULT_THREADS`` threads
   (numpy releases the GIL); each block keeps only its changed words' indices and both values.
2. **The digest from the base's.** ``lin64`` is linear in the words (``lin64.py``): the new tensor's
   sum is its base's plus ``sum (new_word - old_word) * c_i`` over the changed words only. The base's
   sums are kept on its registered checkpoint (``RegisteredCheckpoint.digests``): computed once when
   missing (the first version registered with a base against one registered whole), and a version
   registered with a base keeps its own (derived here), so along a chain of versions no tensor is
   digested whole again. Only regions this process filled (not in-place file maps, which their
   file's owner could rewrite) keep digests.
3. **Positions, gaps, runs for all tensors at once**: the changed words expanded to elements per item
   size, their gaps, largest gaps and run counts per tensor by segment reductions.

Each changed tensor's payload is then written by ``encode.encode_changes``, the code
``encode_tensor`` ends with: the bytes are the same (``tests/unit/test_delta_batch.py``). Any other
tensor (new, retyped, reshaped, unaligned, items of 16 bytes) goes through ``encode_tensor``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ckpt_core._settings import fault_threads
from ckpt_core.delta._changes import Changes
from ckpt_core.delta.encode import as_words, encode_changes, encode_tensor
from ckpt_core.delta.lin64 import ROW, _fmt, _host_ab, _sum_numpy, mix_int, raw_of
from ckpt_core.planning.buckets import TensorMeta

BLOCK_WORDS = 1 << 15          # words per compare block: 256 KiB of each version, in cache together
_PIECE_WORDS = 1 << 21         # words per thread job (16 MiB of each version)
_THREADS_MIN_WORDS = 1 << 20   # below: one thread (a pool costs more than it saves)
_SPAN_GAP = 1 << 20            # bytes between two tensors above which a span is cut (not compared)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MASK = (1 << 64) - 1


class _Pair(NamedTuple):
    at: int          # index in the registration's metas
    new: TensorMeta   # in the new version
    old: TensorMeta   # its base's (None: no base tensor of that name)


def _cacheable(ckpt, meta) -> bool:
    region = ckpt.regions.get(meta.base)
    return region is not None and region.source_check is None   # not an in-place file map


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


def _compare(new_w: np.ndarray, old_w: np.ndarray, lo: int, hi: int):
    """Changed words in ``[lo, hi)``: (indices, new words, old words), block by block."""
    idx, nw, ow = [], [], []
    mask = np.empty(min(BLOCK_WORDS, hi - lo), dtype=np.bool_)
    for s in range(lo, hi, BLOCK_WORDS):
        e = min(s + BLOCK_WORDS, hi)
        m = mask[: e - s]
        np.not_equal(new_w[s:e], old_w[s:e], out=m)
        found = np.flatnonzero(m)
        if found.size:
            found += s
            idx.append(found)
            nw.append(new_w[found])
            ow.append(old_w[found])
    return idx, nw, ow


class BatchEncoded(NamedTuple):
    results: list                  # (payload or None, info) per meta, as encode_tensor's
    digests: dict[str, int]        # lin64 sums of the new version's tensors that are known now
    phases: dict[str, float]       # seconds of each part


def encode_registration(ckpt, base_ckpt, old: dict) -> BatchEncoded:
    """``encode_tensor(new, old)`` of every tensor of ``ckpt`` (old: ``old[name]`` in ``base_ckpt``, or
    None when missing), in ``ckpt.metas`` order, with the same payloads (module doc)."""
    clock = time.perf_counter()
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - clock
        clock = now

    metas = ckpt.metas
    results: list = [None] * len(metas)
    base_sums: dict[str, int] = base_ckpt.digests
    digests: dict[str, int] = {}
    pairs = [_Pair(i, m, old.get(m.name)) for i, m in enumerate(metas)]   # type: ignore[arg-type]
    fused = [p for p in pairs if _eligible(ckpt, base_ckpt, p.new, p.old)]
    fused_ids = {p.at for p in fused}
    by_name = {p.new.name: p.new for p in fused}
    for p in pairs:   # the rest one by one, as before
        if p.at not in fused_ids:
            prev = base_ckpt.host_tensor(p.old) if p.old is not None else None
            results[p.at] = encode_tensor(ckpt.host_tensor(p.new), prev)
    lap("other")

    # 1. the compare, span by span, in pieces over threads (a job's indices: words of its span)
    jobs, where = [], []   # where: (region, the span's first word) of each job
    for span in _spans(fused):
        first, last = span[0], span[-1]
        shift = first.new.base_offset - first.old.base_offset
        start, end = first.new.base_offset, last.new.base_offset + last.new.nbytes
        new_w = _words(ckpt.regions[first.new.base].tensor, start, end)
        old_w = _words(base_ckpt.regions[first.old.base].tensor, start - shift, end - shift)
        for lo in range(0, new_w.size, _PIECE_WORDS):
            jobs.append((new_w, old_w, lo, min(lo + _PIECE_WORDS, new_w.size)))
            where.append((first.new.base, start // 8))
    total = sum(j[3] - j[2] for j in jobs)
    threads = min(fault_threads(), os.cpu_count() or 1, len(jobs)) if total >= _THREADS_MIN_WORDS else 1
    words_idx, new_vals, old_vals = [], [], []
    for (region, first_word), (i, nw, ow) in zip(where, _changed_words_each(jobs, threads)):
        for ii, a_, b_ in zip(i, nw, ow):
            words_idx.append((region, ii + first_word))
            new_vals.append(a_)
            old_vals.append(b_)
    lap("compare")

    # 2. changed words -> tensors (per region), with the tail of a tensor's last word masked out
    order = sorted(fused, key=lambda p: (p.new.base, p.new.base_offset))
    region_of = np.array([p.new.base for p in order], dtype=np.int64)
    starts = np.array([p.new.base_offset // 8 for p in order], dtype=np.int64)
    nbytes = np.array([p.new.nbytes for p in order], dtype=np.int64)
    # a global key per word: (region rank, word) so tensors of several regions sort together
    regions = sorted(set(region_of.tolist()))
    rank_of = {r: i for i, r in enumerate(regions)}
    stride = np.int64(1) << np.int64(58)
    keys_t = np.array([rank_of[r] for r in region_of.tolist()], dtype=np.int64) * stride + starts
    if words_idx:
        w = np.concatenate([np.int64(rank_of[r]) * stride + i for r, i in words_idx])
        nw = np.concatenate(new_vals)
        ow = np.concatenate(old_vals)
    else:
        w = np.empty(0, dtype=np.int64)
        nw = ow = np.empty(0, dtype=np.uint64)
    t = np.searchsorted(keys_t, w, side="right") - 1
    local = w - keys_t[np.maximum(t, 0)]
    inside = (t >= 0) & (local * 8 < nbytes[np.maximum(t, 0)])
    t, local, nw, ow = t[inside], local[inside], nw[inside], ow[inside]
    valid_bytes = np.minimum(nbytes[t] - local * 8, 8)
    partial = valid_bytes < 8
    if partial.any():
        keep = np.full(t.size, np.uint64(_MASK), dtype=np.uint64)
        keep[partial] = (np.uint64(1) << (valid_bytes[partial].astype(np.uint64) * np.uint64(8))) - np.uint64(1)
        nw, ow = nw & keep, ow & keep
        real = nw != ow
        t, local, nw, ow = t[real], local[real], nw[real], ow[real]
    lap("map")

    # 3. digests: the base's sum plus the changed words' differences times their coefficients
    changed_t = np.flatnonzero(np.diff(t, prepend=-1)) if t.size else np.empty(0, dtype=np.int64)
    tensors_changed = t[changed_t]
    sums_delta: dict[int, int] = {}
    if t.size:
        a, b = _host_ab(int(local.max()) + 1)
        with np.errstate(over="ignore"):
            coef = a[local % ROW] * b[local // ROW]
            terms = (nw - ow) * coef
        for ti, s in zip(tensors_changed.tolist(), np.add.reduceat(terms, changed_t).tolist()):
            sums_delta[ti] = int(s)
    for ti, p in enumerate(order):
        name = p.new.name
        keep = _cacheable(base_ckpt, p.old)
        known = base_sums.get(name) if keep else None
        if ti in sums_delta or known is not None:
            if known is None:
                known = _sum_numpy(raw_of(base_ckpt.host_tensor(p.old))[0])
                if keep:
                    base_sums[name] = known
            digests[name] = (known + sums_delta.get(ti, 0)) & _MASK
    lap("digest")

    # 4. element positions per item size, then gaps, largest gap and runs per tensor
    size_t = np.array([p.new.itemsize for p in order], dtype=np.int64)
    numel_t = nbytes // np.maximum(size_t, 1)
    pos_parts, tid_parts = [], []
    for size in sorted(set(size_t[t].tolist())) if t.size else []:
        sel = size_t[t] == size
        k_per = 8 // size
        nv = nw[sel].view(_UINT[size]).reshape(-1, k_per)
        ov = ow[sel].view(_UINT[size]).reshape(-1, k_per)
        elem = local[sel][:, None] * k_per + np.arange(k_per, dtype=np.int64)
        ts = t[sel]
        ok = (nv != ov) & (elem < numel_t[ts][:, None])
        pos_parts.append(elem[ok])
        tid_parts.append(np.broadcast_to(ts[:, None], ok.shape)[ok])
    if pos_parts:
        tid = np.concatenate(tid_parts)
        pos = np.concatenate(pos_parts)
        if len(pos_parts) > 1:   # tensors of several item sizes: back in tensor order (stable: positions stay sorted)
            o = np.argsort(tid, kind="stable")
            tid, pos = tid[o], pos[o]
    else:
        tid = pos = np.empty(0, dtype=np.int64)
    firsts = np.flatnonzero(np.diff(tid, prepend=-1)) if tid.size else np.empty(0, dtype=np.int64)
    gaps = np.empty_like(pos)
    if pos.size:
        gaps[0] = pos[0]
        np.subtract(pos[1:], pos[:-1], out=gaps[1:])
        gaps[firsts] = pos[firsts]
        breaks = (gaps != 1).astype(np.int64)
        breaks[firsts] = 1
        max_gaps = np.maximum.reduceat(gaps, firsts).tolist()
        runs = np.add.reduceat(breaks, firsts).tolist()
    else:
        max_gaps, runs = [], []
    ends = np.append(firsts[1:], pos.size).tolist()
    lap("positions")

    # 5. payloads
    seg = {ti: (s, e, mg, r) for ti, s, e, mg, r in zip(tid[firsts].tolist(), firsts.tolist(), ends, max_gaps, runs)}
    for ti, p in enumerate(order):
        got = seg.get(ti)
        numel = int(numel_t[ti])
        if got is None:
            results[p.at] = (None, {"encoding": None, "count": 0, "numel": numel, "bytes": 0})
            continue
        s, e, mg, r = got
        new = ckpt.host_tensor(p.new)
        ch = Changes(pos[s:e], gaps[s:e], mg, r)
        digest = _fmt(digests[p.new.name] + mix_int((p.new.nbytes << 5) | p.new.itemsize))
        results[p.at] = encode_changes(new, as_words(new).numpy(), p.new.dtype, ch, digest)
    lap("payloads")
    return BatchEncoded(results, {n: d for n, d in digests.items() if _cacheable(ckpt, by_name[n])}, phases)


def _changed_words_each(jobs, threads: int) -> list:
    """``_compare`` of each job, on ``threads`` threads when more than one, results in order."""
    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-delta-compare") as pool:
            return list(pool.map(lambda j: _compare(*j), jobs))
    return [_compare(*j) for j in jobs]


__all__ = ["BatchEncoded", "encode_registration"]
