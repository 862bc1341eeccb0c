"""``lin64``: a linear digest mod 2**64 of a tensor's bytes, computed where the tensor lives.

A delta's post-apply check (``apply.py``) digests every changed tensor an engine worker holds. A
SHA-256 of the bytes needs them on the host: a device-to-host copy of every changed tensor, which
dominated a delta update's time. ``lin64`` runs as two integer tensor ops per chunk on the tensor's
own device (no host copy), and on the host as numpy on a small thread pool.

Definition (the same on every device, pinned by ``tests/unit/test_delta_lin64.py`` against a
plain-Python reference, ``tests/support/data.py``). The contiguous tensor's ``N`` bytes, zero-padded
to a multiple of 8, are read as ``M = ceil(N / 8)`` little-endian 64-bit words, whatever the dtype
(the tensor's own bytes viewed as int64: no widening pass, one multiply per 8 bytes). Word ``i``
gets the coefficient ``c_i = a[i % ROW] * b[i // ROW]`` with ``a[k] = mix(k + SEED_A) | 1``,
``b[j] = mix(j + SEED_B) | 1`` (``mix``: splitmix64's finalizer); a product of odd numbers, ``c_i``
is odd. Then, all mod 2**64::

    lin64 = sum_i word_i * c_i  +  mix((N << 5) | item_size)

written ``"lin64:<16 hex digits>"``. Integer sums mod 2**64 are exact and do not depend on the
order of the additions, so a GPU's reduction gives the CPU's value bit for bit.

What it guarantees: any change of one element of item size 1, 2, 4 or 8 changes the digest. Such
an element lies inside one word (its size divides 8 and it starts at a multiple of its size), at
byte ``s`` of it, so the word changes by ``d * 2**(8 s)`` with ``0 < |d| < 2**(8 size)`` and
``8 s + 8 size <= 64``: a nonzero number of magnitude below 2**64, hence nonzero mod 2**64, and
times the odd ``c_i`` (invertible mod 2**64) still nonzero. So a dropped, duplicated-onto or
corrupted single element is always caught, and the byte count and item size are in it. (An item of
16 bytes spans two words: a change of both could cancel, as it could before.) Changes of several
elements are caught unless they cancel exactly, which random or systematic faults (a lost scatter, a
shifted write, a stale region) do not do by chance (about 2**-64 for unstructured changes). It is
**not** a cryptographic hash: anyone who can choose the bytes can build a collision (it is linear).
The transport's integrity against a foreign writer stays with the SHA-256 registration digests of
``p2p/digests.py``.

Cost on a device, per 8 bytes of the tensor: one int64 multiply (into a temporary) and one add of a
row sum; per row of ``ROW`` words one more multiply-add; the coefficients ``a`` and ``b`` are cached
per device (``b`` grows with the largest tensor seen: 8 bytes per 32 KiB of it), so a digest costs
three kernels per chunk of ``CHUNK`` words (a 64 MiB temporary at most) plus three per tensor. A
tensor whose first byte is not 8-byte aligned in its storage is read chunk by chunk through an
aligned copy (bounded, never the whole tensor).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ckpt_core._settings import delta_threads
from ckpt_core.delta._kernels import kernels, lin64_rows, lin64_rows_at, lin64_rows_many, to_device
from ckpt_core.errors import CheckpointFormatError

PREFIX = "lin64:"
ROW = 4096                 # words per row: a[k] repeats every ROW words, b[j] changes every row
CHUNK = 1 << 23            # 8-byte words per chunk on a device (a multiple of ROW): a 64 MiB int64 temporary at most
SEED_A = 0x6C696E3634A11CE5
SEED_B = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_BATCH_BYTES = 4 << 30     # a device batch of lin64_many is launched once it holds this many bytes of tensors
_NP_THREADS_MIN_WORDS = 1 << 19   # below: one thread (the pool's start costs more than it saves)


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def mix_int(z: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2**64, unsigned result): the reference."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """``mix_int`` on an int64 tensor (wrapping products; ``>>`` is arithmetic, so masked to be logical)."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _M1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _coefficients(start: int, count: int, seed: int, device) -> torch.Tensor:
    """``mix(i + seed) | 1`` for ``i`` in ``[start, start + count)``, int64 on ``device``."""
    idx = torch.arange(start, start + count, dtype=torch.int64, device=device) + _signed(seed)
    return _mix(idx) | 1


_A_CACHE: dict[str, torch.Tensor] = {}
_B_CACHE: dict[str, torch.Tensor] = {}


def _a(device) -> torch.Tensor:
    key = str(device)
    a = _A_CACHE.get(key)
    if a is None:
        a = _A_CACHE[key] = _coefficients(0, ROW, SEED_A, device)
    return a


def _b(device, rows: int) -> torch.Tensor:
    """``b[0:rows]`` on ``device``, from a per-device cache grown to the next power of two."""
    key = str(device)
    b = _B_CACHE.get(key)
    if b is None or b.numel() < rows:
        b = _B_CACHE[key] = _coefficients(0, max(1 << max(rows - 1, 0).bit_length(), 64), SEED_B, device)
    return b[:rows]


def raw_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous tensor's bytes as a flat uint8 view, and its item size.
    ``CheckpointFormatError`` for a non-contiguous tensor (never copied)."""
    if not t.is_contiguous():
        raise CheckpointFormatError(f"lin64 digests a contiguous tensor's bytes; this {t.dtype} "
                                    f"{list(t.shape)} has strides {list(t.stride())} (no silent copy)")
    return t.detach().reshape(-1).view(torch.uint8), t.element_size()


def _fmt(total: int) -> str:
    return f"{PREFIX}{total & _MASK:016x}"


def lin64(t: torch.Tensor, *, engine: str | None = None) -> str:
    """The ``lin64`` digest of a contiguous tensor's bytes (module doc), computed on its device.

    ``engine``: ``"numpy"`` (CPU tensors only: the default there) or ``"torch"`` (the default on
    any other device; on the CPU for tests). ``CheckpointFormatError`` for a non-contiguous tensor.
    """
    return lin64_many([t], engine=engine)[0]


def lin64_many(tensors, *, engine: str | None = None) -> list[str]:
    """``lin64`` of each tensor, each on its own device; the device sums are read back together,
    one host synchronisation per device rather than one per tensor (a delta's bucket on a GPU), and
    on a device the tensors' row sums are combined together (a few kernels per bucket, not two per
    tensor). ``tensors`` may be a generator: each is let go once its digest is queued."""
    queued = lin64_queue(tensors, engine=engine)
    return [q.digest(v) for q, v in zip(queued, read_ints([q.total for q in queued]))]


def lin64_queue(tensors, *, engine: str | None = None) -> list[Queued]:
    """``lin64_many`` without the read-back: each tensor's ``Queued`` sum (a 0-d int64 tensor on its device,
    still being computed there, or a host int), for a caller that reads many values back at once or
    compares them on the device."""
    if isinstance(tensors, list) and tensors:
        fast = _queue_words(tensors, engine)
        if fast is not None:
            return fast
    queued: list[Queued] = []
    rows: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}   # device -> (index, its row sums)
    batch: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}  # device -> (index, its words): one kernel
    held = 0
    for i, t in enumerate(tensors):
        raw, size = raw_of(t)
        kind = engine or ("numpy" if raw.device.type == "cpu" else "torch")
        if kind not in ("numpy", "torch"):
            raise ValueError(f"unknown lin64 engine {kind!r}")
        queued.append(Queued(_sum_numpy(raw) if kind == "numpy" else 0, mix_int((raw.numel() << 5) | size)))
        if kind == "torch":
            if raw.numel() % 8 == 0 and raw.data_ptr() % 8 == 0 and kernels(raw.device) is not None:
                batch.setdefault(raw.device, []).append((i, raw.view(torch.int64)))   # whole aligned words
                held += raw.numel()
                if held >= _BATCH_BYTES:   # the batch holds its tensors (a cast copy too) until its launch
                    _rows_batched(batch, rows)
                    held = 0
            else:
                rows.setdefault(raw.device, []).append((i, _rows_torch(raw)))
        del t, raw   # a cast copy the caller made for this digest is freed now (the kernels are queued)
    _rows_batched(batch, rows)
    for group in rows.values():
        inner = [r for _, r in group]
        b = _b(group[0][1].device, max(r.numel() for r in inner))
        totals = _segment_sums(torch.cat(inner), [r.numel() for r in inner], lambda j: b[j])
        for (i, _), total in zip(group, totals):
            queued[i].total = total
    return queued


def _queue_words(tensors: list[torch.Tensor], engine: str | None) -> list[Queued] | None:
    """``lin64_queue`` of a list of contiguous tensors of whole, 8-byte aligned words on one device where the row
    kernel runs (a bucket's payload bodies, its live targets): one launch by address and one segmented sum, no
    view made per tensor. None where any tensor is otherwise (the general path then takes them)."""
    device = tensors[0].device
    if (engine or ("numpy" if device.type == "cpu" else "torch")) != "torch" or kernels(device) is None:
        return None
    ptrs, nwords, tails = [], [], []
    for t in tensors:
        size = t.element_size()
        nbytes, ptr = t.numel() * size, t.data_ptr()
        if nbytes % 8 or ptr % 8 or t.device != device or not t.is_contiguous():
            return None
        ptrs.append(ptr)
        nwords.append(nbytes >> 3)
        tails.append(mix_int((nbytes << 5) | size))
    rows = [-(-n // ROW) for n in nwords]
    sums = lin64_rows_at(device, ptrs, nwords, rows, _a(device), ROW)
    if sums is None:
        return None
    b = _b(device, max(rows))
    return [Queued(total, tail) for total, tail in zip(_segment_sums(sums, rows, lambda j: b[j]), tails)]


def _rows_batched(batch: dict[torch.device, list[tuple[int, torch.Tensor]]],
                  rows: dict[torch.device, list[tuple[int, torch.Tensor]]]) -> None:
    """The row sums of every batched tensor, one kernel per device (``lin64_rows_many``), into ``rows``;
    the batch is emptied. Where the kernel is not used, each tensor's row sums as ``_rows_torch`` gives them."""
    for device, items in batch.items():
        sums = lin64_rows_many([w for _, w in items], _a(device), ROW)
        if sums is None:
            sums = [_rows_torch(w.view(torch.uint8)) for _, w in items]
        rows.setdefault(device, []).extend((i, r) for (i, _), r in zip(items, sums))
    batch.clear()


class Queued:
    """A ``lin64`` whose sum may still be running on a device: ``total`` (a 0-d int64 tensor there,
    or a host int) and the size term; ``digest(value)`` once ``total`` was read back (``read_ints``)."""

    __slots__ = ("total", "tail")

    def __init__(self, total: torch.Tensor | int, tail: int):
        self.total, self.tail = total, tail

    def digest(self, value: int) -> str:
        return _fmt(value + self.tail)


def queue(t: torch.Tensor, *, engine: str | None = None) -> Queued:
    """Start ``lin64(t)`` without waiting for it: on a device its kernels are queued and nothing is
    read back (``read_ints`` reads many at once); on the host (numpy) it is computed now."""
    raw, size = raw_of(t)
    tail = mix_int((raw.numel() << 5) | size)
    kind = engine or ("numpy" if raw.device.type == "cpu" else "torch")
    if kind == "numpy":
        return Queued(_sum_numpy(raw), tail)
    if kind == "torch":
        return Queued(_sum_torch(raw), tail)
    raise ValueError(f"unknown lin64 engine {kind!r}")


def queue_many(tensors: list[torch.Tensor], *, engine: str | None = None) -> list[Queued]:
    """``queue`` of each tensor; those on a device digested together, for small tensors (a bucket's
    payload bodies): their bytes are concatenated (zero-padded to whole words each) and every word's
    coefficient comes from its index in its own tensor, so a dozen kernels serve the lot instead of
    several per tensor. The host's tensors, and ``engine="numpy"``, go one by one."""
    out: list[Queued | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        raw, _ = raw_of(t)
        if (engine or ("numpy" if raw.device.type == "cpu" else "torch")) == "numpy":
            out[i] = queue(t, engine="numpy")
        else:
            by_device.setdefault(raw.device, []).append(i)
    for idx in by_device.values():
        for i, total in zip(idx, _sums_together([raw_of(tensors[i])[0] for i in idx])):
            raw, size = raw_of(tensors[i])
            out[i] = Queued(total, mix_int((raw.numel() << 5) | size))
    return out   # type: ignore[return-value]


def _sums_together(raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_sum_torch`` of each flat uint8 tensor (one device), computed over their concatenation."""
    device = raws[0].device
    parts, counts = [], []
    for raw in raws:
        parts.append(raw)
        pad = -raw.numel() % 8
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        counts.append((raw.numel() + pad) // 8)
    a, b = _a(device), _b(device, max(counts) // ROW + 1)
    return _segment_sums(torch.cat(parts).view(torch.int64), counts, lambda j: a[j % ROW] * b[j // ROW])


def _segment_sums(values: torch.Tensor, counts: list[int], coef) -> list[torch.Tensor]:
    """For consecutive segments of ``counts`` int64 ``values`` (one device): each segment's sum of
    ``value * coef(j)`` mod 2**64, ``j`` a value's index in its own segment; 0-d tensors, nothing read
    back (the sizes go to the device without waiting for it; one cumsum, exact: it wraps mod 2**64)."""
    device, total = values.device, values.numel()
    ends = [0]
    for c in counts:
        ends.append(ends[-1] + c)
    at = to_device(torch.tensor(ends, dtype=torch.int64), device)   # a blocking copy would sync
    running = values.new_zeros(total + 1)
    if total:
        # each value's segment start, as a running sum of the segments' lengths added where each next one
        # starts (empty segments add at the same place): two light kernels, not a repeat_interleave
        steps = values.new_zeros(total + 1)
        steps.index_add_(0, at[1:-1], at[1:-1] - at[:-2])
        first = torch.cumsum(steps[:total], 0)
        local = torch.arange(total, dtype=torch.int64, device=device) - first
        torch.cumsum(values * coef(local), 0, out=running[1:])
    return list((running[at[1:]] - running[at[:-1]]).unbind(0))


def read_ints(values) -> list[int]:
    """Host ints of ``values`` (host ints, or 0-d integer tensors on any device), reading each
    device's tensors back together: one host synchronisation per device, not one per value."""
    out: list[int] = [v if isinstance(v, int) else 0 for v in values]
    pending: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if not isinstance(v, int):
            pending.setdefault(v.device, []).append(i)
    for idx in pending.values():
        got = torch.stack([values[i].to(torch.int64) for i in idx]).tolist()
        for i, value in zip(idx, got):
            out[i] = value
    return out


class ReadLater:
    """Integer ``values`` (0-d integer tensors on one device, or host ints) copied to the host without the
    host waiting: on a CUDA device into page-locked memory behind an event, so that ``wait()`` waits for the
    work queued before them and not for what is queued after (a pipelined delta's next bucket)."""

    def __init__(self, values):
        self.ints: list[int | None] = [v if isinstance(v, int) else None for v in values]
        tensors = [v if v.dtype == torch.int64 and v.dim() == 0 else v.to(torch.int64).reshape(())
                   for v in values if not isinstance(v, int)]
        self.event: torch.cuda.Event | None = None
        self.host: torch.Tensor | None = None
        if tensors:
            stacked = torch.stack(tensors)
            if stacked.device.type == "cuda":
                self.host = torch.empty(len(tensors), dtype=torch.int64, pin_memory=True)
                self.host.copy_(stacked, non_blocking=True)
                self.event = torch.cuda.Event()
                self.event.record(torch.cuda.current_stream(stacked.device))
            else:
                self.host = stacked.cpu()

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        got = iter(self.host.tolist() if self.host is not None else [])
        return [next(got) if v is None else v for v in self.ints]


_LIN64_TEXT = re.compile(re.escape(PREFIX) + "[0-9a-f]{16}")


def is_lin64(digest: object) -> bool:
    """Whether ``digest`` is written as a lin64 digest (``"lin64:"`` and 16 lowercase hex digits)."""
    return isinstance(digest, str) and _LIN64_TEXT.fullmatch(digest) is not None


# -- torch: any device -----------------------------------------------------------------------
def _word_chunk(raw: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Words ``[start, start + count)`` of ``raw`` (flat uint8) as int64: a view where the bytes are
    8-byte aligned in their storage, else an aligned copy of this chunk only."""
    part = raw[8 * start: 8 * (start + count)]
    if part.storage_offset() % 8 == 0:
        return part.view(torch.int64)
    out = torch.empty(count, dtype=torch.int64, device=raw.device)
    out.view(torch.uint8).copy_(part)
    return out


def _sum_torch(raw: torch.Tensor) -> torch.Tensor:
    """``sum_i word_i * c_i`` mod 2**64 with torch ops on the bytes' device: a 0-d int64 tensor
    there (not read back: ``read_ints`` reads a device's sums together)."""
    inner = _rows_torch(raw)
    return (inner * _b(raw.device, inner.numel())).sum()


def _rows_torch(raw: torch.Tensor) -> torch.Tensor:
    """Each row's ``sum_k word[j, k] * a[k]`` (int64, on the bytes' device): the digest is their sum
    with the rows' coefficients ``b[j]`` (``_sum_torch``, or many tensors' at once in ``lin64_many``)."""
    device = raw.device
    a = _a(device)
    n = raw.numel()
    m, rest = divmod(n, 8)
    rows = -(-(m + (rest > 0)) // ROW)
    fused = lin64_rows(raw[: 8 * m].view(torch.int64), a, rows, ROW) \
        if m and raw.storage_offset() % 8 == 0 else None   # one pass, no temporary (_kernels.py)
    inner = fused if fused is not None else torch.empty(rows, dtype=torch.int64, device=device)
    for start in range(0, m if fused is None else 0, CHUNK):
        words = _word_chunk(raw, start, min(CHUNK, m - start))
        full, part = divmod(words.numel(), ROW)
        row = start // ROW
        if full:
            torch.sum(words[: full * ROW].view(full, ROW) * a, dim=1, out=inner[row: row + full])
        if part:
            inner[row + full] = (words[full * ROW:] * a[:part]).sum()
    if rest:   # the last word, zero-padded: row m // ROW, column m % ROW
        pad = torch.zeros(8, dtype=torch.uint8, device=device)
        pad[:rest] = raw[8 * m:]
        last = pad.view(torch.int64) * a[m % ROW]
        if m % ROW:
            inner[m // ROW: m // ROW + 1] += last
        else:
            inner[m // ROW: m // ROW + 1] = last
    return inner


# -- numpy: the host ------------------------------------------------------------------------
def _sum_words_numpy(w: np.ndarray, start: int, a: np.ndarray, b: np.ndarray) -> int:
    """``sum word * c`` (not reduced) of the uint64 words ``w``, word ``start`` onwards: a partial row
    up to the next row border, then each full row's dot with ``a`` (numpy's integer matmul: a fused
    loop, no temporary) and those with ``b``, then a partial last row."""
    total = 0
    with np.errstate(over="ignore"):
        head = min((-start) % ROW, w.size)
        if head:
            col = start % ROW
            total += int(np.dot(w[:head], a[col: col + head])) * int(b[start // ROW])
        w, start = w[head:], start + head
        full, part = divmod(w.size, ROW)
        row = start // ROW
        if full:
            total += int(np.dot(w[: full * ROW].reshape(full, ROW) @ a, b[row: row + full]))
        if part:
            total += int(np.dot(w[full * ROW:], a[:part])) * int(b[row + full])
    return total


def _host_ab(words: int) -> tuple[np.ndarray, np.ndarray]:
    """The host's ``a`` and ``b`` (covering ``words`` words and the padded last one) as uint64 arrays."""
    return _a("cpu").numpy().view(np.uint64), _b("cpu", words // ROW + 1).numpy().view(np.uint64)


def lin64_host(data: np.ndarray, item_size: int = 1) -> str:
    """``lin64`` of the bytes of a flat uint8 array (on the host, this thread; ``item_size``: the
    item size the digest names): the encode's path for a payload body, without the tensor wrapping."""
    m = data.size // 8
    a, b = _host_ab(m)
    total = _sum_words_numpy(data[: 8 * m].view(np.uint64), 0, a, b) + _last_word(data, a, b)
    return _fmt(total + mix_int((data.size << 5) | item_size))


class HostDigest:
    """``lin64`` of a CPU tensor computed in parts, as another pass over its bytes goes (the PS's
    encode digests each block while it compares it: the bytes are read from memory once).
    ``upto(nbytes)`` digests the words of the first ``nbytes`` bytes not digested yet (whole words
    only); ``digest()`` the rest, and the result."""

    def __init__(self, t: torch.Tensor):
        raw, self.size = raw_of(t)
        self.data = raw.numpy()
        self.m = self.data.size // 8
        self.words = self.data[: 8 * self.m].view(np.uint64)   # little-endian words of its own bytes
        self.a, self.b = _host_ab(self.m)
        self.done, self.total = 0, 0

    def upto(self, nbytes: int) -> None:
        end = min(nbytes // 8, self.m)
        if end > self.done:
            self.total += _sum_words_numpy(self.words[self.done: end], self.done, self.a, self.b)
            self.done = end

    def digest(self) -> str:
        self.upto(8 * self.m)
        n = self.data.size
        return _fmt(self.total + _last_word(self.data, self.a, self.b) + mix_int((n << 5) | self.size))


def _sum_numpy(raw: torch.Tensor) -> int:
    data = raw.numpy()
    m = data.size // 8
    w = data[: 8 * m].view(np.uint64)   # little-endian words of the tensor's own bytes (no copy)
    a, b = _host_ab(m)
    spans = [(s, min(s + CHUNK, m)) for s in range(0, m, CHUNK)]
    threads = 1 if m < _NP_THREADS_MIN_WORDS else min(delta_threads(), os.cpu_count() or 1, len(spans))
    if threads < 2:
        total = _sum_words_numpy(w, 0, a, b)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-lin64") as pool:
            total = sum(pool.map(lambda se: _sum_words_numpy(w[se[0]: se[1]], se[0], a, b), spans))
    return (total + _last_word(data, a, b)) & _MASK


def _last_word(data: np.ndarray, a: np.ndarray, b: np.ndarray) -> int:
    """The term of the last word when the bytes end inside one (zero-padded), else 0."""
    m, rest = divmod(data.size, 8)
    if not rest:
        return 0
    return int.from_bytes(data[8 * m:].tobytes(), "little") * int(a[m % ROW]) * int(b[m // ROW])


__all__ = ["PREFIX", "ROW", "CHUNK", "HostDigest", "Queued", "lin64", "lin64_many", "lin64_queue", "queue",
           "queue_many", "read_ints", "ReadLater", "is_lin64", "lin64_host", "raw_of", "mix_int"]
