"""What a rank checks before a collective, and how every rank learns the verdict.

A check that fails on one rank only (a checkpoint unregistered there, a bad
timeout, metas it cannot use) must not make that rank leave while its peers
enter the collective: they would wait for it until ``PS_COLLECTIVE_TIMEOUT_S``
and break the world. Instead each rank turns its local problem into a plain
``[error class, message]`` pair, sends it in the collective's first exchange,
and every rank raises the same typed error (:func:`raise_agreed`); the world
stays usable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ckpt_core import errors
from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.errors import CkptError, ConfigError
from ckpt_core.planning.buckets import TensorMeta, first_shared_name
from ckpt_core.planning.pieces import group_pieces

Problem = list   # [error class name, message], JSON on the wire
IDENTITY = {"name": "checkpoint", "wire": "engine wire"}   # what every rank of one update must share


def problem_of(exc: Exception) -> Problem:
    """An error as it travels in an exchange. One that is not ours (a bug, a third-party library)
    travels as ``CkptError`` naming its class, so that every rank still raises a typed error."""
    if isinstance(exc, CkptError):
        return [type(exc).__name__, str(exc)]
    return ["CkptError", f"{type(exc).__name__}: {exc}"]


def req_precheck(req_func) -> Problem | None:
    """The engine's own refusal, asked before anything moves: a ``req_func`` may carry a
    ``precheck()`` (e.g. ``SglangClient.req_func``: a model SGLang cannot reload in place), which
    raises a ``CkptError`` to refuse the update. Its problem travels in the first exchange like any
    other, so every rank raises it and no engine is asked to load anything."""
    check = getattr(req_func, "precheck", None)
    if check is None:
        return None
    try:
        check()
    except Exception as exc:   # ours or not: told to every rank as a typed error
        return problem_of(exc)
    return None


def raise_agreed(problems: list[Problem | None], what: str, kinds: Mapping[str, type] | None = None) -> None:
    """Raise, on every rank alike, the problems the ranks reported in one exchange (none: return).

    The error class is the lowest failing rank's (one of ``ckpt_core.errors``, or of ``kinds``: a
    caller's own subclasses, e.g. the service's ``Forbidden``); the message lists every rank's own message.
    """
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if not failed:
        return
    first = failed[0][1]
    cls = (kinds or {}).get(str(first[0])) or getattr(errors, str(first[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, CkptError)) or cls is errors.RemoteWorkerError:
        cls = ConfigError
    text = "; ".join(dict.fromkeys(str(p[1]) for _, p in failed))   # same text once, rank order kept
    raise cls(f"{what} refused on rank(s) {[r for r, _ in failed]}: {text}")


def same_kind(views: list[dict], what: str) -> None:
    """Every rank called the same kind of update: P2P views carry ``targets``, broadcast views not.

    Checked by both kinds right after :func:`raise_agreed` on the same first exchange, so a
    mixed call fails with this one error on every rank (none waits in a collective).
    """
    p2p = [r for r, v in enumerate(views) if "targets" in v]
    if p2p and len(p2p) != len(views):
        rest = [r for r in range(len(views)) if r not in p2p]
        raise ConfigError(f"{what} refused: rank(s) {p2p} called a P2P update (ranks=[...]) but rank(s) "
                          f"{rest} a broadcast update (ranks empty or None); call it alike on every rank")


def same_call(views: list[dict], what: str, keys: dict[str, str]) -> None:
    """Every rank called the collective about the same thing: each ``key`` of ``keys`` has one
    value on every rank (``keys`` maps a view's key to what it means, for the message).

    The identity of what a collective moves (the checkpoint's name, the engines' wire) travels
    in its first exchange: ranks naming two checkpoints of one layout would otherwise each send
    their own bytes, and the engines would hold a mix of both. Raised alike on every rank.
    """
    for key, label in keys.items():
        values = [v.get(key) for v in views]
        if any(x != values[0] for x in values):
            told = ", ".join(f"rank {r} {x!r}" for r, x in enumerate(values))
            raise ConfigError(f"{what} refused: ranks disagree on the {label} ({told}); call it alike on every rank")


def parse_metas(metas, world_size: int) -> dict[str, list[list[TensorMeta]]]:
    """Metas in the form ``get_metas()`` returns, checked whole before anything is installed."""
    if not isinstance(metas, dict):
        raise ConfigError(f"metas must be the dict get_metas() returns, got {type(metas).__name__}")
    out: dict[str, list[list[TensorMeta]]] = {}
    for name, per_rank in metas.items():
        try:
            parsed = [[_meta(m) for m in ms] for ms in per_rank]
        except (TypeError, AttributeError, KeyError, ValueError) as exc:   # ConfigError is a ValueError
            raise ConfigError(f"metas of {name!r} are not in the format get_metas() returns: {exc}") from exc
        if len(parsed) != world_size:
            raise ConfigError(f"metas of {name!r} describe {len(parsed)} ranks, this world has {world_size}")
        shared = first_shared_name(parsed)
        if shared:
            raise ConfigError(f"metas of {name!r} list tensor {shared[0]!r} twice (ranks {shared[1]} and {shared[2]})")
        group_pieces(parsed)   # pieces that do not tile their tensor: CheckpointFormatError, nothing installed
        out[name] = parsed
    return out


def _meta(m: dict) -> TensorMeta:
    if not isinstance(m, dict):
        raise ValueError(f"tensor entry {m!r} is not an object")
    keys = ("name", "dtype", "shape", "nbytes", "itemsize", "base", "base_offset")
    if set(m) - {"box"} != set(keys):
        raise ValueError(f"tensor entry {m!r} needs exactly the fields {list(keys)} (and 'box' for a piece)")
    name, dtype, shape, nbytes, itemsize, base, offset = (m[k] for k in keys)
    return tensor_meta(name, dtype, shape, nbytes, itemsize, base, offset, m.get("box"),
                       where=f"tensor entry {name!r}")


def check_count(v, what: str, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"metas: {what} must be an integer >= {lo}, got {v!r}")
    return v


def tensor_meta(name, dtype, shape, nbytes, itemsize, base, offset, box=None, *, where: str) -> TensorMeta:
    """The one validation of a tensor's metas, whatever document or exchange brought them.

    Checks every field's type, the dtype code against its itemsize (a code this build does not
    carry, or ``F16`` with 4 bytes per element, would hand the engine views of the wrong type),
    and ``shape x itemsize == nbytes``. 0-byte tensors are valid. ``box``: a piece's
    ``[global_shape, offsets]`` (whether the pieces tile is ``pieces.group_pieces``' check). Raises
    ``ConfigError``.
    """
    if not isinstance(name, str) or not name or not isinstance(dtype, str) or not isinstance(shape, (list, tuple)):
        raise ConfigError(f"metas: {where} has a bad name, dtype or shape: {[name, dtype, shape]!r}")
    dims = tuple(check_count(d, f"{where} ({name}) shape") for d in shape)
    nbytes, itemsize = check_count(nbytes, f"{name} nbytes"), check_count(itemsize, f"{name} itemsize", 1)
    known = WIRE_DTYPES.get(dtype)
    if known is None or known.itemsize != itemsize:
        raise ConfigError(f"metas: tensor {name!r} has dtype code {dtype!r} with itemsize {itemsize}, "
                          "which this build does not carry")
    if math.prod(dims) * itemsize != nbytes:
        raise ConfigError(f"metas: tensor {name!r}: {nbytes} bytes do not match shape {list(dims)} "
                          f"x {itemsize} bytes per element")
    return TensorMeta(name, dtype, dims, nbytes, itemsize, check_count(base, f"{name} region"),
                      check_count(offset, f"{name} offset"), None if box is None else _box(name, box, len(dims)))


def _box(name: str, box, ndim: int) -> tuple:
    if not isinstance(box, (list, tuple)) or len(box) != 2 or not all(isinstance(b, (list, tuple)) for b in box) \
            or len(box[0]) != ndim or len(box[1]) != ndim:
        raise ConfigError(f"metas: the piece of tensor {name!r} has a bad box {box!r}: "
                          f"want [global shape, offsets] of {ndim} dimensions each")
    return (tuple(check_count(d, f"{name} global shape") for d in box[0]),
            tuple(check_count(o, f"{name} piece offset") for o in box[1]))


def meta_row(m: TensorMeta) -> list:
    """A tensor's metas as one JSON row (``tensor_meta(*row)`` reads it back)."""
    row = [m.name, m.dtype, list(m.shape), m.nbytes, m.itemsize, m.base, m.base_offset]
    return row if m.box is None else row + [[list(m.box[0]), list(m.box[1])]]
