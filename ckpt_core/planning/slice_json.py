"""A slice plan's JSON form read back: from an engine's workers, another PS rank, or a file.

Whatever arrives is checked field by field before a :class:`~ckpt_core.planning.slices.SlicePlan`
is built from it and checked whole (``check_plan``): a malformed document (a rank that is not a
number, ``needs`` that is not an object, a truncated file, ...) is a ``ConfigError`` naming the
field (``ranks[1].needs``), and for a file the file too; never a raw ``KeyError``/``ValueError``.
The written form is ``slices.plan_to_json``.

No torch.
"""

from __future__ import annotations

import json
import os

from ckpt_core.errors import CkptError, ConfigError
from ckpt_core.planning.slices import (
    PLAN_VERSION,
    Box,
    RankSlices,
    SliceKey,
    SlicePlan,
    Write,
    check_plan,
    plan_to_json,
)

__all__ = ["plan_from_json", "rank_from_json", "read_plan_file", "write_plan_file"]


def _shown(value) -> str:
    return repr(value)[:200]


def _object(value, what: str, of: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"slice plan: {what} must be an object mapping {of}, got {_shown(value)}")
    return value


def _list(value, what: str, of: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"slice plan: {what} must be a list of {of}, got {_shown(value)}")
    return value


def _count(value, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"slice plan: {what} must be an integer >= {low}, got {_shown(value)}")
    return value


def _ints(value, what: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or (n is not None and len(value) != n) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ConfigError(f"slice plan: {what} must be a list of {n or 'some'} non-negative integers, "
                          f"got {_shown(value)}")
    return tuple(value)


def _box(value, what: str) -> Box:
    triples = (_ints(x, f"{what}[{i}]", 3) for i, x in enumerate(_list(value, what, "[dim, start, length]")))
    return tuple((d, s, n) for d, s, n in triples)   # _ints checked the length


def rank_from_json(doc, where: str = "a rank's entry") -> RankSlices:
    """One engine rank's slices (``slices.rank_to_json``); ``where`` names it in errors (``ranks[1]``)."""
    if not isinstance(doc, dict) or not {"rank", "needs", "params", "writes"} <= set(doc):
        raise ConfigError(f"slice plan: {where} needs rank, needs, params and writes, got {_shown(doc)}")
    rank = _count(doc["rank"], f"{where}.rank")
    needs = {n: None if b is None else _box(b, f"{where}.needs[{n!r}]")
             for n, b in _object(doc["needs"], f"{where}.needs", "tensor names to boxes or null").items()}
    params = {p: _ints(s, f"{where}.params[{p!r}]")
              for p, s in _object(doc["params"], f"{where}.params", "parameter names to shapes").items()}
    writes = []
    for i, w in enumerate(_list(doc["writes"], f"{where}.writes", "[param, region, source]")):
        if not isinstance(w, list) or len(w) != 3 or not isinstance(w[0], str) or not (
                w[2] is None or isinstance(w[2], str)):
            raise ConfigError(f"slice plan: {where}.writes[{i}] must be [param, region, source], got {_shown(w)}")
        writes.append(Write(w[0], _box(w[1], f"{where}.writes[{i}] region"), w[2]))
    return RankSlices(rank, needs, params, tuple(writes))


def _key(doc) -> SliceKey:
    k = _object(doc, "key", "model, layout and engine to strings")
    if not all(isinstance(k.get(f), str) for f in ("model", "layout", "engine")):
        raise ConfigError(f"slice plan: key must have the strings model, layout and engine, got {_shown(k)}")
    return SliceKey(k["model"], k["layout"], k["engine"])


def _tensors(doc) -> dict[str, tuple[str, tuple[int, ...], int]]:
    out = {}
    for n, t in _object(doc, "tensors", "names to [dtype, shape, itemsize]").items():
        if not isinstance(t, list) or len(t) != 3 or not isinstance(t[0], str):
            raise ConfigError(f"slice plan: tensors[{n!r}] must be [dtype, shape, itemsize], got {_shown(t)}")
        out[n] = (t[0], _ints(t[1], f"tensors[{n!r}] shape"), _count(t[2], f"tensors[{n!r}] itemsize", 1))
    return out


def plan_from_json(doc) -> SlicePlan:
    """Parse and validate (``check_plan``) a plan document; ConfigError for a malformed one (naming the
    field), CheckpointFormatError for a well-formed plan that leaves a hole or reads outside a tensor."""
    if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
        raise ConfigError(f"slice plan: expected an object of version {PLAN_VERSION}, got {_shown(doc)}")
    missing = sorted({"key", "tensors", "ranks"} - set(doc))
    if missing:
        raise ConfigError(f"slice plan: the document lacks {missing}")
    key, tensors = _key(doc["key"]), _tensors(doc["tensors"])
    ranks = tuple(rank_from_json(r, f"ranks[{i}]")
                  for i, r in enumerate(_list(doc["ranks"], "ranks", "each engine rank's slices")))
    if [r.rank for r in ranks] != list(range(len(ranks))):
        raise ConfigError(f"slice plan: ranks must be listed 0..n-1 in order, got {[r.rank for r in ranks][:16]}")
    plan = SlicePlan(key, tensors, ranks)
    check_plan(plan)
    return plan


def write_plan_file(path, plan: SlicePlan) -> None:
    """The plan as a JSON file (written whole or not at all), for ``read_plan_file`` and
    ``ckpt-engine plan --slices-plan``."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(plan_to_json(plan), f)
    os.replace(tmp, path)


def read_plan_file(path) -> SlicePlan:
    """A plan written by ``write_plan_file``, parsed and checked. Any problem (unreadable, not JSON,
    a malformed or inconsistent plan) is a ConfigError naming the file and, where it is one, the field."""
    where = repr(os.fspath(path))
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError, RecursionError) as exc:   # RecursionError: JSON nested too deep
        raise ConfigError(f"cannot read the slice plan {where}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    try:
        return plan_from_json(doc)
    except CkptError as exc:
        raise ConfigError(f"the slice plan {where} is malformed: {exc}") from exc
