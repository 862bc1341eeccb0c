"""A compiled pass for the registration's compare (``batch.py``), with numpy as its fallback.

numpy finds a large tensor's changed elements in several passes over the block (a compare into a
mask, ``flatnonzero``), and its ``lin64`` in another (``HostDigest``): about 99 ms for 220 MB of
bf16 at 2 % changed on the 2-core CPU machine. One C pass does the three at once (compare the 8-byte
words, write the positions of the items that differ, add the ``lin64`` terms: the base's, or only the
change over the changed words when the base's sum is known): 63 ms. For the
batched small tensors, one loop over a piece of a span does what numpy does in a dozen passes over
arrays of every changed word (compare, the tensor of each word, its tail masked, the ``lin64``
change per tensor, the changed items); and one loop sums the payload bodies' checks (numpy: gathers
of every body word and its coefficient).

The C source below is compiled on first use, by the host's C compiler (``$CC``, else ``cc``), into
``$XDG_CACHE_HOME/ckpt-engine/kernels`` (default ``~/.cache``), named by a hash of the source and the
command, and loaded with ``ctypes`` (which releases the GIL during each call: the encode's threads
run side by side). Nothing is compiled at install time. Without a compiler, or where the build or the
load fails, or with ``PS_DELTA_KERNEL=numpy``, ``kernel()`` is None and ``batch.py`` runs its numpy
path: the same positions, digests and payloads (``tests/unit/test_delta_batch.py`` runs both and
compares every payload with ``encode_tensor``'s).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from ckpt_core._settings import delta_kernel
from ckpt_core.delta.lin64 import ROW

_log = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>

/* Changed words are found in two loops per chunk of at most CHUNK words: the first reads every word without a
   branch (its index written, and kept when the word differs), the second visits the changed ones. One loop
   with a branch per word mispredicted every few changed words (2 % of bf16 items changed: 8 % of words).
   The changed items of a word are found by bit operations specialised per item size (the size is fixed per
   tensor, so the switch on it is predicted), without a division or a branch on the data. On the 2-core CPU
   machine, 854 MB at 2 % bf16 in one thread, spans of 4 MiB tensors: 270-320 ms before (a branch per word,
   fresh positions buffers copied), ~200 ms now; numpy's compare alone (no positions): 95-120 ms. */
#define CHUNK 4096

/* Bit k set iff item k (of S bytes) of d is not zero; S a constant where it is inlined. */
static inline uint64_t items_set(uint64_t d, const int S) {
    if (S == 8) return d != 0;
    const uint64_t lo = S == 1 ? 0x7f7f7f7f7f7f7f7fULL : S == 2 ? 0x7fff7fff7fff7fffULL : 0x7fffffff7fffffffULL;
    uint64_t h = (((d & lo) + lo) | d) & ~lo;   /* each item's top bit: set iff the item is not zero */
    uint64_t m = 0;
    for (int k = 0; k < 8 / S; k++)
        m |= ((h >> (8 * S * k + 8 * S - 1)) & 1) << k;
    return m;
}

/* Writes at out[0, popcount(m)) first + the index of each set bit of m, and garbage up to out[per) (the
   caller's buffer holds the worst case, every item changed); returns popcount(m). */
static inline int64_t put_items(int64_t *out, uint64_t m, int64_t first, const int per) {
    uint64_t mm = m;
    for (int k = 0; k < per; k++) {
        out[k] = first + __builtin_ctzll(mm | ((uint64_t)1 << per));
        mm &= mm - 1;
    }
    return __builtin_popcountll(m);
}

/* The positions of the changed items of word `local` of a tensor of items of `size` bytes (d: the word's
   new ^ old) written to pos; returns how many. */
static inline int64_t word_items(uint64_t d, int64_t size, int64_t local, int64_t *pos) {
    switch (size) {
    case 1:
        return put_items(pos, items_set(d, 1), local * 8, 8);
    case 2:
        return put_items(pos, items_set(d, 2), local * 4, 4);
    case 4:
        return put_items(pos, items_set(d, 4), local * 2, 2);
    default:
        pos[0] = local;
        return d != 0;
    }
}

/* Words [0, n) of new and old; word 0 is word w0 of its tensor. Writes to pos, increasing, the
   positions (word * (8 / size) + item, from word 0) of the items of `size` bytes that differ, and returns
   how many it wrote. Adds to *change (mod 2**64, c_g = a[g % row] * b[g / row], g = w0 + word: lin64's
   terms) sum (new_word - old_word) * c_g over the changed words and, unless `derive` (the caller knows old's
   sum: no multiply per word), to *oldsum sum old_word * c_g over every word. `row` is a power of two; b
   covers every row touched. */
int64_t ckd_scan(const uint64_t *nw, const uint64_t *ow, int64_t n, int64_t size, int64_t w0, int64_t row,
                 const uint64_t *a, const uint64_t *b, int64_t *pos, uint64_t *change, uint64_t *oldsum,
                 int64_t derive) {
    int64_t c = 0, i = 0, rbits = __builtin_ctzll((uint64_t)row);
    uint64_t total = 0, diff = 0;
    int32_t hit[CHUNK];
    while (i < n) {
        int64_t g = w0 + i, end = i + (row - (g & (row - 1))), k = 0;
        if (end > i + CHUNK) end = i + CHUNK;
        if (end > n) end = n;
        const uint64_t *ar = a + (g & (row - 1)) - i;
        uint64_t br = b[g >> rbits];
        if (derive) {
            for (int64_t j = i; j < end; j++) {
                hit[k] = (int32_t)(j - i);
                k += nw[j] != ow[j];
            }
        } else {
            uint64_t part = 0;
            for (int64_t j = i; j < end; j++) {
                uint64_t y = ow[j];
                part += y * ar[j];
                hit[k] = (int32_t)(j - i);
                k += nw[j] != y;
            }
            total += part * br;
        }
        uint64_t part = 0;
        for (int64_t q = 0; q < k; q++) {
            int64_t j = i + hit[q];
            uint64_t x = nw[j], y = ow[j];
            part += (x - y) * ar[j];
            c += word_items(x ^ y, size, j, pos + c);
        }
        diff += part * br;
        i = end;
    }
    *change += diff;
    if (!derive) *oldsum += total;
    return c;
}

/* Words [lo, hi) of a run of tensors laid out alike in both versions (batch.py's span): tensor k starts at
   word starts[k] (increasing, starts[0] = 0), has nbytes[k] bytes of items of sizes[k] bytes; word lo lies in
   tensor t. Only a tensor's own bytes count (its last word's rest and the padding after it are masked out).
   Writes the position of each differing item to pos, in order; each changed tensor to dt, in order, with
   its number of differing items to dcnt and sum (new_word - old_word) * a[l % row] * b[l / row] over its
   changed words l (lin64's change, mod 2**64) to dsum, and their number to *ndt. Returns the number of
   items written. */
int64_t ckd_span(const uint64_t *nw, const uint64_t *ow, int64_t lo, int64_t hi, int64_t t,
                 const int64_t *starts, const int64_t *nbytes, const int64_t *sizes, int64_t ntensors,
                 int64_t row, const uint64_t *a, const uint64_t *b,
                 int64_t *pos, int64_t *dt, int64_t *dcnt, uint64_t *dsum, int64_t *ndt) {
    int64_t c = 0, c0 = 0, nd = 0, last = -1, rbits = __builtin_ctzll((uint64_t)row), size = 8;
    uint64_t acc = 0;   /* the current changed tensor's dsum, stored when the next one starts */
    int32_t hit[CHUNK];
    for (int64_t s = lo; s < hi; s += CHUNK) {
        int64_t e = s + CHUNK < hi ? s + CHUNK : hi, k = 0;
        for (int64_t w = s; w < e; w++) {
            hit[k] = (int32_t)(w - s);
            k += nw[w] != ow[w];
        }
        for (int64_t q = 0; q < k; q++) {
            int64_t w = s + hit[q];
            uint64_t x = nw[w], y = ow[w];
            while (t + 1 < ntensors && starts[t + 1] <= w) t++;
            int64_t local = w - starts[t], left = nbytes[t] - local * 8;
            if (left < 8) {
                if (left <= 0) continue;
                uint64_t keep = ((uint64_t)1 << (8 * left)) - 1;
                x &= keep;
                y &= keep;
                if (x == y) continue;
            }
            if (t != last) {
                if (nd) {
                    dsum[nd - 1] = acc;
                    dcnt[nd - 1] = c - c0;
                }
                c0 = c;
                dt[nd++] = t;
                acc = 0;
                last = t;
                size = sizes[t];
            }
            acc += (x - y) * (a[local & (row - 1)] * b[local >> rbits]);
            c += word_items(x ^ y, size, local, pos + c);
        }
    }
    if (nd) {
        dsum[nd - 1] = acc;
        dcnt[nd - 1] = c - c0;
    }
    *ndt = nd;
    return c;
}

/* out[i] = sum over j < words[i] of buf[start[i] + j] * a[j % row] * b[j / row] (mod 2**64): lin64's sum of
   each of n bodies lying in buf at word start[i]. */
void ckd_segments(const uint64_t *buf, const int64_t *start, const int64_t *words, int64_t n, int64_t row,
                  const uint64_t *a, const uint64_t *b, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint64_t *w = buf + start[i];
        uint64_t total = 0;
        for (int64_t r = 0; r * row < words[i]; r++) {
            int64_t end = words[i] - r * row < row ? words[i] - r * row : row;
            uint64_t part = 0;
            for (int64_t j = 0; j < end; j++)
                part += w[r * row + j] * a[j];
            total += part * b[r];
        }
        out[i] = total;
    }
}

/* The largest gap between n increasing positions (the first counted from 0) and their runs of consecutive ones
   (n >= 1): out[0], out[1] (encode.py's Changes.of, without its array of gaps). */
void ckd_gap_stats(const int64_t *pos, int64_t n, int64_t *out) {
    int64_t big = pos[0], runs = 1;
    for (int64_t i = 1; i < n; i++) {
        int64_t g = pos[i] - pos[i - 1];
        big = g > big ? g : big;
        runs += g != 1;
    }
    out[0] = big;
    out[1] = runs;
}

/* A payload body of `count` changed items written at out (nbytes bytes, 8-aligned): the index section (kind 2:
   gap16, each position's distance to the one before, the first's from 0, as uint16; kind 4 or 8: idx, the
   positions as int32 or int64), then the items of `size` bytes of data at those positions, each section
   zero-padded to 8 bytes (encode._body's layout). Returns lin64's sum of the body's words (without its size
   term). The caller checks that both sections fill nbytes. */
uint64_t ckd_body(const int64_t *pos, int64_t count, const uint8_t *data, int64_t size, int64_t kind,
                  uint8_t *out, int64_t nbytes, int64_t row, const uint64_t *a, const uint64_t *b) {
    int64_t at = (count * kind + 7) & ~(int64_t)7, zero = 0, words = nbytes / 8;
    for (int64_t i = count * kind; i < at; i++) out[i] = 0;
    if (kind == 2) {
        uint16_t *g = (uint16_t *)out;
        int64_t prev = 0;
        for (int64_t i = 0; i < count; i++) { g[i] = (uint16_t)(pos[i] - prev); prev = pos[i]; }
    } else if (kind == 4) {
        int32_t *g = (int32_t *)out;
        for (int64_t i = 0; i < count; i++) g[i] = (int32_t)pos[i];
    } else {
        int64_t *g = (int64_t *)out;
        for (int64_t i = 0; i < count; i++) g[i] = pos[i];
    }
    uint8_t *v = out + at;
    switch (size) {
    case 1: for (int64_t i = 0; i < count; i++) v[i] = data[pos[i]]; break;
    case 2: for (int64_t i = 0; i < count; i++) ((uint16_t *)v)[i] = ((const uint16_t *)data)[pos[i]]; break;
    case 4: for (int64_t i = 0; i < count; i++) ((uint32_t *)v)[i] = ((const uint32_t *)data)[pos[i]]; break;
    default: for (int64_t i = 0; i < count; i++) ((uint64_t *)v)[i] = ((const uint64_t *)data)[pos[i]]; break;
    }
    for (int64_t i = at + count * size; i < nbytes; i++) out[i] = 0;
    uint64_t total;
    ckd_segments((const uint64_t *)out, &zero, &words, 1, row, a, b, &total);
    return total;
}

/* n payload bodies at once (a registration's batched tensors, _payload_vector.py): body k, of count[k] items
   whose positions are pos[first[k]..], of size[k] bytes read from the address data[k], of index kind
   kind[k], written at buf + start[k] over nbytes[k] bytes, as ckd_body writes one; sums[k] its lin64 sum. */
void ckd_bodies(int64_t n, const int64_t *pos, const int64_t *first, const int64_t *count, const int64_t *data,
                const int64_t *size, const int64_t *kind, uint8_t *buf, const int64_t *start, const int64_t *nbytes,
                int64_t row, const uint64_t *a, const uint64_t *b, uint64_t *sums) {
    for (int64_t k = 0; k < n; k++)
        sums[k] = ckd_body(pos + first[k], count[k], (const uint8_t *)(intptr_t)data[k], size[k], kind[k],
                           buf + start[k], nbytes[k], row, a, b);
}
"""

# words per call of ckd_scan (32 MiB of each version). Each call holds the GIL for a few microseconds of
# Python around it: with 32K-word blocks that was ~7 % of a thread's time and the compare stopped scaling
# at 4 threads (16-core host: 14.9 GB/s read at 4 threads, 14.6 at 16); with 4M-word blocks 22.8 and 58.4
# GB/s. The positions buffer is sized for the worst case (8 per word) but only the pages written are touched.
BLOCK_WORDS = 1 << 22
_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-strict-aliasing"]
_P, _I = ctypes.c_void_p, ctypes.c_int64
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "ckpt-engine" / "kernels"


def _build(cc: str) -> ctypes.CDLL:
    """The library, from the cache or compiled into it now (into a temporary name, then renamed: two
    processes building at once each load a whole file)."""
    key = hashlib.sha256("\0".join([SOURCE, cc, *_FLAGS, platform.machine()]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    path = folder / f"delta_scan-{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            src, out = Path(tmp) / "scan.c", Path(tmp) / "scan.so"
            src.write_text(SOURCE)
            subprocess.run([cc, *_FLAGS, "-o", str(out), str(src)], check=True, capture_output=True, timeout=120)
            os.replace(out, path)
    lib = ctypes.CDLL(str(path))
    lib.ckd_scan.argtypes = [_P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I]
    lib.ckd_scan.restype = _I
    lib.ckd_span.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _P]
    lib.ckd_span.restype = _I
    lib.ckd_gap_stats.argtypes = [_P, _I, _P]
    lib.ckd_gap_stats.restype = None
    lib.ckd_body.argtypes = [_P, _I, _P, _I, _I, _P, _I, _I, _P, _P]
    lib.ckd_body.restype = ctypes.c_uint64
    lib.ckd_bodies.argtypes = [_I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _P]
    lib.ckd_bodies.restype = None
    return lib


def kernel() -> ctypes.CDLL | None:
    """The compiled pass (built once per process), or None: ``PS_DELTA_KERNEL=numpy``, no C compiler, or
    its build or load failed (logged once; the numpy path gives the same results)."""
    if delta_kernel() == "numpy":
        return None
    cc = os.environ.get("CC") or "cc"
    with _lock:
        if cc not in _loaded:
            found = shutil.which(cc)
            try:
                _loaded[cc] = _build(found) if found else None
                if not found:
                    _log.info("no C compiler %r: the delta encode runs its numpy path", cc)
            except (OSError, subprocess.SubprocessError) as exc:
                _loaded[cc] = None
                detail = getattr(exc, "stderr", b"") or b""
                _log.warning("the delta encode's compiled pass could not be built with %r (%s%s): numpy instead",
                             cc, exc, f"; {detail.decode(errors='replace')[:400]}" if detail else "")
        return _loaded[cc]


def _at(arr: np.ndarray, word: int) -> int:
    return arr.ctypes.data + 8 * word


def scan(lib: ctypes.CDLL, new: np.ndarray, old: np.ndarray, size: int,
         a: np.ndarray, b: np.ndarray, derive: bool = False) -> tuple[np.ndarray, int, int | None]:
    """The changed positions (int64, increasing) of two versions' bytes (flat uint8 arrays of the same
    length, a multiple of ``size``, 8-byte aligned) compared as items of ``size`` bytes (1, 2, 4, 8),
    ``sum (new_word - old_word) * c_i`` over the changed words (lin64's change without its size term, mod
    2**64, the zero-padded last word included) and, unless ``derive``, ``sum old_word * c_i`` (``old``'s
    sum: then ``new``'s is it plus the change; with ``derive`` the caller knows ``old``'s, and the pass
    does no multiply per word: on the 2-core machine a fifth of it), in one pass block by block; ``a``,
    ``b``: ``lin64._host_ab`` of its words. Returns ``(positions, change, old's sum or None)``.

    The positions are written into a buffer of the worst case (every item changed), of which only the
    pages written are touched, and returned as a view of it (no copy: on the 2-core VM a page fault costs
    ~1 us, and a copy of the positions faulted in as many pages again)."""
    m, per = new.size // 8, 8 // size
    nw, ow = new[: 8 * m].view(np.uint64), old[: 8 * m].view(np.uint64)
    out = np.empty(m * per + per, dtype=np.int64)   # + per: the bytes after the last whole word
    sums = np.zeros(2, dtype=np.uint64)             # the change, old's sum
    c = 0
    for s in range(0, m, BLOCK_WORDS):
        e = min(s + BLOCK_WORDS, m)
        got = lib.ckd_scan(_at(nw, s), _at(ow, s), e - s, size, s, ROW, a.ctypes.data, b.ctypes.data,
                           _at(out, c), sums.ctypes.data, sums.ctypes.data + 8, int(derive))
        if got and s:
            out[c: c + got] += s * per
        c += got
    change, old_sum = int(sums[0]), int(sums[1])
    if new.size > 8 * m:   # the bytes after the last whole word: whole items (size divides the length)
        dt = np.dtype(f"<u{size}")
        hit = np.flatnonzero(new[8 * m:].view(dt) != old[8 * m:].view(dt))
        out[c: c + hit.size] = hit + m * per
        c += hit.size
        last_new, last_old = (int.from_bytes(x[8 * m:].tobytes(), "little") for x in (new, old))
        coef = int(a[m % ROW]) * int(b[m // ROW])
        change += (last_new - last_old) * coef
        old_sum += last_old * coef
    mask = (1 << 64) - 1
    return out[:c], change & mask, None if derive else old_sum & mask


def span_changes(lib: ctypes.CDLL, new_w: np.ndarray, old_w: np.ndarray, lo: int, hi: int, starts: np.ndarray,
                 nbytes: np.ndarray, sizes: np.ndarray, a: np.ndarray, b: np.ndarray):
    """Words ``[lo, hi)`` of a span (``batch._Span``: its uint64 words in both versions, and per tensor its
    first word, bytes and item size, int64): the position of each changed item (int64, in order), the
    changed tensors (in order), each one's number of changed items and its ``sum (new_word - old_word) * c_l``
    (uint64), in one pass. The positions are a view of a buffer of the worst case (every item changed), of
    which only the pages written are touched (see ``scan``)."""
    t0 = int(np.searchsorted(starts, lo, side="right")) - 1
    per = 8 // int(sizes[t0:].min())   # items per word, at most
    pos = np.empty((hi - lo) * per, dtype=np.int64)
    cap = min(starts.size - t0, hi - lo + 1)
    dt, dcnt = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
    dsum, nd = np.empty(cap, dtype=np.uint64), np.zeros(1, dtype=np.int64)
    c = lib.ckd_span(new_w.ctypes.data, old_w.ctypes.data, lo, hi, t0, starts.ctypes.data, nbytes.ctypes.data,
                     sizes.ctypes.data, starts.size, ROW, a.ctypes.data, b.ctypes.data, pos.ctypes.data,
                     dt.ctypes.data, dcnt.ctypes.data, dsum.ctypes.data, nd.ctypes.data)
    n = int(nd[0])
    return pos[:c], dt[:n].copy(), dcnt[:n].copy(), dsum[:n].copy()


def bodies(lib: ctypes.CDLL, buf: np.ndarray, pos: np.ndarray, first: np.ndarray, count: np.ndarray,
           data: np.ndarray, size: np.ndarray, kind: np.ndarray, start: np.ndarray, nbytes: np.ndarray,
           a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``len(first)`` payload bodies written into ``buf`` (uint8) by one compiled call (``ckd_body`` each:
    body ``k``'s index section of ``kind[k]`` (2: gap16, 4/8: idx) from the positions
    ``pos[first[k]: first[k] + count[k]]``, its items of ``size[k]`` bytes read at the addresses ``data[k]``,
    at ``start[k]`` over ``nbytes[k]`` bytes); returns each body's lin64 sum (uint64, without its size
    term). Every int array is made int64 and contiguous; the caller keeps the memory ``data`` points into
    alive and has checked that each body fits ``buf``."""
    def i64(x):
        return np.ascontiguousarray(x, dtype=np.int64)
    pos, first, count, data, size, kind, start, nbytes = map(i64, (pos, first, count, data, size, kind, start, nbytes))
    out = np.empty(first.size, dtype=np.uint64)
    lib.ckd_bodies(first.size, pos.ctypes.data, first.ctypes.data, count.ctypes.data, data.ctypes.data,
                   size.ctypes.data, kind.ctypes.data, buf.ctypes.data, start.ctypes.data, nbytes.ctypes.data,
                   ROW, a.ctypes.data, b.ctypes.data, out.ctypes.data)
    return out


__all__ = ["BLOCK_WORDS", "SOURCE", "bodies", "kernel", "scan", "span_changes"]
