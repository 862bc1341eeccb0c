"""A bucket's ``gap16`` payloads decoded and applied by two Triton kernels, no position list written out.

``decode_many`` turns a gap16 list into int64 positions (the lists joined, widened, summed twice), checks
them (joined again), and the scatter reads them back: about 90 bytes of device traffic per changed element,
and several torch ops per payload whose launches, not the bytes, set a many-tensor bucket's time. Here
(``CKPT_DELTA_TRITON=gaps``, the default, CUDA only) the payloads of a bucket that are whole-tensor gap16
deltas of live, contiguous tensors go another way, two launches for the lot:

1. ``gap_sums``: per block of 1,024 gaps of one list, their sum and how many are 0 past the list's first.
   A cumsum over the block sums gives each block's first position (``base``) and each list's last one:
   a list lies in range and rises strictly when its last position is below the tensor's size and no gap
   past its first is 0. These flags and the bodies' ``lin64`` checks (lin64's batched row kernel) are
   compared on the device into one verdict, ``go``; they are also read back with the rest of the bucket's
   checks (``encode.decode_many_with``), or, for a pipelined bucket (``apply.py``), with its post-apply
   digests once the next bucket was queued.
2. ``gap_swap``: per block, the running sum of its gaps plus ``base`` gives the positions in registers;
   the old words are gathered (for the undo), the new ones written, and the gaps copied aside. It reads
   ``go`` first: where a check failed it reads and writes nothing, so nothing is written out of range or
   twice to one word, whether or not the checks were read back before it was launched.

The undo runs ``gap_swap`` again from the copied gaps with the old words as its values. What the engine
then holds is checked as on every route (``apply._verify``: each tensor's digest).

A payload this route does not take (another encoding, a box or piece, a tensor the engine derives, a
header that does not parse, no kernels) goes through ``decode_many`` as before, in the same bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.delta._kernels import _BLOCK, _cdiv, _failed, _spread, _table, byte_span, disjoint, kernels, to_device
from ckpt_core.delta.encode import _INT_OF_SIZE, _align8, _bad, _parse_header, measure
from ckpt_core.delta.lin64 import PREFIX, _signed, is_lin64, lin64_queue
from ckpt_core.errors import CheckpointFormatError


class RouteFailed(RuntimeError):
    """The route's kernels failed before anything was written: the bucket goes through ``decode_many``."""


@dataclass
class Item:
    """One payload of the route: where its gaps and values lie in the bucket, and its target."""
    index: int            # in the bucket's payload list
    name: str             # the checkpoint tensor
    target: torch.Tensor  # the live tensor, contiguous, the payload's dtype and shape
    body: torch.Tensor    # the payload's body (its lin64 check)
    check: str
    digest: str           # lin64 of the new tensor's bytes
    gaps_at: int          # the gaps' device address (count uint16, first in the body)
    values_at: int        # the changed words' device address
    word: torch.dtype     # the integer dtype of the target's item size (``as_words``')
    count: int
    numel: int
    payload_bytes: int

    @property
    def gaps(self) -> torch.Tensor:
        """The gaps as uint8 (a view of the body; the slow path of a refused bucket only)."""
        return self.body[: 2 * self.count]


def parse(index: int, name: str, raw: torch.Tensor, head: bytes, target: torch.Tensor | None) -> Item | None:
    """The route's item for one payload, or None where it does not take it (``decode_many`` then checks it
    and names what is wrong). Every host check of ``_start_decode`` that can refuse a gap16 payload holds."""
    if target is None or target.device != raw.device or not target.is_contiguous():
        return None
    try:
        header, start = _parse_header(head, raw, name)
        enc, code, shape = header["enc"], header["dtype"], tuple(int(d) for d in header["shape"])
        count, digest = int(header["count"]), str(header["digest"])
        body_len, check = int(header["body"]), str(header["check"])
    except (CheckpointFormatError, KeyError, TypeError, ValueError):
        return None
    if (enc != "gap16" or code not in WIRE_DTYPES or not is_lin64(digest) or not is_lin64(check)
            or start + body_len != raw.numel()):
        return None
    dtype = WIRE_DTYPES[code]
    if target.dtype != dtype or tuple(target.shape) != shape:
        return None
    numel, size = target.numel(), target.element_size()
    if not 0 < count <= numel or size not in _INT_OF_SIZE or measure(numel, size, count, 0).gap16 != body_len:
        return None
    body = raw[start:]
    at = body.data_ptr()
    values_at = at + body_len - _align8(count * size)
    if at % 2 or values_at % size:
        return None
    return Item(index, name, target, body, check, digest, at, values_at, _INT_OF_SIZE[size], count, numel,
                raw.numel())


@dataclass
class _Group:
    """The route's items of one word size: one table, one launch of each kernel."""
    items: list[Item]
    word: torch.dtype
    table: torch.Tensor = field(default_factory=lambda: torch.empty(0))   # set by queue_checks, as the rest
    blk_t: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    blk_i: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    base: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    starts: list[int] = field(default_factory=list)


class GapRoute:
    """The gap16 payloads of one bucket (``take``): checks queued (``queue_checks``), refused or passed once
    read back (``raise_bad``), then swapped in (``swap``); ``undo`` puts the old words back."""

    def __init__(self, items: list[Item], device: torch.device, k):
        self.items, self.device, self.k = items, device, k
        groups: dict[torch.dtype, list[Item]] = {}
        for it in items:
            groups.setdefault(it.word, []).append(it)
        self.groups = [_Group(g, w) for w, g in groups.items()]
        self.bodies: list = []
        self.go = torch.empty(0)   # set by queue_checks: 1 (int64, on the device) when every check passed
        self.swapped: list[tuple[_Group, torch.Tensor, torch.Tensor]] = []   # (group, old words, kept gaps)

    def drop_one(self) -> str | None:
        """CKPT_TEST_DELTA_DROP_ONE (tests only): the first item loses its last changed element (before
        ``queue_checks``: the checks pass, the post-apply digest must not)."""
        it = next((it for it in self.items if it.count > 1), None)
        if it is None:
            return None
        it.count -= 1
        return it.name

    # -- checks --------------------------------------------------------------------
    def queue_checks(self) -> list:
        """The device values to read back with the bucket's other checks: each body's lin64 sum, then per group
        a flag for positions out of range and one for a 0 gap past a list's first. ``go`` is their verdict,
        computed on the device: ``swap`` writes nothing unless every check passed, read back or not."""
        out: list = []
        try:
            with torch.cuda.device(self.device):
                self.bodies = lin64_queue([it.body for it in self.items], engine="torch")   # one launch for the lot
                out = [q.total for q in self.bodies]
                for g in self.groups:
                    out.extend(self._queue_group(g))
                want = [_signed(int(it.check[len(PREFIX):], 16) - q.tail) for it, q in zip(self.items, self.bodies)]
                ok = (torch.stack(out[: len(self.items)]) == to_device(torch.tensor(want, dtype=torch.int64),
                                                                      self.device)).all()
                for flag in out[len(self.items):]:
                    ok = ok & (flag == 0)
                self.go = ok.to(torch.int64).reshape(1)
        except Exception as exc:   # a compile or launch failure (nothing written yet): the caller goes the
            _failed("the gap16 checks", exc)   # other way for this bucket, and kernels() says no from now on
            raise RouteFailed(str(exc)) from exc
        return out

    def _queue_group(self, g: _Group) -> list[torch.Tensor]:
        items = g.items
        blocks = [_cdiv(it.count, _BLOCK) for it in items]
        nblocks = sum(blocks)
        g.starts = [0]
        for it in items[:-1]:
            g.starts.append(g.starts[-1] + it.count)
        first, at = [], 0
        for b in blocks:
            first.append(at)
            at += b
        g.table = _table([[it.target.data_ptr() for it in items], [it.gaps_at for it in items],
                          [it.values_at for it in items], [it.count for it in items], g.starts, blocks,
                          first, [it.numel for it in items]], self.device)
        g.blk_t, blk_j = _spread(g.table[5], nblocks)
        g.blk_i = blk_j * _BLOCK
        sums = torch.empty(nblocks, dtype=torch.int64, device=self.device)
        zeros = torch.empty(nblocks, dtype=torch.int64, device=self.device)
        self.k.gap_sums[(nblocks,)](g.table, len(items), g.blk_t, g.blk_i, sums, zeros, BLOCK=_BLOCK)
        incl = torch.cumsum(sums, 0)
        before = incl - sums                       # the block's first position less its own first gap
        at_start = before[g.table[6]]              # each list's sum before its first block: taken off
        g.base = before - at_start[g.blk_t]
        last = incl[g.table[6] + g.table[5] - 1] - at_start   # each list's last position
        return [(last >= g.table[7]).any().to(torch.int64), zeros.sum()]

    def raise_bad(self, values: list[int]) -> None:
        """``CheckpointFormatError`` naming the first payload (in bucket order) whose check failed."""
        got = iter(values)
        bad: dict[int, str] = {}
        for it, q in zip(self.items, self.bodies):
            if q.digest(next(got)) != it.check:
                bad[it.index] = "the body's check (lin64) does not match: corrupted in transit or in memory"
        for g in self.groups:
            out_of_range, zero = next(got), next(got)
            if out_of_range or zero:
                for it in g.items:
                    if it.index not in bad and _list_bad(it):
                        bad[it.index] = "positions out of range or not strictly increasing"
        if bad:
            first = min(bad)
            name = next(it.name for it in self.items if it.index == first)
            raise _bad(name, bad[first])

    # -- writes ----------------------------------------------------------------------
    def swap(self) -> None:
        """Every item's new words written, its old ones and its gaps kept for the undo."""
        with torch.cuda.device(self.device):
            for g in self.groups:
                total = sum(it.count for it in g.items)
                old = torch.empty(total, dtype=g.word, device=self.device)
                kept = torch.empty(total, dtype=torch.uint16, device=self.device)
                try:
                    self.k.gap_swap[(g.blk_t.numel(),)](g.table, len(g.items), g.blk_t, g.blk_i, g.base, old, kept,
                                                        self.go, WORD=self.k.word[g.word], BLOCK=_BLOCK,
                                                        STORE_OLD=True, KEEP=True)
                except Exception as exc:   # a compile or launch failure: the update fails and is undone; the
                    _failed("the gap16 swap", exc)   # next ones take decode_many's route
                    raise
                self.swapped.append((g, old, kept))

    def undo(self) -> None:
        """The old words put back: ``gap_swap`` from the kept gaps with the old words as its values."""
        with torch.cuda.device(self.device):
            for g, old, kept in reversed(self.swapped):
                size = old.element_size()
                table = g.table.clone()
                table[1] = kept.data_ptr() + 2 * table[4]
                table[2] = old.data_ptr() + size * table[4]
                self.k.gap_swap[(g.blk_t.numel(),)](table, len(g.items), g.blk_t, g.blk_i, g.base, old, kept,
                                                    self.go, WORD=self.k.word[g.word], BLOCK=_BLOCK,
                                                    STORE_OLD=False, KEEP=False)
        self.swapped.clear()


def _list_bad(it: Item) -> bool:
    """One list's range and order, read back (a refused bucket's slow path: which payload)."""
    gaps = it.gaps.view(torch.uint16)[: it.count].to(torch.int64)
    return bool(((gaps[1:] == 0).any() if it.count > 1 else False) or gaps.sum() >= it.numel)


def take(named, raws: list[torch.Tensor], heads: list[bytes], live) -> tuple[GapRoute | None, list[int]]:
    """The route of a bucket's payloads (``named``: ``(tensor, box, shown, whole)`` per payload, as ``apply``
    names them) and the indices of the payloads it leaves to ``decode_many``. None where it takes none."""
    device = raws[0].device if raws else None
    k = None if device is None else kernels(device, "gaps")   # CUDA only
    if k is None:
        return None, list(range(len(raws)))
    items, rest = [], []
    for i, ((name, box, shown, whole), raw, head) in enumerate(zip(named, raws, heads)):
        item = None
        if box is None and whole is None and shown == name and raw.device == device:
            item = parse(i, name, raw, head, live(name))
        if item is None or item.word not in k.word:
            rest.append(i)
        else:
            items.append(item)
    # one launch writes its targets at once: a target overlapping one taken (tied names of one tensor) goes the
    # other way
    taken, overlapping = disjoint([byte_span(it.target) for it in items])
    if overlapping:
        rest = sorted(rest + [items[j].index for j in overlapping])
        items = [items[j] for j in taken]
    if not items:
        return None, rest
    return GapRoute(items, device, k), rest
