"""A large tensor's ``idx`` or ``gap16`` payload written by one compiled call straight into the companion's
buffer (``batch._large`` with the compiled pass, ``_scan.py``).

``encode._encoded`` builds a payload in numpy: an array of the gaps, a zeroed body, a gather of the values,
a ``lin64`` pass over the body, then the payload copied into a fresh array, and ``Encoded.write`` copies it
once more into the companion's region: on the 2-core CPU machine, dense16 x0.05 at 2 % (854 MB, 8.5 M
changed bf16 items), ~170 ms of one thread's time against the compare's ~220 ms. Here the registration's
encode keeps each large changed tensor's positions and its header (``plan``: the encoding chosen by
``Sizes.best``'s rule from the positions' largest gap and runs, found by one compiled loop), and
``write_direct`` writes each body (its index section from the positions, its values from the tensor's bytes
in the new version's region, both zero-padded) and sums its ``lin64`` check in one call, into the buffer
the payloads go to. The bytes are ``encode_tensor``'s (``tests/unit/test_delta_batch.py`` compares them);
``bitmap`` and ``runs`` (rare: dense or clustered changes) still go through ``encode._encoded``.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from ckpt_core.delta._scan import kernel
from ckpt_core.delta.encode import frame_head, index_width, measure
from ckpt_core.delta.lin64 import _MASK, ROW, _host_ab, mix_int

_PLACEHOLDER = "lin64:" + "0" * 16   # a body check's place in a header (same length as any check)


@functools.lru_cache(maxsize=4096)
def _size_term(nbytes: int, itemsize: int) -> int:
    """lin64's term of a byte count and item size (``mix_int``: pure Python; tensors repeat shapes)."""
    return mix_int((nbytes << 5) | itemsize)


def head_of(meta, enc: str, count: int, digest: str, body: int) -> tuple[bytes, int]:
    """The framed header of an ``idx`` or ``gap16`` payload of ``meta``'s tensor, with its body's check a
    placeholder, and where the check's 16 hex digits lie in it."""
    # encode._payload's JSON (compact separators, its key order); the codes, names and digests
    # are plain ASCII, the rest ints: what json.dumps writes (test_delta_batch compares the bytes)
    text = (f'{{"dtype":"{meta.dtype}","shape":[{",".join(map(str, meta.shape))}],"enc":"{enc}",'
            f'"count":{count},"runs":0,"digest":"{digest}","body":{body},"check":"{_PLACEHOLDER}"}}').encode()
    return frame_head(text), 8 + len(text) - 18


class DirectPayload(NamedTuple):
    """A payload to write (``write_direct``): its header (check to come), the check's place in it, the body's
    bytes, the changed positions (int64, increasing), the tensor's bytes (flat uint8, 8-byte aligned),
    its item size, and the index section's kind (2: ``gap16``; 4 or 8: ``idx`` of that width)."""
    head: bytes
    hex_at: int
    body: int
    positions: np.ndarray
    data: np.ndarray
    size: int
    kind: int


def plan(lib, meta, data: np.ndarray, positions: np.ndarray, digest: str) -> tuple[DirectPayload | None, dict]:
    """``meta``'s payload for its changed ``positions`` (non-empty) when ``encode_tensor`` would encode it
    ``idx`` or ``gap16``, with ``encode_tensor``'s info; ``(None, {})`` for another encoding."""
    stats = np.empty(2, dtype=np.int64)
    lib.ckd_gap_stats(positions.ctypes.data, positions.size, stats.ctypes.data)
    size, count = meta.itemsize, int(positions.size)
    numel = meta.nbytes // size
    sizes = measure(numel, size, count, int(stats[1]), int(stats[0]))
    enc = sizes.best()
    if enc not in ("idx", "gap16"):
        return None, {}
    body = getattr(sizes, enc)
    head, hex_at = head_of(meta, enc, count, digest, body)
    kind = 2 if enc == "gap16" else index_width(numel)
    return (DirectPayload(head, hex_at, body, positions, data, size, kind),
            {"encoding": enc, "count": count, "numel": numel, "bytes": len(head) + body})


def write_direct(buf: np.ndarray, items: list[tuple[int, DirectPayload]], threads: int) -> None:
    """Each payload at its offset in ``buf`` (uint8): header, body and the body's check, on ``threads``
    threads (the compiled calls release the GIL)."""
    if not items:
        return
    lib = kernel()
    assert lib is not None, "a DirectPayload is made by the compiled pass only"  # noqa: S101 - our invariant
    a, b = _host_ab(max(p.body for _, p in items) // 8)

    def one(item: tuple[int, DirectPayload]) -> None:
        at, p = item
        end = at + len(p.head)
        assert end + p.body <= buf.size and end % 8 == 0, "payloads lie 8-aligned in the buffer"  # noqa: S101
        buf[at: end] = np.frombuffer(p.head, dtype=np.uint8)
        total = lib.ckd_body(p.positions.ctypes.data, p.positions.size, p.data.ctypes.data, p.size, p.kind,
                             buf.ctypes.data + end, p.body, ROW, a.ctypes.data, b.ctypes.data)
        check = (int(total) + _size_term(p.body, 1)) & _MASK
        buf[at + p.hex_at: at + p.hex_at + 16] = np.frombuffer(f"{check:016x}".encode(), dtype=np.uint8)
    if threads > 1 and len(items) > 1:
        with ThreadPoolExecutor(min(threads, len(items)), thread_name_prefix="ckpt-delta-write") as pool:
            list(pool.map(one, items))
    else:
        for item in items:
            one(item)


__all__ = ["DirectPayload", "head_of", "plan", "write_direct"]
