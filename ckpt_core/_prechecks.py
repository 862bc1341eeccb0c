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
from datetime import timedelta

from . import errors
from ._planner import TensorMeta
from ._safetensors import WIRE_DTYPES
from .errors import CkptError, ConfigError

# An update timeout above this (float("inf"), timedelta.max, ...) means "no deadline for the
# update as a whole"; it is clamped here because thread joins and socket polls overflow on larger
# values. The collectives stay bounded by PS_COLLECTIVE_TIMEOUT_S, and a worker that goes away is
# still noticed at once.
NO_DEADLINE_S = 1e8   # ~3 years

Problem = list   # [error class name, message], JSON on the wire


def update_seconds(timeout) -> float:
    """The update's ``timeout`` (seconds or a timedelta) as seconds; ConfigError unless > 0 and not NaN."""
    if isinstance(timeout, timedelta):
        value = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = float(timeout)
    else:
        raise ConfigError(f"update timeout must be seconds (a number) or a timedelta, got {timeout!r}")
    if math.isnan(value) or value <= 0:
        raise ConfigError(f"update timeout must be positive, got {timeout!r}")
    return min(value, NO_DEADLINE_S)


def problem_of(exc: CkptError) -> Problem:
    return [type(exc).__name__, str(exc)]


def raise_agreed(problems: list[Problem | None], what: str) -> None:
    """Raise, on every rank alike, the problems the ranks reported in one exchange (none: return).

    The error class is the lowest failing rank's; the message lists every rank's own message.
    """
    failed = [(r, p) for r, p in enumerate(problems) if p]
    if not failed:
        return
    first = failed[0][1]
    cls = getattr(errors, str(first[0]), None)
    if not (isinstance(cls, type) and issubclass(cls, CkptError)) or cls is errors.RemoteWorkerError:
        cls = ConfigError
    text = "; ".join(dict.fromkeys(str(p[1]) for _, p in failed))   # same text once, rank order kept
    raise cls(f"{what} refused on rank(s) {[r for r, _ in failed]}: {text}")


def parse_metas(metas, world_size: int) -> dict[str, list[list[TensorMeta]]]:
    """Metas in the form ``get_metas()`` returns, checked whole before anything is installed."""
    if not isinstance(metas, dict):
        raise ConfigError(f"metas must be the dict get_metas() returns, got {type(metas).__name__}")
    out: dict[str, list[list[TensorMeta]]] = {}
    for name, per_rank in metas.items():
        try:
            parsed = [[_meta(m) for m in ms] for ms in per_rank]
        except (TypeError, AttributeError, KeyError, ValueError) as exc:
            raise ConfigError(f"metas of {name!r} are not in the format get_metas() returns: {exc}") from exc
        if len(parsed) != world_size:
            raise ConfigError(f"metas of {name!r} describe {len(parsed)} ranks, this world has {world_size}")
        owner: dict[str, int] = {}
        for r, ms in enumerate(parsed):
            for m in ms:
                if m.name in owner:
                    raise ConfigError(f"metas of {name!r} list tensor {m.name!r} twice (ranks {owner[m.name]} and {r})")
                owner[m.name] = r
        out[name] = parsed
    return out


def _meta(m: dict) -> TensorMeta:
    meta = TensorMeta(**(m | {"shape": tuple(int(d) for d in m["shape"])}))
    ints = (meta.nbytes, meta.itemsize, meta.base, meta.base_offset, *meta.shape)
    if not (isinstance(meta.name, str) and isinstance(meta.dtype, str) and all(isinstance(v, int) for v in ints)):
        raise ValueError(f"tensor entry {m!r} has fields of the wrong type")
    dtype = WIRE_DTYPES.get(meta.dtype)
    if dtype is None or dtype.itemsize != meta.itemsize:
        raise ValueError(f"tensor {meta.name!r} has dtype code {meta.dtype!r} with itemsize {meta.itemsize}, "
                         "which this build does not carry")
    if min(ints, default=0) < 0:
        raise ValueError(f"tensor {meta.name!r} has a negative size, shape or offset")
    numel = math.prod(meta.shape)
    if meta.nbytes != numel * meta.itemsize:
        raise ValueError(f"tensor {meta.name!r}: {meta.nbytes} bytes do not match shape {meta.shape} "
                         f"x {meta.itemsize} bytes per element")
    return meta
