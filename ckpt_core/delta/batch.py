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

import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ckpt_core._settings import fault_threads
from ckpt_core.delta._changes import Changes
from ckpt_core.delta.encode import ENCODINGS, MAGIC, MAX_GAP16, as_words, encode_changes, encode_tensor
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


def encode_registration(ckpt, base_ckpt, old: dict) -> Encoded:
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

    # 4. element positions per item size (the masked tails hold no change), then gaps, largest gap, runs
    size_t = np.array([p.new.itemsize for p in order], dtype=np.int64)
    numel_t = nbytes // np.maximum(size_t, 1)
    pos_parts, tid_parts = [], []
    for size in sorted(set(size_t[t].tolist())) if t.size else []:
        sel = size_t[t] == size
        k_per = 8 // size
        hit = np.flatnonzero(nw[sel].view(_UINT[size]) != ow[sel].view(_UINT[size]))   # element k of word hit // k
        row = hit // k_per
        pos_parts.append(local[sel][row] * k_per + (hit - row * k_per))
        tid_parts.append(t[sel][row])
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
        max_gaps = np.maximum.reduceat(gaps, firsts)
        runs = np.add.reduceat(breaks, firsts)
    else:
        max_gaps = runs = np.empty(0, dtype=np.int64)
    counts = np.diff(np.append(firsts, pos.size))
    lap("positions")

    # 5. each changed tensor's encoding; idx and gap16 bodies are written for all tensors at once
    # (``Encoded.write``), the others one by one (``encode_changes``)
    ct = tid[firsts]   # changed tensors, in ``order``
    vec = _Vector.plan(order, ct, counts, max_gaps, runs, numel_t, size_t)
    payloads: dict[int, torch.Tensor] = {}
    for ti, p in enumerate(order):
        results[p.at] = (None, {"encoding": None, "count": 0, "numel": int(numel_t[ti]), "bytes": 0})
    lists = (ct.tolist(), firsts.tolist(), counts.tolist(), max_gaps.tolist(), runs.tolist(), vec.enc.tolist())
    for c, (ti, s, n, mg, r, enc) in enumerate(zip(*lists)):
        p = order[ti]
        digest = _fmt(digests[p.new.name] + mix_int((p.new.nbytes << 5) | p.new.itemsize))
        if enc in _VECTOR:
            results[p.at] = vec.header(c, p.at, p.new, digest)
            continue
        new = ckpt.host_tensor(p.new)
        ch = Changes(pos[s: s + n], gaps[s: s + n], mg, r)
        payload, info = encode_changes(new, as_words(new).numpy(), p.new.dtype, ch, digest)
        payloads[p.at] = payload
        results[p.at] = (None, info)
    vec.elements(pos, gaps, firsts, counts)
    for i, (payload, _) in enumerate(results):
        if payload is not None:   # encode_tensor's (the tensors not batched)
            payloads[i] = payload
    lap("payloads")
    return Encoded([info for _, info in results], payloads, vec,
                   {n: d for n, d in digests.items() if _cacheable(ckpt, by_name[n])}, phases)


_VECTOR = (ENCODINGS.index("idx"), ENCODINGS.index("gap16"))
_PLACEHOLDER = "lin64:" + "0" * 16   # a body check's place in a header (same length as any check)


def _align8(x):
    return (x + 7) & ~7


class _Vector:
    """The changed tensors' encodings (indices in ``ENCODINGS``, chosen as ``Sizes.best`` does: the
    smallest body, the first of equal ones) and, for those encoded ``idx`` or ``gap16``, their headers
    and their elements, to write all their payloads together (``write``)."""

    def __init__(self, enc, sizes, width, counts, numel, size):
        self.enc, self.sizes, self.width, self.counts, self.numel, self.size = enc, sizes, width, counts, numel, size
        # per batched tensor: (changed tensor, meta index, header bytes, header length, body bytes, region, offset)
        self.heads: list[tuple[int, int, bytes, int, int, int, int]] = []
        self.elems: tuple | None = None

    @classmethod
    def plan(cls, order, ct, counts, max_gaps, runs, numel_t, size_t) -> _Vector:
        numel, size = numel_t[ct], size_t[ct]
        width = np.where(numel < 2 ** 31, 4, 8)
        values = _align8(counts * size)
        big = np.int64(1) << np.int64(62)
        sizes = np.stack([_align8(numel * size), _align8(counts * width) + values,
                          np.where(max_gaps <= MAX_GAP16, _align8(counts * 2) + values, big),
                          _align8((numel + 7) // 8) + values, 2 * _align8(runs * width) + values]).reshape(5, -1)
        enc = np.argmin(sizes, axis=0)   # the first of equal sizes: the order of ENCODINGS
        return cls(enc, sizes, width, counts, numel, size)

    def header(self, c: int, at: int, meta, digest: str) -> tuple[None, dict]:
        """Changed tensor ``c`` (``meta``, at ``at`` in the metas) batched: its header (its body's check to
        come) and ``encode_tensor``'s info of it."""
        enc = int(self.enc[c])
        body, count = int(self.sizes[enc, c]), int(self.counts[c])
        header = {"dtype": meta.dtype, "shape": list(meta.shape), "enc": ENCODINGS[enc], "count": count, "runs": 0,
                  "digest": digest, "body": body, "check": _PLACEHOLDER}   # encode._payload's, in its order
        text = json.dumps(header, separators=(",", ":")).encode()
        head = MAGIC + struct.pack("<I", len(text)) + text
        head += b" " * (_align8(len(head)) - len(head))
        self.heads.append((c, at, head, 8 + len(text) - 18, body, meta.base, meta.base_offset))
        return None, {"encoding": ENCODINGS[enc], "count": count, "numel": int(self.numel[c]),
                      "bytes": len(head) + body}

    def elements(self, pos: np.ndarray, gaps: np.ndarray, firsts: np.ndarray, counts: np.ndarray) -> None:
        """Keep the batched tensors' elements: (which of ``heads``, rank in its tensor, position, gap)."""
        which = np.full(counts.size, -1, dtype=np.int64)
        for k, h in enumerate(self.heads):
            which[h[0]] = k
        c_of = np.repeat(np.arange(counts.size), counts)
        keep = which[c_of] >= 0
        rank = np.arange(pos.size, dtype=np.int64) - np.repeat(firsts, counts)
        self.elems = (which[c_of][keep], rank[keep], pos[keep], gaps[keep])

    def write(self, buf: np.ndarray, offsets: dict[int, int], regions: dict[int, np.ndarray]) -> None:
        """Write the batched payloads into ``buf`` (zeroed, uint8, a multiple of 8 bytes long), each at
        ``offsets[meta index]`` (8-byte aligned); ``regions``: the new version's regions' bytes."""
        if not self.heads or self.elems is None:
            return
        k, rank, pos, gaps = self.elems
        c = np.array([h[0] for h in self.heads], dtype=np.int64)
        start = np.array([offsets[h[1]] + len(h[2]) for h in self.heads], dtype=np.int64)   # each body's start
        body = np.array([h[4] for h in self.heads], dtype=np.int64)
        enc, width, size = self.enc[c], self.width[c], self.size[c]
        index_bytes = np.where(enc == ENCODINGS.index("gap16"), _align8(self.counts[c] * 2),
                               _align8(self.counts[c] * width))
        mv = memoryview(buf)
        for (_, at, head, _, _, _, _) in self.heads:
            mv[offsets[at]: offsets[at] + len(head)] = head
        n8 = buf.size // 8 * 8
        ek = enc[k]
        g = ek == ENCODINGS.index("gap16")
        buf[:n8].view(np.uint16)[(start[k[g]] >> 1) + rank[g]] = gaps[g]
        for w, dt in ((4, np.int32), (8, np.int64)):
            sel = (~g) & (width[k] == w)
            if sel.any():
                buf[:n8].view(dt)[start[k[sel]] // w + rank[sel]] = pos[sel]
        values_at = start + index_bytes
        src_region = np.array([h[5] for h in self.heads], dtype=np.int64)
        src_off = np.array([h[6] for h in self.heads], dtype=np.int64)
        for s in sorted(set(size.tolist())):
            for r in sorted(set(src_region.tolist())):
                sel = (size[k] == s) & (src_region[k] == r)
                if not sel.any():
                    continue
                src = regions[r]
                src = src[: src.size // s * s].view(_UINT[s])
                ks = k[sel]
                buf[:n8].view(_UINT[s])[values_at[ks] // s + rank[sel]] = src[src_off[ks] // s + pos[sel]]
        # the bodies' checks: lin64 of each (whole words: bodies are 8-byte multiples), as one segmented sum
        words = body // 8
        total = int(words.sum())
        firsts = np.concatenate([[0], np.cumsum(words)[:-1]]).astype(np.int64)
        local = np.arange(total, dtype=np.int64) - np.repeat(firsts, words)
        vals = buf[:n8].view(np.uint64)[np.repeat(start // 8, words) + local]
        a, b = _host_ab(int(words.max()))
        with np.errstate(over="ignore"):
            sums = np.add.reduceat(vals * (a[local & (ROW - 1)] * b[local >> _ROW_BITS]), firsts).tolist()
        for (_, at, _, hex_at, nbody, _, _), total_ in zip(self.heads, sums):
            check = (int(total_) + mix_int((nbody << 5) | 1)) & _MASK
            mv[offsets[at] + hex_at: offsets[at] + hex_at + 16] = f"{check:016x}".encode()


_ROW_BITS = ROW.bit_length() - 1
assert 1 << _ROW_BITS == ROW  # noqa: S101 - our constant


class Encoded(NamedTuple):
    """A registration's delta: ``encode_tensor``'s info per tensor (in metas order), the payloads made one
    by one (meta index -> payload), the batched ones (``write``), the new version's known lin64 sums,
    and the seconds of each part."""
    infos: list[dict]
    payloads: dict[int, torch.Tensor]
    vector: _Vector
    digests: dict[str, int]
    phases: dict[str, float]

    def write(self, buf: np.ndarray, offsets: dict[int, int], regions: dict[int, np.ndarray]) -> None:
        """Every payload into ``buf`` (zeroed), tensor ``i``'s at ``offsets[i]`` (see ``_Vector.write``)."""
        for i, payload in self.payloads.items():
            buf[offsets[i]: offsets[i] + payload.numel()] = payload.numpy()
        self.vector.write(buf, offsets, regions)


def _changed_words_each(jobs, threads: int) -> list:
    """``_compare`` of each job, on ``threads`` threads when more than one, results in order."""
    if threads > 1 and len(jobs) > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-delta-compare") as pool:
            return list(pool.map(lambda j: _compare(*j), jobs))
    return [_compare(*j) for j in jobs]


__all__ = ["Encoded", "encode_registration"]
