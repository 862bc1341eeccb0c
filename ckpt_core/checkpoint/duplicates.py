"""Tensor names that occur more than once in one rank's registration.

The reference accepts them (its own tests register tensors that sit both in a
disk file and in a /dev/shm file). Here a byte-identical duplicate (same dtype,
shape and bytes) is registered once, from its first occurrence, with a warning
naming both sources; a duplicate that differs is a ``CheckpointFormatError``
naming both sources and the tensor, raised before anything is allocated.
Sources are only read, never modified.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from ckpt_core.checkpoint.safetensors import SafetensorsHeader
from ckpt_core.errors import CheckpointFormatError
from ckpt_core.ops.log import rank_logger

COMPARE_CHUNK = 64 << 20   # bytes compared at a time: a duplicate embedding need not be held twice
NAMED = "named_tensors"
_log = rank_logger("register")

Reader = Callable[[int, int], bytes]


def _file_reader(path: str, start: int) -> Reader:
    def read(offset: int, n: int) -> bytes:
        fd = os.open(path, os.O_RDONLY)
        try:
            out = bytearray()
            while len(out) < n:
                got = os.pread(fd, n - len(out), start + offset + len(out))
                if not got:
                    raise CheckpointFormatError(f"file ended while comparing a duplicate at offset "
                                                f"{start + offset + len(out)}", path=path)
                out += got
            return bytes(out)
        finally:
            os.close(fd)
    return read


def _tensor_reader(t: torch.Tensor) -> Reader:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return lambda offset, n: flat[offset: offset + n].numpy().tobytes()


def _same_bytes(a: Reader, b: Reader, nbytes: int) -> bool:
    for off in range(0, nbytes, COMPARE_CHUNK):
        n = min(COMPARE_CHUNK, nbytes - off)
        if a(off, n) != b(off, n):
            return False
    return True


def dedupe(headers: list[SafetensorsHeader], named: list[tuple[str, torch.Tensor]]
           ) -> tuple[set[tuple[int, str]], list[tuple[str, torch.Tensor]]]:
    """Resolve duplicate names across ``headers`` (in order) and then ``named``.

    Returns the file entries to leave out, as ``(index in headers, tensor name)``, and the
    named tensors to keep. Raises ``CheckpointFormatError`` on a differing duplicate.
    """
    first: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, Reader]] = {}
    skip: set[tuple[int, str]] = set()
    kept: list[tuple[str, torch.Tensor]] = []
    sources = [(i, h.path, e.name, e.dtype, tuple(e.shape), e.nbytes, _file_reader(h.path, e.start))
               for i, h in enumerate(headers) for e in h.tensors]
    sources += [(-1, NAMED, n, t.dtype, tuple(t.shape), t.numel() * t.element_size(), t) for n, t in named]
    for index, where, name, dtype, shape, nbytes, src in sources:
        if name not in first:
            first[name] = (where, dtype, shape, nbytes, src)
            if where == NAMED:
                kept.append((name, src))
            continue
        where0, dtype0, shape0, nbytes0, src0 = first[name]
        read0 = _tensor_reader(src0) if where0 == NAMED else src0
        read1 = _tensor_reader(src) if where == NAMED else src
        if (dtype, shape) != (dtype0, shape0):
            raise CheckpointFormatError(f"tensor appears in both {where0} ({dtype0}, {list(shape0)}) and {where} "
                                        f"({dtype}, {list(shape)}) with different dtype or shape", tensor=name)
        if not _same_bytes(read0, read1, nbytes):
            raise CheckpointFormatError(f"tensor appears in both {where0} and {where} with different bytes",
                                        tensor=name)
        _log.warning("tensor %r appears in both %s and %s with identical bytes; registered once, from %s",
                     name, where0, where, where0)
        if where != NAMED:
            skip.add((index, name))
    return skip, kept
