"""Fused device kernels for a delta's apply and check, written in Triton, with the torch ops as the fallback.

A delta's apply gathers the old values at the changed positions (for an undo) and scatters the new
ones: two torch ops, each reading the positions; the swap kernel does both in one, reading each position
once. The post-apply check digests every changed tensor an engine worker holds (``lin64.py``): with torch ops
each 64 MiB chunk of words is multiplied into a temporary of its size and then summed, three passes over
the bytes. The kernel here reads each word once and keeps the products in registers: one pass, the
tensor's bytes read at the device's memory rate. The arithmetic is the same integer arithmetic mod 2**64
(wrapping int64 products and sums, in any order), so its row sums equal the torch path's bit for bit;
``tests/gpu/test_delta_lin64_gpu.py`` compares the digests with the host's.

Used only on CUDA devices where Triton imports and ``CKPT_DELTA_TRITON`` allows them (``check``: the row sums
only; ``gaps``, the default: and the gap16 route's passes; ``1``/``all``: every swap too; ``0``: none);
elsewhere (the CPU, other devices, a missing Triton, a tensor whose bytes are not 8-byte aligned) the torch
ops run. A kernel that fails to build is reported once in the log and the torch ops take over for the process.
"""

from __future__ import annotations

import bisect
import itertools
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

    @triton.jit
    def rows_many_kernel(ptrs_ptr, nwords_ptr, row_t_ptr, row_j_ptr, a_ptr, out_ptr,
                         ROW: tl.constexpr, BLOCK: tl.constexpr):
        # rows_kernel over many tensors in one launch: program r sums row row_j[r] of tensor row_t[r],
        # whose words start at ptrs[row_t[r]] (a device address) and number nwords[row_t[r]]
        r = tl.program_id(0)
        t = tl.load(row_t_ptr + r)
        start = tl.load(row_j_ptr + r) * ROW
        words = tl.load(ptrs_ptr + t).to(tl.pointer_type(tl.int64))
        n = tl.load(nwords_ptr + t)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, ROW, BLOCK):
            cols = k + tl.arange(0, BLOCK)
            idx = start + cols
            w = tl.load(words + idx, mask=idx < n, other=0)
            acc += w * tl.load(a_ptr + cols)
        tl.store(out_ptr + r, tl.sum(acc, axis=0))

    @triton.jit
    def swap_many_kernel(table_ptr, n_tensors, blk_t_ptr, blk_i_ptr, old_ptr, WORD: tl.constexpr,
                         BLOCK: tl.constexpr):
        # swap_kernel over many tensors in one launch: block b covers BLOCK elements, from blk_i[b], of
        # the lists of tensor t = blk_t[b]; table column t (rows of n_tensors): target, positions and
        # values addresses, the count, where its old values start in old_ptr
        b = tl.program_id(0)
        t = tl.load(blk_t_ptr + b)
        col = table_ptr + t
        target = tl.load(col).to(tl.pointer_type(WORD))
        pos_ptr = tl.load(col + n_tensors).to(tl.pointer_type(tl.int64))
        values_ptr = tl.load(col + 2 * n_tensors).to(tl.pointer_type(WORD))
        n = tl.load(col + 3 * n_tensors)
        old_at = tl.load(col + 4 * n_tensors)
        i = tl.load(blk_i_ptr + b) + tl.arange(0, BLOCK)
        m = i < n
        p = tl.load(pos_ptr + i, mask=m, other=0)
        tl.store(old_ptr + old_at + i, tl.load(target + p, mask=m), mask=m)
        tl.store(target + p, tl.load(values_ptr + i, mask=m), mask=m)

    @triton.jit
    def gap_sums_kernel(table_ptr, n_tensors, blk_t_ptr, blk_i_ptr, sums_ptr, zeros_ptr, BLOCK: tl.constexpr):
        # block b: BLOCK gaps, from blk_i[b], of the gap16 list of tensor t = blk_t[b] (table column t: its
        # gaps' address, row 1; its count, row 3): their sum, and how many are 0 past the list's first
        b = tl.program_id(0)
        t = tl.load(blk_t_ptr + b)
        gaps = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(tl.uint16))
        n = tl.load(table_ptr + 3 * n_tensors + t)
        i = tl.load(blk_i_ptr + b) + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(gaps + i, mask=m, other=1).to(tl.int64)
        tl.store(sums_ptr + b, tl.sum(tl.where(m, g, 0), axis=0))
        tl.store(zeros_ptr + b, tl.sum(((g == 0) & (i > 0)).to(tl.int64), axis=0))

    @triton.jit
    def gap_swap_kernel(table_ptr, n_tensors, blk_t_ptr, blk_i_ptr, base_ptr, old_ptr, keep_ptr, go_ptr,
                        WORD: tl.constexpr, BLOCK: tl.constexpr, STORE_OLD: tl.constexpr, KEEP: tl.constexpr):
        # block b of tensor t: its positions are base[b] plus the running sum of its gaps (never written
        # out), where the old words are gathered (into old, STORE_OLD) and the new ones written from the
        # values (table rows: 0 target, 1 gaps, 2 values addresses, 3 count, 4 where t's items start in
        # old and keep); KEEP: the gaps copied into keep (the undo runs this kernel again from them, the
        # old words as its values). Checked before (gap_sums_kernel): in range, no 0 gap past the first;
        # go[0] (int64, on the device) says so: where it is 0 nothing is read or written at all, so a
        # bucket whose checks were not read back yet cannot write out of range or twice to one word.
        b = tl.program_id(0)
        t = tl.load(blk_t_ptr + b)
        col = table_ptr + t
        target = tl.load(col).to(tl.pointer_type(WORD))
        gaps = tl.load(col + n_tensors).to(tl.pointer_type(tl.uint16))
        values = tl.load(col + 2 * n_tensors).to(tl.pointer_type(WORD))
        n = tl.load(col + 3 * n_tensors)
        at = tl.load(col + 4 * n_tensors)
        i = tl.load(blk_i_ptr + b) + tl.arange(0, BLOCK)
        m = i < n * (tl.load(go_ptr) != 0).to(tl.int64)   # no element where the checks failed
        g = tl.load(gaps + i, mask=m, other=0)
        pos = tl.cumsum(g.to(tl.int64), axis=0) + tl.load(base_ptr + b)
        v = tl.load(values + i, mask=m)
        if STORE_OLD:
            tl.store(old_ptr + at + i, tl.load(target + pos, mask=m), mask=m)
        tl.store(target + pos, v, mask=m)
        if KEEP:
            tl.store(keep_ptr + at + i, g, mask=m)

    class Kernels:
        rows = rows_kernel
        swap = swap_kernel
        rows_many = rows_many_kernel
        swap_many = swap_many_kernel
        gap_sums = gap_sums_kernel
        gap_swap = gap_swap_kernel
        word = {torch.uint8: tl.uint8, torch.int8: tl.int8, torch.int16: tl.int16, torch.int32: tl.int32,
                torch.int64: tl.int64}

    return Kernels


# the uses each CKPT_DELTA_TRITON mode turns on
_USES = {"off": (), "check": ("check",), "gaps": ("check", "gaps"), "all": ("check", "gaps", "scatter")}


def kernels(device: torch.device, use: str = "check") -> Any:
    """The Triton kernels for ``device`` and ``use`` (``check``: the lin64 row sums; ``gaps``: a bucket's gap16
    payloads decoded and swapped in two passes, ``_gap_route.py``; ``scatter``: the swaps of decoded positions),
    or None (not CUDA, turned off for that use by ``CKPT_DELTA_TRITON``, no Triton, or a kernel failed)."""
    if device.type != "cuda" or _STATE["failed"] or use not in _USES[delta_triton()]:
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
    k = kernels(words.device, "scatter")
    if k is None or not _swappable(words, positions, values):
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


def _swappable(words: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> bool:
    """What the swap kernels take: flat contiguous ``words``, int64 ``positions`` and ``values`` of ``words``'
    dtype, as many of each, all contiguous on ``words``' device."""
    return (words.dim() == 1 and positions.dtype == torch.int64 and values.dtype == words.dtype
            and values.shape == positions.shape
            and positions.device == words.device and values.device == words.device
            and words.is_contiguous() and positions.is_contiguous() and values.is_contiguous())


def _table(columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """Host integers as an int64 device tensor ``[len(columns), len(columns[0])]``: each column of the
    table a contiguous row (``to_device``: the host never waits for the device's queued work)."""
    return to_device(torch.tensor(columns, dtype=torch.int64), device)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor copied to ``device`` without the host waiting for the work queued there: on a
    CUDA device from page-locked memory (a copy from pageable memory may wait for the stream; the pinned
    block is kept until the copy ran by torch's host allocator), elsewhere a plain copy."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _spread(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive segments of ``counts`` (int64, on the device) that add up to ``total`` (known on
    the host, so nothing waits): each slot's segment and its index inside it, two int64 tensors."""
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    return owner, torch.arange(total, device=counts.device) - first[owner]


def lin64_rows_many(words: list[torch.Tensor], a: torch.Tensor, row_len: int) -> list[torch.Tensor] | None:
    """``lin64_rows`` of each flat int64 tensor of ``words`` (one CUDA device, 8-byte aligned, whole words),
    in one launch for all of them: the row sums of each, as views of one int64 tensor (row ``j`` of a tensor:
    ``sum_k words[j * row_len + k] * a[k]``, its last row zero-padded); None where the kernel is not used."""
    if not words:
        return []
    device = words[0].device
    if any(w.device != device or w.dtype != torch.int64 or w.dim() != 1 or not w.is_contiguous() for w in words):
        return None
    rows = [_cdiv(w.numel(), row_len) for w in words]
    out = lin64_rows_at(device, [w.data_ptr() for w in words], [w.numel() for w in words], rows, a, row_len)
    return None if out is None else list(out.split(rows))


def lin64_rows_at(device: torch.device, ptrs: list[int], nwords: list[int], rows: list[int], a: torch.Tensor,
                  row_len: int) -> torch.Tensor | None:
    """``lin64_rows_many`` by address: the int64 words of tensor ``i`` start at device address ``ptrs[i]`` (8-byte
    aligned) and number ``nwords[i]``, ``rows[i]`` rows of ``row_len`` each; every tensor's row sums, in order, in
    one int64 tensor (no view made per tensor); None where the kernel is not used. The caller keeps the
    tensors alive until the launch ran."""
    k = kernels(device)
    if k is None or row_len % _BLOCK:
        return None
    total = sum(rows)
    out = torch.empty(total, dtype=torch.int64, device=device)
    if total:
        try:
            with torch.cuda.device(device):
                table = _table([ptrs, nwords, rows], device)
                row_t, row_j = _spread(table[2], total)
                k.rows_many[(total,)](table[0], table[1], row_t, row_j, a, out, ROW=row_len, BLOCK=_BLOCK)
        except Exception as exc:   # noqa: BLE001 - a compile or launch failure: the torch path is exact too
            _failed("lin64 (many tensors)", exc)
            return None
    return out


def disjoint(spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The indices of the byte ranges ``[lo, hi)`` one launch may write together (each disjoint from every one
    before it that was taken), and the rest, both in order: a kernel that writes its targets at once must not
    be given two that overlap (tied names of one tensor, views of one storage), or the old values it gathers
    for the undo may already be new ones. One search per range, not a scan of those taken (a bucket of a MoE
    model has thousands)."""
    starts: list[int] = []   # the taken ranges, sorted and disjoint
    ends: list[int] = []
    taken: list[int] = []
    rest: list[int] = []
    for i, (lo, hi) in enumerate(spans):
        at = bisect.bisect_right(starts, lo)   # the taken ranges before ``at`` start at or before lo
        if (at and ends[at - 1] > lo) or (at < len(starts) and starts[at] < hi):
            rest.append(i)
            continue
        taken.append(i)
        starts.insert(at, lo)
        ends.insert(at, hi)
    return taken, rest


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a contiguous tensor covers."""
    return t.data_ptr(), t.data_ptr() + t.nbytes


def scatter_swap_many(words: list[torch.Tensor], positions: list[torch.Tensor],
                      values: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """``scatter_swap`` of each ``(words, positions, values)`` in one launch for all (one CUDA device, one
    integer dtype of the words; the targets must not overlap); returns each one's old values (views of one
    tensor), or None where the kernel is not used (the caller runs ``scatter_swap`` or the torch ops)."""
    if not words:
        return []
    device, dtype = words[0].device, words[0].dtype
    k = kernels(device, "scatter")
    if k is None or dtype not in k.word:
        return None
    if not all(w.device == device and w.dtype == dtype and _swappable(w, p, v)
               for w, p, v in zip(words, positions, values, strict=True)):
        return None
    counts = [p.numel() for p in positions]
    total = sum(counts)
    old = torch.empty(total, dtype=dtype, device=device)
    blocks = [_cdiv(n, _BLOCK) for n in counts]
    nblocks = sum(blocks)
    if nblocks:
        starts = [0, *itertools.accumulate(counts[:-1])]
        try:
            with torch.cuda.device(device):
                table = _table([[w.data_ptr() for w in words], [p.data_ptr() for p in positions],
                                [v.data_ptr() for v in values], counts, starts, blocks], device)
                blk_t, blk_j = _spread(table[5], nblocks)
                k.swap_many[(nblocks,)](table, len(words), blk_t, blk_j * _BLOCK, old,
                                        WORD=k.word[dtype], BLOCK=_BLOCK)
        except Exception as exc:   # noqa: BLE001 - a compile or launch failure: nothing was written then
            _failed("the scatter (many tensors)", exc)
            return None
    return list(old.split(counts))


def _cdiv(n: int, d: int) -> int:
    return -(-n // d)
