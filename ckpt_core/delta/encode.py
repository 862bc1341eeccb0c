"""One tensor's delta: which elements changed (exact bytes), encoded compactly, decoded with checks.

A payload is a uint8 tensor::

    b"CKD1" | u32 header length | header (JSON, padded to 8 bytes) | body

The header names the encoding, the tensor's dtype code and shape, the number of changed
elements, the ``lin64`` digest of the *new* tensor's full bytes (``lin64.py``: what the engine
checks after the apply, on the device that holds the tensor), the body's length and the body's
own ``lin64`` (``check``: a corrupted payload is refused before anything is written; computed where
the payload lies, so a worker reading it from device memory copies none of it to the host).
Bodies, each section 8-byte aligned:

- ``whole``: the new tensor's bytes (the tensor is new, reshaped, or its delta is not smaller);
- ``idx``: ``count`` positions (int32, or int64 from 2**31 elements) then the changed values;
- ``gap16``: the first position, then the gap to each next one, as uint16, then the values (only
  where every gap fits: 4 bytes per changed bf16 element instead of ``idx``'s 6);
- ``bitmap``: one bit per element (element ``8i+j`` is bit ``j`` of byte ``i``) then the values;
- ``runs``: ``r`` run starts then ``r`` run lengths (index width as ``idx``) then the values.

``encode_tensor`` measures the five sizes from the change mask and keeps the smallest. Elements are
compared as integers of their item size, so a NaN that keeps its bits is unchanged and -0.0 vs
+0.0 is a change: never a tolerance.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ckpt_core.checkpoint.safetensors import WIRE_CODES, WIRE_DTYPES
from ckpt_core.delta._bucket_checks import gap_positions, peek_heads, position_bad, positions_bad
from ckpt_core.delta._changes import Changes, changed_positions
from ckpt_core.delta._kernels import scatter_swap
from ckpt_core.delta.lin64 import HostDigest, is_lin64, lin64, lin64_host, queue_many, read_ints
from ckpt_core.errors import CheckpointFormatError, ConfigError

MAGIC = b"CKD1"
ENCODINGS = ("whole", "idx", "gap16", "bitmap", "runs")
MAX_GAP16 = 0xFFFF
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_HEADER = 1 << 16


def _align8(n: int) -> int:
    return (n + 7) & ~7


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's elements as integers of its item size, flat: shape ``[numel]`` for
    item sizes 1/2/4/8, ``[numel, k]`` int64 words for larger items (complex128)."""
    flat = t.reshape(-1)
    size = t.element_size()
    if size in _INT_OF_SIZE:
        return flat.view(_INT_OF_SIZE[size])
    return flat.view(torch.uint8).view(torch.int64).view(-1, size // 8)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a 0-d tensor included)."""
    return t.reshape(-1).view(torch.uint8)


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Bool ``[numel]``: where the bytes of ``new`` and ``old`` (same dtype and shape) differ."""
    a, b = as_words(new), as_words(old)
    ne = a != b
    return ne if ne.dim() == 1 else ne.any(dim=1)


@dataclass(frozen=True)
class Sizes:
    """Bytes of each encoding's body for one change mask (``whole`` included)."""
    whole: int
    idx: int
    gap16: int
    bitmap: int
    runs: int

    def best(self) -> str:
        # ties go to the simpler encoding (the order of ENCODINGS)
        return min(ENCODINGS, key=lambda e: (getattr(self, e), ENCODINGS.index(e)))


def index_width(numel: int) -> int:
    return 4 if numel < 2 ** 31 else 8


def measure(numel: int, itemsize: int, count: int, runs: int, max_gap: int = 0) -> Sizes:
    """Body bytes of each encoding; ``gap16`` only where every gap between changed positions (and
    the first position) fits in 16 bits (``max_gap``), else it cannot be chosen."""
    w = index_width(numel)
    values = _align8(count * itemsize)
    gap16 = _align8(count * 2) + values if max_gap <= MAX_GAP16 else 1 << 62
    return Sizes(whole=_align8(numel * itemsize), idx=_align8(count * w) + values, gap16=gap16,
                 bitmap=_align8((numel + 7) // 8) + values, runs=2 * _align8(runs * w) + values)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    if bits.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(bits.numpy(), count=numel, bitorder="little").view(np.bool_))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel].bool()


def frame_head(text: bytes) -> bytes:
    """A payload's head around its header's JSON ``text``: the magic, the text's length, the text, padded
    with spaces to 8 bytes (the body's sections stay 8-byte aligned)."""
    head = MAGIC + struct.pack("<I", len(text)) + text
    return head + b" " * (_align8(len(head)) - len(head))


def _payload(header: dict, body) -> torch.Tensor:
    """The payload of ``header`` and ``body`` (bytes, or a flat uint8 numpy array: not copied but
    once, into the payload), with the body's length and ``lin64`` check added to the header."""
    if isinstance(body, (bytes, bytearray)):
        body = np.frombuffer(bytearray(body), dtype=np.uint8)   # writable: torch refuses read-only arrays
    header = dict(header, body=int(body.size), check=lin64_host(body))
    head = frame_head(json.dumps(header, separators=(",", ":")).encode())
    out = np.empty(len(head) + body.size, dtype=np.uint8)
    out[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[len(head):] = body
    return torch.from_numpy(out)


class _Body:
    """A payload body being filled: 8-byte aligned sections written in place (no intermediate bytes)."""

    def __init__(self, nbytes: int):
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.at = 0

    def section(self, nbytes: int, dtype) -> np.ndarray:
        """The next section's ``nbytes`` bytes as ``dtype`` items, to fill."""
        view = self.buf[self.at: self.at + nbytes].view(dtype)
        self.at += _align8(nbytes)
        return view


def _body(enc: str, words: np.ndarray, ch: Changes, numel: int) -> np.ndarray:
    """The body of a delta encoding (not ``whole``): its index section(s), then the changed values."""
    count, item = ch.positions.size, words.itemsize * (words.shape[1] if words.ndim > 1 else 1)
    if enc == "gap16" and ch.max_gap > MAX_GAP16:
        raise ValueError("gap16 needs every gap below 2**16")
    body = _Body(getattr(measure(numel, item, count, ch.runs, ch.max_gap), enc))
    idx = np.int32 if index_width(numel) == 4 else np.int64
    w = np.dtype(idx).itemsize
    if enc == "idx":
        body.section(count * w, idx)[:] = ch.positions
    elif enc == "gap16":
        body.section(count * 2, np.uint16)[:] = ch.gaps
    elif enc == "bitmap":
        mask = np.zeros(numel, dtype=np.bool_)
        mask[ch.positions] = True
        body.section((numel + 7) // 8, np.uint8)[:] = np.packbits(mask, bitorder="little")
    else:   # runs
        starts, lengths = ch.run_bounds()
        body.section(ch.runs * w, idx)[:] = starts
        body.section(ch.runs * w, idx)[:] = lengths
    values = body.section(count * item, words.dtype)
    np.take(words, ch.positions, axis=0, out=values.reshape((count,) + words.shape[1:]))
    return body.buf


def encode_tensor(new: torch.Tensor, old: torch.Tensor | None, *, digest: str | None = None,
                  force: str | None = None) -> tuple[torch.Tensor | None, dict]:
    """The payload that turns ``old`` into ``new`` (CPU tensors), or None when nothing changed.

    ``old`` None, or of another dtype or shape: the payload is ``whole``. Returns
    ``(payload or None, info)`` with ``info = {"encoding", "count", "numel", "bytes"}`` (bytes of
    the payload, 0 when unchanged). ``digest``: ``new``'s ``lin64`` if the caller has it (else
    computed here, only for a changed tensor). ``force``: one encoding, for tests and the benchmark.
    The changes are found in numpy over cache-sized blocks (``_changes.py``), and each section is
    written once, into the body.
    """
    new = new.detach().contiguous()
    if WIRE_CODES.get(new.dtype) is None:
        raise CheckpointFormatError(f"dtype {new.dtype} has no wire code")
    numel, size = new.numel(), new.element_size()
    words = as_words(new).numpy()
    ch = None   # None: whole (new, reshaped or retyped)
    if old is not None and old.dtype == new.dtype and tuple(old.shape) == tuple(new.shape):
        host = HostDigest(new) if digest is None else None

        def digest_block(end: int, changed: bool) -> None:   # once it changed: each block as it is compared
            if host is not None and changed:
                host.upto(end * size)
        ch = Changes.of(changed_positions(words, as_words(old.detach().contiguous()).numpy(), digest_block))
        if ch.positions.size == 0:
            return None, {"encoding": None, "count": 0, "numel": numel, "bytes": 0}
        digest = digest if host is None else host.digest()
    return _encoded(new, words, ch, digest, force)


def encode_changes(new: torch.Tensor, positions, *, digest: str | None = None,
                   force: str | None = None) -> tuple[torch.Tensor | None, dict]:
    """The payload that writes ``new``'s values at ``positions`` (int64, strictly increasing, in range;
    None: every element, as ``whole``) into a tensor of ``new``'s dtype and shape, in the smallest
    encoding as ``encode_tensor`` picks it: what ``delta/fold.py`` builds a fold with, from positions it
    knows changed (a superset of the changes is lossless: the other elements are written with the
    values they hold). None when ``positions`` is empty. ``digest``: ``new``'s ``lin64`` if known."""
    new = new.detach().contiguous()
    if WIRE_CODES.get(new.dtype) is None:
        raise CheckpointFormatError(f"dtype {new.dtype} has no wire code")
    numel = new.numel()
    ch = None
    if positions is not None:
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.size == 0:
            return None, {"encoding": None, "count": 0, "numel": numel, "bytes": 0}
        if pos[0] < 0 or pos[-1] >= numel or (pos.size > 1 and bool((np.diff(pos) <= 0).any())):
            raise ValueError("positions must be strictly increasing and in range")
        ch = Changes.of(pos)
    return _encoded(new, as_words(new).numpy(), ch, digest, force)


def _encoded(new: torch.Tensor, words: np.ndarray, ch: Changes | None, digest: str | None,
             force: str | None) -> tuple[torch.Tensor, dict]:
    """The payload of ``new`` with changes ``ch`` (None: whole), in ``force`` or the smallest encoding."""
    numel, size = new.numel(), new.element_size()
    header = {"dtype": WIRE_CODES[new.dtype], "shape": list(new.shape)}
    count = numel if ch is None else ch.positions.size
    sizes = measure(numel, size, count, 1 if ch is None else ch.runs, 0 if ch is None else ch.max_gap)
    enc = "whole" if ch is None else (force or sizes.best())
    if enc not in ENCODINGS:
        raise ValueError(f"unknown encoding {enc!r}")
    digest = digest if digest is not None else lin64(new)
    if not is_lin64(digest):
        raise ConfigError(f"a delta carries a lin64 digest of the new tensor, got {digest!r}")
    if enc == "whole" or ch is None:
        body = np.zeros(_align8(numel * size), dtype=np.uint8)
        body[: numel * size] = bytes_of(new).numpy()
    else:
        body = _body(enc, words, ch, numel)
    payload = _payload(dict(header, enc=enc, count=numel if enc == "whole" else count,
                            runs=ch.runs if enc == "runs" and ch is not None else 0, digest=digest), body)
    return payload, {"encoding": enc, "count": count, "numel": numel, "bytes": payload.numel()}


@dataclass
class Decoded:
    """A checked payload: what to write where. ``positions`` None means ``whole``."""
    encoding: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    count: int
    digest: str
    positions: torch.Tensor | None   # int64 [count], strictly increasing, in range
    values: torch.Tensor             # the changed elements (whole: every element), as as_words() of dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _bad(name: str, why: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"delta payload refused: {why}", tensor=name)


def read_header(payload: torch.Tensor, name: str = "?") -> tuple[dict, int]:
    """The header of a payload and where its body starts; ``CheckpointFormatError`` if malformed."""
    raw = payload.reshape(-1)
    return _parse_header(bytes(raw[:_align8(8 + _MAX_HEADER)].cpu().numpy()), raw, name)


def _parse_header(head: bytes, raw: torch.Tensor, name: str) -> tuple[dict, int]:
    """``read_header`` from the payload's first bytes ``head`` (read back already; the rest of the
    header is read from ``raw`` only when ``head`` is too short for it)."""
    if raw.dtype != torch.uint8 or raw.numel() < 8:
        raise _bad(name, "not a uint8 payload of at least 8 bytes")
    if head[:4] != MAGIC:
        raise _bad(name, f"bad magic {head[:4]!r}")
    (n,) = struct.unpack("<I", head[4:8])
    if n > _MAX_HEADER or 8 + n > raw.numel():
        raise _bad(name, f"header length {n} out of range")
    text = head[8: 8 + n] if 8 + n <= len(head) else bytes(raw[8: 8 + n].cpu().numpy())
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(name, f"header is not JSON ({exc})") from exc
    return header, _align8(8 + n)


def decode(payload: torch.Tensor, name: str = "?") -> Decoded:
    """Check a payload whole (header fields, sizes, the body's lin64 check, positions strictly
    increasing and in range) before anything is written; ``CheckpointFormatError`` naming the
    tensor otherwise. ``decode_many`` does the same for many payloads with one read-back."""
    return decode_many([(name, payload)])[0]


_PEEK = 512   # bytes of each payload read back for its header (~150 bytes); a longer one is read on its own


class _Pending:
    """One payload's decode while its device checks run: the first failure found on the host before
    the body check (``early``) and after it (``late``), the queued body check, and the device checks
    of its positions (``(0-d tensor, wanted value, why)``)."""

    def __init__(self, name: str):
        self.name = name
        self.early: CheckpointFormatError | None = None
        self.late: CheckpointFormatError | None = None
        self.check: tuple[torch.Tensor, str] | None = None   # (its body, the check its header names)
        self.device: list[tuple[torch.Tensor, int, Callable[[int], str]]] = []
        self.positions: tuple[torch.Tensor, int] | None = None   # (its positions, numel): checked per bucket
        self.positions_bad = False
        self.decoded: Decoded | None = None
        self.gaps: tuple[torch.Tensor, int] | None = None   # a gap16 list's bytes and numel: decoded per bucket


def decode_many(payloads) -> list[Decoded]:
    """``decode`` of each ``(name, payload)``, with every host synchronisation batched: the headers
    are read back together, and the body checks and position checks run as device ops whose results
    are read back together (one synchronisation per device for the lot, not several per payload).
    Nothing is written; the first refused payload (in order, for its first failing check, as
    ``decode`` would refuse it) raises ``CheckpointFormatError`` naming its tensor."""
    return decode_many_with(payloads)[0]


def peek_payloads(raws: list[torch.Tensor], aside: bool = False) -> list[bytes]:
    """The first bytes of each flat payload (its header, mostly), read back together (``decode_many_with``);
    ``aside``: without waiting for the work queued on the current stream (``_bucket_checks.peek_heads``)."""
    return peek_heads(raws, _PEEK, aside)


def decode_many_with(payloads, heads: list[bytes] | None = None, extra=()) -> tuple[list[Decoded], list[int]]:
    """``decode_many``, with the payloads' first bytes already read back (``heads``: ``peek_payloads``), and
    ``extra`` values (0-d device tensors or ints: another route's checks, ``_gap_route.py``) read back with
    this bucket's own checks; returns the decoded payloads and the extra values."""
    items = [(name, p.reshape(-1)) for name, p in payloads]
    if heads is None:
        heads = peek_heads([raw for _, raw in items], _PEEK)
    pending = []
    for (name, raw), head in zip(items, heads):
        pend = _Pending(name)
        pending.append(pend)
        try:
            _start_decode(pend, raw, head)
        except CheckpointFormatError as exc:
            if pend.check is None:
                pend.early = exc
            else:
                pend.late = exc
    _fill_gaps(pending)
    bodies = [(p, p.check[0]) for p in pending if p.check is not None]
    sums = {id(p): q for (p, _), q in zip(bodies, queue_many([body for _, body in bodies]))}   # on their device
    queued = [sums[id(p)].total for p, _ in bodies]
    flags = [t for p in pending for t, _, _ in p.device]
    spans: dict[torch.device, list[tuple[_Pending, torch.Tensor, int]]] = {}   # a device's lists checked at once
    for p in pending:
        if p.positions is not None:
            spans.setdefault(p.positions[0].device, []).append((p, *p.positions))
    extra = list(extra)
    read = read_ints(queued + flags + [positions_bad([(pos, n) for _, pos, n in s]) for s in spans.values()] + extra)
    extras = read[len(read) - len(extra):]
    values = iter(read)
    checks = {id(p): next(values) for p in pending if p.check is not None}
    device_flags = [next(values) for _ in flags]
    for group in spans.values():
        if next(values):   # some list of this device is bad: which one (a refused bucket only)
            for q, pos, n in group:
                q.positions_bad = position_bad(pos, n)
    values = iter(device_flags)
    for p in pending:
        if p.early is not None:
            raise p.early
        assert p.check is not None  # noqa: S101 - set for every payload without an early failure
        if sums[id(p)].digest(checks[id(p)]) != p.check[1]:
            raise _bad(p.name, "the body's check (lin64) does not match: corrupted in transit or in memory")
        if p.late is not None:
            raise p.late
        for (_, want, why), got in zip(p.device, (next(values) for _ in p.device)):
            if got != want:
                raise _bad(p.name, why(got))
        if p.positions_bad:
            raise _bad(p.name, "positions out of range or not strictly increasing")
        assert p.decoded is not None  # noqa: S101 - every check passed
    return [p.decoded for p in pending], extras   # type: ignore[misc]


def _start_decode(p: _Pending, raw: torch.Tensor, head: bytes) -> None:
    """The host checks of one payload, its body check queued, its positions decoded on its device
    with their checks queued (``decode_many``)."""
    name = p.name
    header, start = _parse_header(head, raw, name)
    try:
        enc, code, shape = header["enc"], header["dtype"], tuple(int(d) for d in header["shape"])
        count, runs, digest = int(header["count"]), int(header["runs"]), str(header["digest"])
        body_len, check = int(header["body"]), str(header["check"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(name, f"header field missing or malformed ({exc!r})") from exc
    if enc not in ENCODINGS or code not in WIRE_DTYPES or any(d < 0 for d in shape):
        raise _bad(name, f"unknown encoding {enc!r}, dtype {code!r} or shape {list(shape)}")
    if not is_lin64(digest):
        raise _bad(name, f"its digest {digest[:40]!r} is not a lin64 digest ('lin64:' and 16 hex digits): a "
                         "payload of an older ckpt-engine (SHA-256 digests)? register the version again with this one")
    if start + body_len != raw.numel():
        raise _bad(name, f"body of {raw.numel() - start} bytes, header says {body_len}")
    body = raw[start:]
    p.check = (body, check)   # its lin64 on the payload's device, with the bucket's other bodies (decode_many)
    dtype = WIRE_DTYPES[code]
    size = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= count <= numel or (enc == "whole" and count != numel):
        raise _bad(name, f"count {count} out of range for {numel} elements")
    sizes = measure(numel, size, count, runs)
    if getattr(sizes, enc) != body_len:
        raise _bad(name, f"{enc} body of {body_len} bytes, {getattr(sizes, enc)} expected")
    values_at = body_len - _align8(count * size)
    values = _words(body[values_at: values_at + count * size], dtype, count)
    positions = None if enc == "whole" else _positions(p, enc, body[:values_at], numel, count, runs)
    p.decoded = Decoded(enc, dtype, shape, count, digest, positions, values)   # gap16: positions set by _fill_gaps


def _typed(raw: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    """``count`` items of ``dtype`` from the bytes ``raw``: a view where they are aligned in their storage
    (no kernel), else an aligned copy. A view is read before the bucket's buffer is reused: the apply
    writes the values (or a cast of them) at once, and the undo keeps the old values, not these."""
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.storage_offset() % size == 0:
        try:
            return raw.view(dtype)
        except RuntimeError:   # a storage that does not allow it: copied below
            pass
    out = torch.empty((count,), dtype=dtype, device=raw.device)
    bytes_of(out).copy_(raw)
    return out


def _words(raw: torch.Tensor, dtype: torch.dtype, count: int) -> torch.Tensor:
    return as_words(_typed(raw, dtype, count))


def _ints(raw: torch.Tensor, n: int, width: int) -> torch.Tensor:
    # a copy always: positions outlive the bucket's buffer (the undo log keeps them)
    return _typed(raw[: n * width], torch.int32 if width == 4 else torch.int64, n).to(torch.int64, copy=True)


def _flag(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).reshape(())


def _positions(p: _Pending, enc: str, raw: torch.Tensor, numel: int, count: int, runs: int) -> torch.Tensor | None:
    """The changed positions, decoded without reading anything back: what must hold of them (the
    bitmap's count, the runs' lengths, in range and strictly increasing) is queued on ``p.device``."""
    w = index_width(numel)
    if enc == "idx":
        pos = _ints(raw, count, w)
    elif enc == "gap16":   # the running sum of the gaps: with the bucket's other gap16 lists (decode_many)
        gaps = raw[: count * 2]
        if gaps.numel() != count * 2:
            raise _bad(p.name, f"{gaps.numel() // 2} positions, header says {count}")
        p.gaps = (gaps, numel)
        return None
    elif enc == "bitmap":
        mask = _unpack_bits(raw[: (numel + 7) // 8], numel)
        pos = _nonzero(mask, count)
        if pos.numel() != count:   # the host's nonzero
            raise _bad(p.name, f"bitmap marks {pos.numel()} elements, header says {count}")
        if mask.device.type != "cpu":   # nonzero_static gave count of them, whatever it marks
            p.device.append((_flag(mask.sum()), count, lambda n: f"bitmap marks {n} elements, header says {count}"))
    else:
        starts, lengths = _ints(raw, runs, w), _ints(raw[_align8(runs * w):], runs, w)
        if runs:
            bad = (lengths <= 0).any() | (lengths.sum() != count)
            p.device.append((_flag(bad), 0, lambda _: "run lengths do not add up to the count"))
        pos = _expand_runs(starts, lengths, count)
    if pos.numel() != count:
        raise _bad(p.name, f"{pos.numel()} positions, header says {count}")
    _checked_later(p, pos, numel)
    return pos


def _checked_later(p: _Pending, pos: torch.Tensor, numel: int) -> None:
    if pos.numel():   # in range and strictly increasing: checked with the bucket's other lists (decode_many)
        p.positions = (pos, numel)


def _fill_gaps(pending: list[_Pending]) -> None:
    """The positions of the bucket's gap16 payloads, per device in one pass (``gap_positions``)."""
    by_device: dict[torch.device, list[_Pending]] = {}
    for p in pending:
        if p.gaps is not None and p.decoded is not None:
            by_device.setdefault(p.gaps[0].device, []).append(p)
    for group in by_device.values():
        for p, pos in zip(group, gap_positions([p.gaps[0] for p in group])):   # type: ignore[index]
            p.decoded.positions = pos   # type: ignore[union-attr]
            _checked_later(p, pos, p.gaps[1])   # type: ignore[index]


def _nonzero(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The set positions of ``mask``; on a device exactly ``count`` of them (padded with -1, caught by
    the checks), as ``nonzero`` would have to read its size back."""
    if mask.device.type != "cpu":
        try:
            return torch.nonzero_static(mask, size=count, fill_value=-1).reshape(-1)
        except (NotImplementedError, RuntimeError):   # a device without it: nonzero reads its size back
            pass
    return torch.nonzero(mask).reshape(-1)


def _expand_runs(starts: torch.Tensor, lengths: torch.Tensor, count: int) -> torch.Tensor:
    """Every position of the runs ``(starts, lengths)``, ``count`` of them, without reading a size
    back; whatever the lengths (unchecked yet), every index stays in range."""
    if starts.numel() == 0:
        return starts.new_zeros(0)   # a count above 0 is refused: no positions
    ends = torch.cumsum(lengths, 0)
    at = torch.arange(count, device=starts.device)
    run = torch.searchsorted(ends, at, right=True).clamp_(max=starts.numel() - 1)
    return starts[run] + at - (ends - lengths)[run]


def apply_decoded(target: torch.Tensor, d: Decoded) -> torch.Tensor | None:
    """Write a decoded delta into ``target`` (contiguous, its dtype and shape) in place; returns
    the previous values at the written positions (for an undo), or None for ``whole`` (the caller
    keeps a copy if it needs to undo)."""
    words = as_words(target)
    if d.positions is None:
        words.copy_(d.values.to(words.device).view_as(words))
        return None
    pos = d.positions.to(words.device)
    values = d.values.to(words.device)
    old = scatter_swap(words, pos, values)   # one fused kernel where it runs (_kernels.py)
    if old is None:
        old = words[pos]   # indexing copies
        words[pos] = values
    return old


def undo_decoded(target: torch.Tensor, d: Decoded, old: torch.Tensor) -> None:
    """Put back what ``apply_decoded`` returned (``old``) at the delta's positions."""
    assert d.positions is not None  # noqa: S101 - type narrowing: a whole tensor's undo restores a saved copy
    as_words(target)[d.positions.to(target.device)] = old
