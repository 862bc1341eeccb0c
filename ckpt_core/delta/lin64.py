"""``lin64``: a linear digest mod 2**64 of a tensor's bytes, computed where the tensor lives.

A delta's post-apply check (``apply.py``) digests every changed tensor an engine worker holds. A
SHA-256 of the bytes needs them on the host: a device-to-host copy of every changed tensor, which
dominated a delta update's time. ``lin64`` runs as a few integer tensor ops on the tensor's own
device (no host copy), and on the host as numpy on a small thread pool (about as fast as the
SHA-256 it replaces, ``benchmarks/delta_digest_bench.py``).

Definition (the same on every device, pinned by ``tests/unit/test_delta_lin64.py`` against a
plain-Python reference). The contiguous tensor's bytes are read as ``n`` two's-complement words
of its item size ``w`` (int8, int16, int32 or int64; items of 16 bytes as two int64 words), each
sign-extended to 64 bits. Word ``i`` gets the coefficient ``c_i = a[i % ROW] * b[i // ROW]`` with
``a[k] = mix(k + SEED_A) | 1``, ``b[j] = mix(j + SEED_B) | 1`` (``mix``: splitmix64's
finalizer); a product of odd numbers, ``c_i`` is odd. Then, all mod 2**64::

    lin64 = sum_i word_i * c_i  +  mix((n << 4) | w)

written ``"lin64:<16 hex digits>"``. Integer sums mod 2**64 are exact and do not depend on the
order of the additions, so a GPU's reduction gives the CPU's value bit for bit.

What it guarantees: any change of one word (one element of item size 1-8) changes the digest:
the change is ``d * c_i`` with ``0 < |d| < 2**64`` and ``c_i`` odd, hence invertible mod 2**64.
So a dropped, duplicated-onto or corrupted single element is always caught, and the word count
and width are in it. Changes of several elements are caught unless they cancel exactly, which
random or systematic faults (a lost scatter, a shifted write, a stale region) do not do by
chance (about 2**-64 for unstructured changes). It is **not** a cryptographic hash: anyone who
can choose the bytes can build a collision (it is linear). The transport's integrity against a
foreign writer stays with the SHA-256 registration digests of ``p2p/digests.py``.

Memory stays bounded: the words go through in chunks of ``CHUNK`` words (a ``CHUNK``-sized int64
temporary on the device), and the coefficients are computed per chunk (``ROW`` + ``CHUNK/ROW``
of them), never a table the size of the model.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ckpt_core._settings import fault_threads
from ckpt_core.errors import CheckpointFormatError

PREFIX = "lin64:"
ROW = 4096                 # words per row: a[k] repeats every ROW words, b[j] changes every row
CHUNK = 1 << 23            # words per chunk (a multiple of ROW): a 64 MiB int64 temporary at most
_BLOCK_ROWS = 32           # rows per numpy block: a 1 MiB uint64 buffer, in cache (measured best)
SEED_A = 0x6C696E3634A11CE5
SEED_B = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_THREADS_MIN_WORDS = 1 << 21   # below: one thread (the pool's start costs more than it saves)


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


def _a(device) -> torch.Tensor:
    key = str(device)
    a = _A_CACHE.get(key)
    if a is None:
        a = _A_CACHE[key] = _coefficients(0, ROW, SEED_A, device)
    return a


def words_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A contiguous tensor's bytes as flat signed words of its item size, and that width in bytes
    (16-byte items: int64 words). ``CheckpointFormatError`` for a non-contiguous tensor (never copied)."""
    if not t.is_contiguous():
        raise CheckpointFormatError(f"lin64 digests a contiguous tensor's bytes; this {t.dtype} "
                                    f"{list(t.shape)} has strides {list(t.stride())} (no silent copy)")
    size = t.element_size()
    flat = t.detach().reshape(-1)
    if size in _INT_OF_SIZE:
        return flat.view(_INT_OF_SIZE[size]), size
    return flat.view(torch.uint8).view(torch.int64), 8


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
    one host synchronisation per device rather than one per tensor (a delta's bucket of small
    tensors on a GPU). ``tensors`` may be a generator: each is let go once its digest is queued."""
    queued = [queue(t, engine=engine) for t in tensors]
    return [q.digest(v) for q, v in zip(queued, read_ints([q.total for q in queued]))]


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
    words, width = words_of(t)
    tail = mix_int((words.numel() << 4) | width)
    kind = engine or ("numpy" if words.device.type == "cpu" else "torch")
    if kind == "numpy":
        return Queued(_sum_numpy(words), tail)
    if kind == "torch":
        return Queued(_sum_torch(words), tail)
    raise ValueError(f"unknown lin64 engine {kind!r}")


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


def is_lin64(digest: object) -> bool:
    """Whether ``digest`` is written as a lin64 digest (``"lin64:"`` and 16 lowercase hex digits)."""
    if not isinstance(digest, str) or not digest.startswith(PREFIX) or len(digest) != len(PREFIX) + 16:
        return False
    return all(c in "0123456789abcdef" for c in digest[len(PREFIX):])


# -- torch: any device -----------------------------------------------------------------------
def _sum_torch(words: torch.Tensor) -> torch.Tensor:
    """``sum_i word_i * c_i`` mod 2**64 with torch ops on the words' device: a 0-d int64 tensor
    there (not read back: ``lin64_many`` reads a device's sums together)."""
    device = words.device
    a = _a(device)
    n = words.numel()
    total = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n, CHUNK):
        chunk = words[start: start + CHUNK]
        rows, tail = divmod(chunk.numel(), ROW)
        first_row = start // ROW
        if rows:
            inner = (chunk[: rows * ROW].view(rows, ROW) * a).sum(dim=1)   # int64, wraps
            total += (inner * _coefficients(first_row, rows, SEED_B, device)).sum()
        if tail:
            inner_tail = (chunk[rows * ROW:] * a[:tail]).sum()
            total += inner_tail * _coefficients(first_row + rows, 1, SEED_B, device)[0]
    return total


# -- numpy: the host ------------------------------------------------------------------------
def _sum_rows_numpy(w: np.ndarray, first_row: int, a: np.ndarray) -> int:
    """``sum word * c`` mod 2**64 of ``w`` (signed words, starting at row ``first_row``), in
    cache-sized blocks: widen to uint64 (sign-extending: C's conversion is mod 2**64), multiply, sum."""
    n = w.size
    rows = -(-n // ROW)
    b = _coefficients(first_row, rows, SEED_B, "cpu").numpy().view(np.uint64)
    inner = np.empty(rows, dtype=np.uint64)
    step = _BLOCK_ROWS * ROW
    buf = np.empty(step, dtype=np.uint64)
    for s in range(0, n, step):
        block = w[s: s + step]
        m = block.size
        full, tail = divmod(m, ROW)
        view = buf[:m]
        np.copyto(view, block, casting="unsafe")
        if full:
            part = view[: full * ROW].reshape(full, ROW)
            np.multiply(part, a, out=part)
            part.sum(axis=1, dtype=np.uint64, out=inner[s // ROW: s // ROW + full])
        if tail:
            rest = view[full * ROW:]
            np.multiply(rest, a[:tail], out=rest)
            inner[s // ROW + full] = rest.sum(dtype=np.uint64)
    with np.errstate(over="ignore"):
        return int(np.multiply(inner, b).sum(dtype=np.uint64))


def _sum_numpy(words: torch.Tensor) -> int:
    w = words.numpy()
    a = _a("cpu").numpy().view(np.uint64)
    n = w.size
    spans = [(s, min(s + CHUNK, n)) for s in range(0, n, CHUNK)]
    threads = min(fault_threads(), os.cpu_count() or 1, len(spans))
    if threads < 2 or n < _NP_THREADS_MIN_WORDS:
        parts = [_sum_rows_numpy(w[s:e], s // ROW, a) for s, e in spans]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-lin64") as pool:
            parts = list(pool.map(lambda se: _sum_rows_numpy(w[se[0]: se[1]], se[0] // ROW, a), spans))
    return sum(parts) & _MASK


__all__ = ["PREFIX", "ROW", "CHUNK", "Queued", "lin64", "lin64_many", "queue", "read_ints", "is_lin64", "words_of",
           "mix_int"]
