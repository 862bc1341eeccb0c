"""Our own safetensors reader and writer.

A safetensors file is ``u64 little-endian header length N``, then ``N`` bytes of UTF-8
JSON mapping tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data area that starts at ``8 + N``), plus an optional ``"__metadata__"``
string map, then the raw tensor bytes.

We parse it ourselves rather than through the ``safetensors`` package so that every defect
surfaces as one :class:`CheckpointFormatError` that names the file, the tensor and the
figures, and so that the loaders can choose zero-copy mmap views or plain reads.

Usage::

    header = read_header("model-00001.safetensors")
    mm, tensors = map_tensors(header.path, header)
    ...                      # use tensors
    del tensors; mm.close()  # views must go before the map
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from typing import IO

import torch

from ckpt_core.errors import CheckpointFormatError

__all__ = [
    "DTYPES", "DTYPE_CODES", "WIRE_DTYPES", "WIRE_CODES", "UNSUPPORTED_CODES", "MAX_HEADER_BYTES", "TensorEntry",
    "SafetensorsHeader",
    "read_header", "parse_header_bytes", "map_tensors", "read_tensors", "write_file",
]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# Wide unsigned types arrived in torch 2.3; older builds simply cannot load them.
for _code, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        DTYPES[_code] = getattr(torch, _attr)
# MX scale tensors (F8_E8M0), complex64 and the fnuz float8 variants (codes as the safetensors
# package writes them); torch builds that lack a dtype simply cannot load it.
for _code, _attr in (("F8_E8M0", "float8_e8m0fnu"), ("C64", "complex64"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        DTYPES[_code] = getattr(torch, _attr)
DTYPE_CODES: dict[torch.dtype, str] = {dt: code for code, dt in DTYPES.items()}

# Codes the format defines that no torch dtype holds element for element (sub-byte elements:
# a shape counts 4- or 6-bit values). Valid files, but we cannot carry them: "unsupported".
UNSUPPORTED_CODES = {"F4": "4-bit floats", "F6_E2M3": "6-bit floats", "F6_E3M2": "6-bit floats"}

# Named tensors (never written to a file) may also have dtypes the format has no code for: they
# travel under ckpt-engine's own codes on our wire only. Every torch dtype with a whole number of
# bytes per element and plain storage is carried; quantized and sub-byte bit dtypes are not.
WIRE_DTYPES: dict[str, torch.dtype] = dict(DTYPES)
for _code, _attr in (("C128", "complex128"), ("C32", "complex32"), ("F4_E2M1FN_X2", "float4_e2m1fn_x2")):
    if hasattr(torch, _attr):
        WIRE_DTYPES[_code] = getattr(torch, _attr)
WIRE_CODES: dict[torch.dtype, str] = {dt: code for code, dt in WIRE_DTYPES.items()}

# A real header is a few MB at most (~100 bytes per tensor); the cap keeps a corrupt
# length prefix from making us allocate or read gigabytes.
MAX_HEADER_BYTES = 64 * 1024 * 1024
_LEN_PREFIX = 8
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file; ``start``/``end`` are absolute byte offsets in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: entries sorted by ``start``, tiling the data area exactly (no overlap, no gap)."""

    path: str
    file_size: int
    data_offset: int  # 8 + header length
    tensors: tuple[TensorEntry, ...]
    metadata: dict[str, str]


def _header_len(prefix: bytes | memoryview, file_size: int, path: str, limit: int) -> int:
    """Validate the 8-byte length prefix against the file size and ``limit``; return N."""
    if file_size < _LEN_PREFIX:
        raise CheckpointFormatError(
            f"file is {file_size} bytes, shorter than the 8-byte header length prefix", path=path)
    if len(prefix) < _LEN_PREFIX:
        raise CheckpointFormatError(
            f"buffer holds {len(prefix)} bytes, shorter than the 8-byte length prefix", path=path)
    (n,) = struct.unpack_from("<Q", prefix, 0)
    if n == 0:
        raise CheckpointFormatError("header length is 0", path=path)
    # The declared length is never printed: for a file that is not safetensors it is the file's
    # first 8 bytes (a service must not echo the contents of files it was pointed at).
    if n > limit:
        raise CheckpointFormatError(
            f"the header length its first 8 bytes declare exceeds the limit {limit} bytes "
            "(not a safetensors file?)", path=path)
    if _LEN_PREFIX + n > file_size:
        raise CheckpointFormatError(
            f"the header length its first 8 bytes declare runs past the end of the file ({file_size} bytes)",
            path=path)
    return n


def _reject_duplicates(path: str):
    """json object_pairs_hook: plain json.loads keeps the last duplicate silently."""
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out: dict = {}
        for key, value in pairs:
            if key in out:
                # No tensor= here: the hook cannot tell a tensor name from a metadata key.
                raise CheckpointFormatError(f"duplicate key {key!r} in the JSON header", path=path)
            out[key] = value
        return out
    return hook


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is a Python int


def _parse_entry(name: str, raw: object, data_size: int,
                 path: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Check one header entry; return (dtype, shape, begin, end) relative to the data area."""
    def bad(msg: str) -> CheckpointFormatError:
        return CheckpointFormatError(msg, path=path, tensor=name or None)

    if not name:
        raise bad("tensor name is empty")
    if not isinstance(raw, dict):
        raise bad(f"header entry is a JSON {type(raw).__name__}, not an object")
    if raw.keys() != _ENTRY_KEYS:
        raise bad(f"header entry keys are {sorted(raw)}, expected {sorted(_ENTRY_KEYS)}")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(code, str):
        raise bad(f"dtype is {code!r}, not a string")
    if code in UNSUPPORTED_CODES:
        raise bad(f"dtype {code!r} ({UNSUPPORTED_CODES[code]}) is valid safetensors but unsupported by "
                  "ckpt-engine: no torch dtype holds it element for element")
    if code not in DTYPES:
        raise bad(f"unknown dtype {code!r}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise bad(f"data_offsets {offsets!r} is not a list of two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise bad(f"data_offsets begin {begin} > end {end}")
    if end > data_size:
        raise bad(f"tensor bytes [{begin}, {end}) run past the end of the data area "
                  f"({data_size} bytes); is the file truncated?")
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise bad(f"data_offsets span {end - begin} bytes but {code}{shape} needs {expected}")
    return dtype, tuple(shape), begin, end


def _parse_metadata(raw: object, path: str) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise CheckpointFormatError(
            f"__metadata__ must map strings to strings, got {repr(raw)[:200]}", path=path)
    return dict(raw)


def _check_layout(entries: list[TensorEntry], data_offset: int, data_size: int, path: str) -> None:
    """The safetensors package's rule (0.4 - 0.8): the tensors, sorted by offsets, tile the data area
    exactly, from its first byte to its last: no overlap, no gap, nothing after the last tensor.
    ``entries`` sorted by (start, end); a zero-length tensor sits where the previous one ended."""
    at = data_offset
    prev: TensorEntry | None = None
    for e in entries:
        if e.start != at:
            what = (f"overlap tensor {prev.name!r} at [{prev.start - data_offset}, {prev.end - data_offset})"
                    if e.start < at and prev is not None else
                    f"leave a gap of {e.start - at} bytes after data byte {at - data_offset}" if e.start > at else
                    f"start before data byte {at - data_offset}")
            raise CheckpointFormatError(
                f"bytes [{e.start - data_offset}, {e.end - data_offset}) {what}: the tensors must cover the data "
                "area contiguously, as the safetensors format requires", path=path, tensor=e.name)
        at, prev = e.end, e
    if at != data_offset + data_size:
        raise CheckpointFormatError(
            f"{data_offset + data_size - at} bytes of the data area ({data_size} bytes) after the last tensor "
            "belong to no tensor: the tensors must cover it exactly, as the safetensors format requires", path=path)


def parse_header_bytes(buf: bytes | memoryview, *, file_size: int, path: str = "<memory>",
                       max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Validate and parse a header. Pure: no I/O.

    ``buf`` holds at least the first ``8 + N`` bytes of the file (the whole file is fine);
    ``file_size`` is the full file's size, against which the data ranges are checked.
    Raises :class:`CheckpointFormatError` for every defect.
    """
    n = _header_len(buf, file_size, path, max_header_bytes)
    data_offset = _LEN_PREFIX + n
    if len(buf) < data_offset:
        raise CheckpointFormatError(
            f"buffer holds {len(buf)} bytes, header needs {data_offset}", path=path)
    try:
        text = bytes(buf[_LEN_PREFIX:data_offset]).decode("utf-8")
    except UnicodeDecodeError as exc:
        # position only: the exception's text would quote the offending byte
        raise CheckpointFormatError(f"header is not UTF-8 (at header byte {exc.start})", path=path) from exc
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates(path))
    except json.JSONDecodeError as exc:
        raise CheckpointFormatError(f"header is not JSON: {exc}", path=path) from exc
    except RecursionError as exc:   # deeply nested arrays/objects: no header has them (safetensors: depth 128)
        raise CheckpointFormatError("header is JSON nested deeper than Python's recursion limit "
                                    "(a safetensors header is at most 3 levels deep)", path=path) from exc
    if not isinstance(doc, dict):
        raise CheckpointFormatError(
            f"header is a JSON {type(doc).__name__}, not an object", path=path)

    metadata = _parse_metadata(doc.pop("__metadata__"), path) if "__metadata__" in doc else {}
    data_size = file_size - data_offset
    entries = []
    for name, raw in doc.items():
        dtype, shape, begin, end = _parse_entry(name, raw, data_size, path)
        entries.append(TensorEntry(name, dtype, shape, data_offset + begin, data_offset + end))
    entries.sort(key=lambda e: (e.start, e.end))
    _check_layout(entries, data_offset, data_size, path)
    return SafetensorsHeader(path, file_size, data_offset, tuple(entries), metadata)


def read_header(path: str | os.PathLike, *,
                max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsHeader:
    """Read and validate the header of ``path``; reads only ``8 + N`` bytes.

    The declared length is checked before the header is read, so a corrupt prefix costs
    nothing. OS errors (missing file, permissions) propagate unchanged.
    """
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(_LEN_PREFIX)
        n = _header_len(prefix, file_size, path, max_header_bytes)
        body = bytearray(n)
        _read_into(f, _LEN_PREFIX, body, path)
    return parse_header_bytes(prefix + body, file_size=file_size, path=path,
                              max_header_bytes=max_header_bytes)


def _read_into(f, offset: int, buf, path: str, tensor: str | None = None) -> None:
    """Fill ``buf`` from ``offset``; the file ending first means it was truncated."""
    view = memoryview(buf).cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):  # readinto may return short counts (network filesystems)
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointFormatError(f"file ended after {got} of {len(view)} bytes at "
                                        f"offset {offset}", path=path, tensor=tensor)
        got += k


def _open_checked(path: str, header: SafetensorsHeader | None, mode: str) -> tuple[SafetensorsHeader, IO[bytes]]:
    """Open ``path`` and make sure it still has the size its header was read at."""
    header = header if header is not None else read_header(path)
    f = open(path, mode, buffering=0)
    size = os.fstat(f.fileno()).st_size
    if size != header.file_size:
        f.close()
        raise CheckpointFormatError(
            f"file is {size} bytes but its header was read at {header.file_size} bytes; "
            "was it rewritten?", path=path)
    return header, f


def map_tensors(path: str | os.PathLike, header: SafetensorsHeader | None = None, *,
                writable: bool = False) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """Map ``path`` and return ``(mm, tensors)``: CPU tensors viewing the map, zero copies.

    The map is read-only unless ``writable``, which maps it shared read-write so writes
    reach the file. Writing into a read-only view crashes the process; torch cannot mark a
    tensor read-only. Each tensor pins the map through a memoryview, so ``mm.close()``
    raises BufferError while any view is alive: drop the tensors, then close. Zero-element
    tensors are fresh empties. Tensors whose offset is not a multiple of their itemsize are
    misaligned views; fine on x86/ARM CPUs, copy them before handing to vectorized kernels.
    """
    path = os.fspath(path)
    header, f = _open_checked(path, header, "r+b" if writable else "rb")
    with f:  # mmap keeps its own dup of the descriptor
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    tensors = {}
    view = memoryview(mm)
    with warnings.catch_warnings():
        # torch warns on every read-only buffer; read-only is exactly what we asked for.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for e in header.tensors:
            if e.nbytes == 0:  # torch.frombuffer rejects count 0
                tensors[e.name] = torch.empty(e.shape, dtype=e.dtype)
                continue
            raw = torch.frombuffer(view[e.start:e.end], dtype=torch.uint8)
            tensors[e.name] = raw.view(e.dtype).reshape(e.shape)
    view.release()  # the slices keep their own exports
    return mm, tensors


def read_tensors(path: str | os.PathLike,
                 header: SafetensorsHeader | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor into fresh, aligned CPU memory; no file or map stays open."""
    path = os.fspath(path)
    header, f = _open_checked(path, header, "rb")
    tensors = {}
    with f:
        for e in header.tensors:  # sorted by start, so the reads walk the file forward
            out = torch.empty(e.nbytes, dtype=torch.uint8)
            if e.nbytes:
                _read_into(f, e.start, out.numpy(), path, e.name)
            tensors[e.name] = out.view(e.dtype).reshape(e.shape)
    return tensors


def _encode_header(tensors: dict[str, torch.Tensor],
                   metadata: dict[str, str] | None) -> tuple[bytes, list[str]]:
    """Build the padded JSON header; return it and the names in data order."""
    doc: dict[str, object] = {}
    if metadata is not None:
        doc["__metadata__"] = _parse_metadata(metadata, "<write_file>")
    for name in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise CheckpointFormatError(f"invalid tensor name {name!r}")
    names = sorted(tensors)
    offset = 0
    for name in names:
        t = tensors[name]
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPE_CODES:
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointFormatError(f"cannot store {what} in safetensors", tensor=name)
        nbytes = t.numel() * t.element_size()
        doc[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    # The data area starts 8-byte aligned so that readers can view tensors in place.
    return text + b" " * (-len(text) % 8), names


def write_file(path: str | os.PathLike, tensors: dict[str, torch.Tensor],
               metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (any device; copied to CPU) as a safetensors file, data in name order.

    Written to a temporary sibling and renamed, so ``path`` never holds a half file.
    """
    path = os.fspath(path)
    text, names = _encode_header(tensors, metadata)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name in names:
                t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
                if t.numel():
                    f.write(t.view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
