"""The PS <-> engine-worker wire protocol (ours). JSON frames; nothing is unpickled.

Transport: one ZeroMQ PAIR socket per PS rank and update. The PS rank binds
``ipc://@ckpt-<update id>-<rank>`` (abstract Unix socket); the colocated engine
worker connects after ``req_func`` told it the handle. Every frame is a UTF-8
JSON object ``{"v": 1, "kind": <kind>, "update": <update id>, ...}``.

Exchange, in order::

    PS -> worker  hello   {device_kind, buffer: <backend descriptor>, slot_bytes, num_slots,
                           plan_digest, slices: {plan, rank}}   (slices only when routed by a slice plan)
                  + a second frame of the same message: the plan,
                           [[[name, dtype, shape, offset], ...], ...]   (one list per bucket)
    worker -> PS  ready                       (buffer mapped, whole plan validated)
    PS -> worker  bucket  {index, slot}       one per bucket, up to num_slots in flight
    worker -> PS  done    {index}             after run() returned and the device is idle
    PS -> worker  end     {keep_buffer}       all ranks succeeded: worker runs post_hook
    worker -> PS  finished                    the worker's update_weights_from_ipc returns

The hello's plan travels as a second frame (ZeroMQ multipart) so that a worker that already
validated a plan of that ``plan_digest`` and slot size does not decode it again: on a model of
thousands of tensors, decoding it cost microseconds per tensor on every update. A one-frame hello
with the plan inline as ``buckets`` is accepted too. Every other message is one frame.

``slices`` says whose slices the buckets hold: the slice plan's digest and the engine rank of that
plan the PS routed to this worker. A worker loads them only if it is that engine rank of that plan
(and whole tensors only if it expects no plan): it checks before mapping anything.

On error: the worker answers any message with ``error {index, traceback}`` and
then waits for ``abort``; the PS sends ``abort {reason}`` to every worker when
any rank failed (after the ranks agreed on it), and the worker raises. A frame
that does not decode, has another version, kind or update id, or describes
tensors outside the buffer, is a :class:`ProtocolError`: nothing is executed.
Every wait on either side has a deadline and ends in ``UpdateTimeoutError``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.errors import ProtocolError
from ckpt_core.ops.cache import BoundedCache
from ckpt_core.wire.views import BucketViews, plan_views

VERSION = 1
MAX_FRAME_BYTES = 256 << 20
PS_KINDS = ("hello", "bucket", "end", "abort")
WORKER_KINDS = ("ready", "done", "finished", "error")


def encode(kind: str, update: str, **fields: Any) -> bytes:
    return json.dumps({"v": VERSION, "kind": kind, "update": update, **fields},
                      separators=(",", ":")).encode()


def decode(frame: bytes, *, expect: tuple[str, ...], update: str | None = None) -> dict[str, Any]:
    """Decode and check the envelope of one frame; ``update=None`` accepts any update id."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        msg = json.loads(frame.decode("utf-8"))
    # RecursionError: a hostile frame of deeply nested brackets exhausts the parser's stack
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON ({exc.__class__.__name__}); first bytes {frame[:32]!r}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame is a JSON {type(msg).__name__}, expected an object")
    version = msg.get("v")
    if type(version) is not int or version != VERSION:   # JSON true and 1.0 compare equal to 1
        raise ProtocolError(f"protocol version {version!r:.40} is not supported (expected {VERSION})")
    kind = msg.get("kind")
    if not isinstance(kind, str) or kind not in expect:
        raise ProtocolError(f"unexpected message kind {kind!r:.40}; expected one of {list(expect)}")
    if not isinstance(msg.get("update"), str):
        raise ProtocolError(f"message has no update id (got {msg.get('update')!r:.40})")
    if update is not None and msg["update"] != update:
        raise ProtocolError(f"message belongs to update {msg['update']!r:.80}, not {update!r}")
    return msg


def update_id_of(frame: bytes) -> str | None:
    """Best effort: the update id of a frame that failed validation, so that the error
    answer reaches a PS of another version as its own update's error, not as noise."""
    if len(frame) > MAX_FRAME_BYTES:
        return None
    try:
        msg = json.loads(frame.decode("utf-8"))
    except (ValueError, RecursionError):   # UnicodeDecodeError, JSONDecodeError are ValueErrors
        return None
    uid = msg.get("update") if isinstance(msg, dict) else None
    return uid if isinstance(uid, str) else None


def _int(msg: dict, key: str, lo: int = 0, hi: int | None = None) -> int:
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise ProtocolError(f"field {key!r} = {value!r} must be an integer in "
                            f"[{lo}, {hi if hi is not None else 'inf'}]")
    return value


@dataclass(frozen=True)
class WireTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    # worked out once per validated plan (plans are cached), so that the worker views each tensor
    # with one call per update: row-major strides, and the offset in elements of its dtype
    strides: tuple[int, ...] = field(default=(), compare=False)
    element: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Hello:
    update: str
    device_kind: str
    buffer: dict[str, Any]
    slot_bytes: int
    num_slots: int
    buckets: tuple[tuple[WireTensor, ...], ...]
    slices: tuple[str, int] | None = None   # (slice plan digest, engine rank) the buckets are routed for
    # every tensor of the plan as (name, torch dtype, shape), for a worker's ``on_plan``: made once per
    # validated plan (cached with it), a tuple so that no caller can change it for the next update
    listing: tuple = field(default=(), compare=False, repr=False)
    # per bucket, how the worker views its tensors in batches (``views.plan_views``): once per validated plan
    views: tuple[BucketViews, ...] = field(default=(), compare=False, repr=False)


def _tensor(entry: Any, slot_bytes: int) -> WireTensor:
    if not (isinstance(entry, list) and len(entry) == 4):
        raise ProtocolError(f"tensor entry {entry!r:.80} is not [name, dtype, shape, offset]")
    name, dtype, shape, offset = entry
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"tensor name {name!r:.80} is not a non-empty string")
    if dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(f"tensor {name!r} has an invalid shape {shape!r:.80}")
    itemsize = WIRE_DTYPES[dtype].itemsize
    nbytes = math.prod(shape) * itemsize
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset + nbytes > slot_bytes:
        raise ProtocolError(f"tensor {name!r} ({nbytes} bytes at offset {offset!r}) lies outside a slot of "
                            f"{slot_bytes} bytes")
    if offset % itemsize:
        raise ProtocolError(f"tensor {name!r} offset {offset} is not aligned to its item size {itemsize}")
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return WireTensor(name, dtype, tuple(shape), offset, nbytes, tuple(reversed(strides)), offset // itemsize)


def plan_fragment(buckets: list[list[tuple[str, str, tuple[int, ...], int]]]) -> tuple[str, str]:
    """(JSON of the plan's buckets, its SHA-1): computed once per plan by the PS and cached."""
    text = json.dumps([[[n, d, list(s), o] for n, d, s, o in b] for b in buckets], separators=(",", ":"))
    return text, hashlib.sha1(text.encode()).hexdigest()


def encode_hello(update: str, *, device_kind: str, buffer: dict, slot_bytes: int, num_slots: int,
                 plan_json: str, plan_digest: str, slices: tuple[str, int] | None = None) -> tuple[bytes, bytes]:
    """The hello's two frames: its fields, and the plan pre-encoded (no re-encoding of thousands of
    tensors). ``slices``: (slice plan digest, engine rank) when the buckets are that engine rank's slices."""
    head = encode("hello", update, device_kind=device_kind, buffer=buffer, slot_bytes=slot_bytes,
                  num_slots=num_slots, plan_digest=plan_digest,
                  **({} if slices is None else {"slices": {"plan": slices[0], "rank": slices[1]}}))
    return head, plan_json.encode()


def check_parts(msg: dict[str, Any], rest: list[bytes]) -> None:
    """The frames after a message's first: the plan after a hello, nothing after any other kind."""
    most = 1 if msg["kind"] == "hello" else 0
    if len(rest) > most:
        raise ProtocolError(f"a {msg['kind']} message of {1 + len(rest)} frames; expected at most {1 + most}")
    if rest and len(rest[0]) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(rest[0])} bytes exceeds the limit of {MAX_FRAME_BYTES}")


def _plan_of(msg: dict[str, Any], plan: bytes | None) -> Any:
    """The hello's plan: its inline ``buckets``, else its second frame, decoded."""
    if plan is None or "buckets" in msg:
        return msg.get("buckets")
    try:
        return json.loads(plan.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"the hello's plan frame is not UTF-8 JSON ({exc.__class__.__name__}); "
                            f"first bytes {plan[:32]!r}") from exc


_PLAN_CACHE_SIZE = 8
_plan_cache: BoundedCache[tuple[str, int], tuple[tuple[tuple[WireTensor, ...], ...], tuple,
                                                  tuple[BucketViews, ...]]] = BoundedCache(
    _PLAN_CACHE_SIZE)   # the least recently used goes first


def parse_hello(msg: dict[str, Any], plan: bytes | None = None) -> Hello:
    """Validate the whole plan up front, so a bad message is refused before any byte is read.

    ``plan``: the hello's second frame (the plan as JSON), if it came in two.
    A plan this process already validated (same ``plan_digest`` and slot size) is
    taken from a small cache without decoding the plan again: the per-tensor checks cost
    ~20 ms for 5,000 tensors, the decoding ~4 ms.
    Only validated plans are ever cached, so the cache cannot admit a bad offset.
    """
    update = msg.get("update")
    if not isinstance(update, str) or not update:
        raise ProtocolError(f"hello has no update id (got {update!r:.40})")
    kind = msg.get("device_kind")
    buffer = msg.get("buffer")
    if not isinstance(kind, str) or not isinstance(buffer, dict):
        raise ProtocolError("hello lacks device_kind or buffer")
    num_slots = _int(msg, "num_slots", 1, 1024)
    slot_bytes = _int(msg, "slot_bytes", 1)
    nbytes = buffer.get("nbytes")
    if type(nbytes) is not int or nbytes < slot_bytes * num_slots:
        raise ProtocolError(f"buffer of {nbytes!r} bytes cannot hold {num_slots} slots of {slot_bytes} bytes")
    slices = _slices(msg.get("slices"))
    digest = msg.get("plan_digest")
    key = (digest, slot_bytes) if isinstance(digest, str) and digest else None
    cached = None if key is None else _plan_cache.get(key, touch=True)
    if cached is not None:
        parsed, listing, views = cached
        return Hello(update, kind, buffer, slot_bytes, num_slots, parsed, slices, listing, views)
    raw = _plan_of(msg, plan)
    if not isinstance(raw, list):
        raise ProtocolError("hello.buckets is not a list")
    buckets = []
    for b in raw:
        if not isinstance(b, list):
            raise ProtocolError("a bucket is not a list of tensors")
        buckets.append(tuple(_tensor(e, slot_bytes) for e in b))
    parsed = tuple(buckets)
    listing = tuple((t.name, WIRE_DTYPES[t.dtype], t.shape) for b in parsed for t in b)
    views = tuple(plan_views(b) for b in parsed)
    if key is not None:
        _plan_cache.put(key, (parsed, listing, views))
    return Hello(update, kind, buffer, slot_bytes, num_slots, parsed, slices, listing, views)


def _slices(raw: Any) -> tuple[str, int] | None:
    """A hello's ``slices`` ({plan: digest, rank: engine rank}) as (digest, rank); None when absent."""
    if raw is None:
        return None
    plan = raw.get("plan") if isinstance(raw, dict) else None
    rank = raw.get("rank") if isinstance(raw, dict) else None
    if (not isinstance(plan, str) or not 0 < len(plan) <= 128 or type(rank) is not int or rank < 0
            or set(raw) != {"plan", "rank"}):
        raise ProtocolError(f"hello.slices {raw!r:.120} is not {{plan: digest, rank: engine rank}}")
    return plan, rank


def parse_bucket(msg: dict[str, Any], hello: Hello) -> tuple[int, int]:
    index = _int(msg, "index", 0, len(hello.buckets) - 1)
    slot = _int(msg, "slot", 0, hello.num_slots - 1)
    return index, slot
