"""A registration's delta payloads written together (``batch.encode_registration``'s result).

``Encoded`` holds ``encode_tensor``'s info per tensor, the payloads encoded one by one, and a
``_Vector``: the changed tensors encoded ``idx`` or ``gap16`` (the usual ones), their headers formatted
as ``encode._payload`` writes them, and their elements; ``Encoded.write`` writes every payload into one
buffer (each section and the values by one scatter, the body checks as one segmented ``lin64``), byte
for byte what ``encode_tensor`` makes (``tests/unit/test_delta_batch.py``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ckpt_core._settings import delta_threads
from ckpt_core.delta._direct_payload import DirectPayload, _size_term, head_of, write_direct
from ckpt_core.delta._scan import bodies, kernel
from ckpt_core.delta.encode import ENCODINGS, MAX_GAP16
from ckpt_core.delta.lin64 import _MASK, ROW, _host_ab

_THREADS_MIN_ELEMENTS = 1 << 16   # changed elements below which the payloads are written on one thread
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

_VECTOR = (ENCODINGS.index("idx"), ENCODINGS.index("gap16"))


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
        # every changed element's position and gap, and per changed tensor its first element (``elements``)
        self.found: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

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

    def header(self, c: int, at: int, meta, digest: str, enc: int, body: int, count: int) -> tuple[None, dict]:
        """Changed tensor ``c`` (``meta``, at ``at`` in the metas; ``enc``, ``body`` bytes, ``count`` changed)
        batched: its header (its body's check to come) and ``encode_tensor``'s info of it."""
        name = ENCODINGS[enc]
        head, hex_at = head_of(meta, name, count, digest, body)
        self.heads.append((c, at, head, hex_at, body, meta.base, meta.base_offset))
        return None, {"encoding": name, "count": count, "numel": meta.nbytes // meta.itemsize,
                      "bytes": len(head) + body}

    def elements(self, pos: np.ndarray, gaps: np.ndarray, firsts: np.ndarray) -> None:
        """Keep every changed element's position and gap (in changed-tensor order) and each changed tensor's
        first element: a batched tensor's elements are ``pos[firsts[c]: firsts[c] + counts[c]]``."""
        self.found = (pos, gaps, firsts)

    def batched_elements(self) -> int:
        """The changed elements of the batched tensors."""
        return int(self.counts[[h[0] for h in self.heads]].sum()) if self.heads else 0

    def _per_element(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The numpy route's view of the batched tensors' elements: (which of ``heads``, rank in its
        tensor, position, gap), each per element."""
        pos, gaps, firsts = self.found   # type: ignore[misc]
        counts = self.counts
        rank = np.arange(pos.size, dtype=np.int64) - np.repeat(firsts, counts)
        if len(self.heads) == counts.size:   # every changed tensor batched (the usual case)
            return np.repeat(np.arange(counts.size, dtype=np.int64), counts), rank, pos, gaps
        which = np.full(counts.size, -1, dtype=np.int64)
        for k, h in enumerate(self.heads):
            which[h[0]] = k
        k_of = np.repeat(which, counts)
        keep = k_of >= 0
        return k_of[keep], rank[keep], pos[keep], gaps[keep]

    def write(self, buf: np.ndarray, offsets: dict[int, int], regions: dict[int, np.ndarray], threads: int = 1) -> None:
        """Write the batched payloads into ``buf`` (zeroed, uint8, a multiple of 8 bytes long), each at
        ``offsets[meta index]`` (8-byte aligned); ``regions``: the new version's regions' bytes. The
        bodies are written and checked in parts of whole tensors on ``threads`` threads."""
        if not self.heads or self.found is None:
            return
        heads = self.heads
        c = np.array([h[0] for h in heads], dtype=np.int64)
        start = np.array([offsets[h[1]] + len(h[2]) for h in heads], dtype=np.int64)   # each body's start
        enc, width, counts = self.enc[c], self.width[c], self.counts[c]
        gap16 = enc == ENCODINGS.index("gap16")
        index_bytes = np.where(gap16, _align8(counts * 2), _align8(counts * width))
        per = {"start": start, "body": np.array([h[4] for h in heads], dtype=np.int64), "gap16": gap16,
               "width": width, "size": self.size[c], "values_at": start + index_bytes,
               "region": np.array([h[5] for h in heads], dtype=np.int64),
               "src": np.array([h[6] for h in heads], dtype=np.int64), "count": counts,
               "first": self.found[2][c]}
        mv = memoryview(buf)
        for (_, at, head, _, _, _, _) in heads:
            mv[offsets[at]: offsets[at] + len(head)] = head
        lib = kernel()
        if lib is not None:   # each part's bodies by one compiled call
            def work(hh):
                return self._part_compiled(lib, buf, regions, per, *hh)
        else:   # numpy, per element
            elems = self._per_element()

            def work(hh):
                return self._part(buf, regions, per, elems, *hh)
        cum = np.cumsum(counts)
        cuts = [0] + [int(np.searchsorted(cum, cum[-1] * i // threads)) + 1 for i in range(1, threads)] + [len(heads)]
        cuts = sorted(set(min(x, len(heads)) for x in cuts))
        parts = list(zip(cuts[:-1], cuts[1:]))
        if len(parts) > 1:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="ckpt-delta-write") as pool:
                sums = [x for got in pool.map(work, parts) for x in got]
        else:
            sums = [x for hh in parts for x in work(hh)]
        for (_, at, _, hex_at, nbody, _, _), total in zip(heads, sums):
            check = (int(total) + _size_term(nbody, 1)) & _MASK
            mv[offsets[at] + hex_at: offsets[at] + hex_at + 16] = f"{check:016x}".encode()

    def _part(self, buf: np.ndarray, regions: dict[int, np.ndarray], per: dict, elems: tuple, h0: int,
              h1: int) -> list[int]:
        """Heads ``[h0, h1)`` in numpy (no compiled pass): their bodies' sections and values written, and
        each body's lin64 sum; ``elems``: ``_per_element()``."""
        k_all, rank_all, pos_all, gaps_all = elems
        e0, e1 = np.searchsorted(k_all, [h0, h1]).tolist()
        k, rank, pos, gaps = k_all[e0:e1], rank_all[e0:e1], pos_all[e0:e1], gaps_all[e0:e1]
        n8 = buf.size // 8 * 8
        start, gap16 = per["start"], per["gap16"]
        kinds = np.unique(gap16[h0:h1] * 16 + per["width"][h0:h1]).tolist()   # gap16, or idx of a width
        for kind in kinds:
            sel = (gap16[k] * 16 + per["width"][k] == kind) if len(kinds) > 1 else slice(None)
            w, dt = (2, np.uint16) if kind >= 16 else (kind, np.int32 if kind == 4 else np.int64)
            buf[:n8].view(dt)[(start // w)[k[sel]] + rank[sel]] = (gaps if kind >= 16 else pos)[sel]
        size, region, src, values_at = per["size"], per["region"], per["src"], per["values_at"]
        groups = np.unique(size[h0:h1] * 1024 + region[h0:h1]).tolist()
        for key in groups:
            s, r = divmod(key, 1024)
            sel = (size[k] * 1024 + region[k] == key) if len(groups) > 1 else slice(None)
            ks = k[sel]
            data = regions[r]
            data = data[: data.size // s * s].view(_UINT[s])
            buf[:n8].view(_UINT[s])[(values_at // s)[ks] + rank[sel]] = data[(src // s)[ks] + pos[sel]]
        # the bodies' checks: lin64 of each (whole words: bodies are 8-byte multiples), as one segmented sum
        words = per["body"][h0:h1] // 8
        a, b = _host_ab(int(words.max()))
        firsts = np.zeros(words.size, dtype=np.int64)
        np.cumsum(words[:-1], out=firsts[1:])
        local = np.arange(int(words.sum()), dtype=np.int64) - np.repeat(firsts, words)
        vals = buf[:n8].view(np.uint64)[np.repeat(start[h0:h1] // 8, words) + local]
        with np.errstate(over="ignore"):
            return np.add.reduceat(vals * (a[local & (ROW - 1)] * b[local >> _ROW_BITS]), firsts).tolist()

    def _part_compiled(self, lib, buf: np.ndarray, regions: dict[int, np.ndarray], per: dict, h0: int,
                       h1: int) -> list[int]:
        """``_part`` by ``_scan.bodies``: heads ``[h0, h1)``, each body's positions read where the changed
        tensor's lie in ``elements``' array (no per-element arrays made)."""
        pos, _, _ = self.found   # type: ignore[misc]
        first, count = per["first"][h0:h1], per["count"][h0:h1]
        start, body = per["start"][h0:h1], per["body"][h0:h1]
        if int((start + body).max()) > buf.size:   # offsets come from payload_list's sizes: never, unless a bug
            raise AssertionError("a batched payload body does not fit its buffer")
        base = {r: int(regions[r].ctypes.data) for r in np.unique(per["region"][h0:h1]).tolist()}
        data = np.array([base[r] for r in per["region"][h0:h1].tolist()], dtype=np.int64) + per["src"][h0:h1]
        kind = np.where(per["gap16"][h0:h1], 2, per["width"][h0:h1])
        size = per["size"][h0:h1]
        if not np.array_equal(_align8(count * kind) + _align8(count * size), body):   # the C code trusts it
            raise AssertionError("a batched payload body's sections do not fill its planned size")
        a, b = _host_ab(int(body.max()) // 8)
        return bodies(lib, buf, pos, first, count, data, size, kind, start, body, a, b).tolist()


_ROW_BITS = ROW.bit_length() - 1
assert 1 << _ROW_BITS == ROW  # noqa: S101 - our constant


class Encoded(NamedTuple):
    """A registration's delta: ``encode_tensor``'s info per tensor (in metas order), the payloads made one
    by one (meta index -> payload), the batched ones (``write``), the new version's known lin64 sums,
    and the seconds of each part."""
    infos: list[dict]
    payloads: dict[int, torch.Tensor | DirectPayload]
    vector: _Vector
    digests: dict[str, int]
    phases: dict[str, float]

    def payload_list(self, regions: dict[int, np.ndarray], alloc=None) -> list:
        """``(payload or None, info)`` per tensor, as ``encode_tensor`` returns them: every payload written
        into one zeroed buffer (``write``), each a view of it. ``regions``: the new version's regions' bytes.
        ``alloc(nbytes)``: the zeroed uint8 buffer to write into (``checkpoint.sources.PackedRegion``, the
        companion's own region); default a new numpy one."""
        offsets, pos = {}, 0
        for i, info in enumerate(self.infos):
            if info["encoding"] is not None:
                offsets[i] = pos
                pos += (info["bytes"] + 7) & ~7
        buf = np.zeros(pos, dtype=np.uint8) if alloc is None else alloc(pos)
        self.write(buf, offsets, regions)
        out = torch.from_numpy(buf)
        return [(out[offsets[i]: offsets[i] + info["bytes"]] if i in offsets else None, info)
                for i, info in enumerate(self.infos)]

    def write(self, buf: np.ndarray, offsets: dict[int, int], regions: dict[int, np.ndarray]) -> None:
        """Every payload into ``buf`` (zeroed), tensor ``i``'s at ``offsets[i]`` (see ``_Vector.write``), on
        up to ``PS_FAULT_THREADS`` threads when there are many changed elements."""
        direct = []
        for i, payload in self.payloads.items():
            if isinstance(payload, torch.Tensor):
                buf[offsets[i]: offsets[i] + payload.numel()] = payload.numpy()
            else:   # a large tensor's, written here (``_direct_payload.py``)
                direct.append((offsets[i], payload))
        threads = min(delta_threads(), os.cpu_count() or 1)
        write_direct(buf, direct, threads)
        many = self.vector.batched_elements() >= _THREADS_MIN_ELEMENTS
        self.vector.write(buf, offsets, regions, threads if many else 1)


__all__ = ["Encoded"]
