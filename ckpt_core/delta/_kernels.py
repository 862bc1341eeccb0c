"""Fused device kernels for a delta's apply and check, written in Triton, with the torch ops as the fallback.

A delta's apply gathers the old values at the changed positions (for an undo) and scatters the new
ones: two torch ops, each reading the positions; the swap kernel does both in one, reading each position
once. The post-apply check digests every changed tensor an engine worker holds (``lin64.py``): with torch ops
each 64 MiB chunk of words is multiplied into a temporary of its size and then summed, three passes over
the bytes. The kernel here reads each word once and keeps the products in registers: one pass, the
tensor's bytes read at the device's memory rate. The arithmetic is the same integer arithmetic mod 2**64
(wrapping int64 products and sums, in any order), so its row sums equal the torch path's bit for bit;
``tests/gpu/test_delta_lin64_gpu.py`` compares the digests with the host's.

Used only on CUDA devices where Triton imports and ``CKPT_DELTA_TRITON`` is not 0; elsewhere (the CPU,
other devices, a missing Triton, a tensor whose bytes are not 8-byte aligned) the torch ops run. A kernel
that fails to build is reported once in the log and the torch ops take over for the process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ckpt_core._settings import delta_triton

_log = logging.getLogger("ckpt_core.delta")
_STATE: dict[str, Any] = {"kernels": None, "failed": False}
_BLOCK = 1024


def _build() -> Any:
    """The kernels (a namespace), or None where Triton does not import."""
    try:
        import triton
        import triton.language as tl
    except Exception:   # noqa: BLE001 - any import failure means: no kernels here
        return None

    @triton.jit
    def rows_kernel(words_ptr, a_ptr, out_ptr, n_words, ROW: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row of ROW words: sum_k word[row, k] * a[k] (int64, wrapping)
        row = tl.program_id(0)
        start = row.to(tl.int64) * ROW
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, ROW, BLOCK):
            cols = k + tl.arange(0, BLOCK)
            idx = start + cols
            w = tl.load(words_ptr + idx, mask=idx < n_words, other=0)
            a = tl.load(a_ptr + cols)
            acc += w * a
        tl.store(out_ptr + row, tl.sum(acc, axis=0))

    @triton.jit
    def swap_kernel(words_ptr, pos_ptr, values_ptr, old_ptr, n, BLOCK: tl.constexpr):
        # old[i] = words[pos[i]]; words[pos[i]] = values[i]: positions checked in range and strictly
        # increasing before (decode_many), so no two programs touch one word
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        p = tl.load(pos_ptr + i, mask=m, other=0)
        tl.store(old_ptr + i, tl.load(words_ptr + p, mask=m), mask=m)
        tl.store(words_ptr + p, tl.load(values_ptr + i, mask=m), mask=m)

    class Kernels:
        rows = rows_kernel
        swap = swap_kernel

    return Kernels


def kernels(device: torch.device) -> Any:
    """The Triton kernels for ``device``, or None (not CUDA, turned off, no Triton, or a kernel failed)."""
    if device.type != "cuda" or _STATE["failed"] or not delta_triton():
        return None
    if _STATE["kernels"] is None:
        _STATE["kernels"] = _build() or False
    return _STATE["kernels"] or None


def _failed(what: str, exc: BaseException) -> None:
    _STATE["failed"] = True
    _log.warning("the Triton kernel for %s failed (%s: %s); torch ops are used from now on", what,
                 type(exc).__name__, exc)


def lin64_rows(words: torch.Tensor, a: torch.Tensor, rows: int, row_len: int) -> torch.Tensor | None:
    """Each row's ``sum_k words[j * row_len + k] * a[k]`` for the int64 ``words`` (flat, on a CUDA
    device, the last row zero-padded), as int64 ``[rows]``; None where the kernel is not used (then the
    caller runs the torch ops)."""
    k = kernels(words.device)
    if k is None or words.data_ptr() % 8 or row_len % _BLOCK:
        return None
    out = torch.empty(rows, dtype=torch.int64, device=words.device)
    if rows == 0:
        return out
    try:
        with torch.cuda.device(words.device):
            k.rows[(rows,)](words, a, out, words.numel(), ROW=row_len, BLOCK=_BLOCK)
    except Exception as exc:   # noqa: BLE001 - a compile or launch failure: the torch path is exact too
        _failed("lin64", exc)
        return None
    return out


def scatter_swap(words: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """``old = words[positions]; words[positions] = values`` in one kernel (flat, contiguous ``words`` of an
    integer dtype on a CUDA device; int64 ``positions`` on it, in range and strictly increasing; ``values``
    of ``words``' dtype); returns ``old``, or None where the kernel is not used (the caller runs the torch ops)."""
    k = kernels(words.device)
    if (k is None or words.dim() != 1 or positions.dtype != torch.int64 or values.dtype != words.dtype
            or values.shape != positions.shape
            or positions.device != words.device or values.device != words.device
            or not (words.is_contiguous() and positions.is_contiguous() and values.is_contiguous())):
        return None
    n = positions.numel()
    old = torch.empty(n, dtype=words.dtype, device=words.device)
    if n == 0:
        return old
    try:
        with torch.cuda.device(words.device):
            k.swap[(_cdiv(n, _BLOCK),)](words, positions, values, old, n, BLOCK=_BLOCK)
    except Exception as exc:   # noqa: BLE001 - a compile or launch failure: nothing was written then
        _failed("the scatter", exc)
        return None
    return old


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
