"""The PS side of delta updates: a version's delta as a companion checkpoint, and its update.

``register_checkpoint("B", ..., base="A")`` registers B as usual (the PS keeps every version whole:
the base of the next delta, and what a full update or a fallback sends) and, per tensor of this
rank's share, encodes B against A (``encode.encode_tensor``). The payloads are registered as a
second checkpoint, ``B@delta``, of uint8 tensors named ``ckpt.delta:<tensor>``, plus one
manifest tensor per rank whose *name* says ``[base, version, rank, world]``. So the delta moves
through the unchanged broadcast pipeline (buckets, IPC buffer, agreements), and an engine worker
learns from the plan's names alone, before anything is mapped or written, that an update is a
delta, of which base, from every rank.

``update("B", req_func, delta=True)`` then

1. refuses, on every rank alike and before any collective of the transfer, a version registered
   without a base, or one whose base is not what this PS last made live in its engines
   (``DeltaBaseError``, through ``req_func.precheck`` in the update's first exchange);
2. updates ``B@delta``; each engine worker refuses a base it does not hold (a restarted engine, a
   version it skipped) in its handshake, which every rank raises as ``DeltaBaseError`` too;
3. with ``delta="fallback"``, a refused delta (either way) becomes a full update of ``B``.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import torch

from ckpt_core.delta.encode import encode_tensor
from ckpt_core.errors import CheckpointNotFoundError, ConfigError, DeltaBaseError, RemoteWorkerError

SUFFIX = "@delta"
PAYLOAD = "ckpt.delta:"              # + tensor name
MANIFEST = "ckpt.delta.manifest:"    # + JSON [base, version, rank, world]
DELTA_MODES = (True, "fallback")


def companion(name: str) -> str:
    """The name of version ``name``'s delta checkpoint."""
    return name + SUFFIX


def manifest_name(base: str, version: str, rank: int, world: int) -> str:
    return MANIFEST + json.dumps([base, version, rank, world])


def parse_manifest_name(name: str) -> tuple[str, str, int, int] | None:
    """``(base, version, rank, world)`` of a manifest tensor's name, None for any other name."""
    if not name.startswith(MANIFEST):
        return None
    try:
        base, version, rank, world = json.loads(name[len(MANIFEST):])
        if isinstance(base, str) and isinstance(version, str) and isinstance(rank, int) and isinstance(world, int):
            return base, version, rank, world
    except (ValueError, TypeError):
        pass
    return None


class DeltaVersions:
    """One PS rank's delta state: each version's base and encoding figures, and the version this
    rank last made live in its engines (None: unknown, e.g. after a failed full update)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.bases: dict[str, str] = {}
        self.figures: dict[str, dict] = {}
        self.engines_hold: str | None = None

    # -- registration ------------------------------------------------------------
    def encode(self, name: str, ckpt, base: str, base_ckpt) -> dict[str, torch.Tensor]:
        """The companion's named tensors: this rank's payloads of ``name`` against ``base``, and its manifest."""
        if not isinstance(base, str) or base_ckpt is None:
            raise DeltaBaseError(f"base {base!r} of {name!r} is not registered on rank {self.rank}")
        if any(m.box is not None for m in ckpt.metas):
            raise ConfigError(f"{name!r}: tensors registered in pieces cannot take a base yet (issue 39)")
        old = {m.name: m for m in base_ckpt.metas if m.box is None}
        gone = sorted(set(old) - {m.name for m in ckpt.metas})
        if gone:
            raise ConfigError(f"{name!r} lacks tensors of its base {base!r} on rank {self.rank}: {gone[:4]}; "
                              "a delta cannot remove tensors from an engine: register it without a base")
        t0 = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        fig = {"tensors": len(ckpt.metas), "changed_tensors": 0, "changed_elements": 0, "elements": 0,
               "payload_bytes": 0, "full_bytes": 0, "encodings": {}}
        for m in ckpt.metas:
            new = ckpt.host_tensor(m)
            prev = base_ckpt.host_tensor(old[m.name]) if m.name in old else None
            payload, info = encode_tensor(new, prev)
            fig["elements"] += info["numel"]
            fig["full_bytes"] += m.nbytes
            if payload is None:
                continue
            out[PAYLOAD + m.name] = payload
            fig["changed_tensors"] += 1
            fig["changed_elements"] += info["count"]
            fig["payload_bytes"] += info["bytes"]
            fig["encodings"][info["encoding"]] = fig["encodings"].get(info["encoding"], 0) + 1
        out[manifest_name(base, name, self.rank, self.world)] = torch.frombuffer(
            bytearray(json.dumps({"changed": sorted(out)}).encode()), dtype=torch.uint8)
        fig["encode_s"] = time.perf_counter() - t0
        self.bases[name] = base
        self.figures[name] = fig
        return out

    def forget(self, name: str) -> None:
        self.bases.pop(name, None)
        self.figures.pop(name, None)

    # -- update ------------------------------------------------------------------
    def precheck(self, name: str) -> None:
        """This rank's refusal of a delta update of ``name`` (raised into the update's first exchange)."""
        base = self.bases.get(name)
        if base is None:
            raise DeltaBaseError(f"{name!r} was not registered with a base on rank {self.rank}: update it whole")
        if self.engines_hold is not None and self.engines_hold != base:
            raise DeltaBaseError(f"the delta of {name!r} applies to {base!r}, but rank {self.rank} last made "
                                 f"{self.engines_hold!r} live in its engines")

    def made_live(self, name: str | None) -> None:
        self.engines_hold = name


def _with_precheck(req_func, check: Callable[[], None]):
    """``req_func`` with a ``precheck`` that runs ``check`` and then the caller's own, if any."""
    own = getattr(req_func, "precheck", None)

    def wrapped(handles):
        return req_func(handles)

    def precheck():
        check()
        if own is not None:
            own()

    wrapped.precheck = precheck
    return wrapped


def _refused_by_worker(exc: RemoteWorkerError) -> bool:
    return "DeltaBaseError" in str(exc)


def run_delta_update(state: DeltaVersions, name: str, req_func, mode, *, gather: Callable[[str], None],
                     update: Callable[[str, object], dict]) -> dict:
    """A delta update of version ``name`` (``ParameterServer.update(..., delta=mode)``).

    ``gather(checkpoint)`` gathers a checkpoint's metas and ``update(checkpoint, req_func)`` runs a
    broadcast update of it (both collectives: the facade hands them in). ``mode``: True, or
    ``"fallback"`` (a refused delta becomes a full update of ``name``). The result is the update's,
    with ``delta`` = this rank's encoding figures (or ``{"fallback": reason}``)."""
    if mode not in DELTA_MODES:
        raise ConfigError(f"delta must be False, True or 'fallback', got {mode!r}")
    try:
        try:
            gather(companion(name))
        except CheckpointNotFoundError as exc:
            raise DeltaBaseError(f"{name!r} was not registered with a base on every rank ({exc})") from exc
        try:
            result = update(companion(name), _with_precheck(req_func, lambda: state.precheck(name)))
        except RemoteWorkerError as exc:
            if not _refused_by_worker(exc):
                raise   # the apply failed: every worker undid it, the engines hold the base still
            state.made_live(None)   # the engines hold something else than this PS thought
            raise DeltaBaseError(f"an engine worker refused the delta of {name!r}: it does not hold its base "
                                 f"{state.bases.get(name)!r} ({str(exc).splitlines()[0]})") from exc
    except DeltaBaseError as exc:
        if mode != "fallback":
            raise
        state.made_live(None)   # until the full update succeeds, the engines hold a mix
        result = update(name, req_func)
        state.made_live(name)
        result["delta"] = {"fallback": str(exc)}
        return result
    state.made_live(name)
    result["delta"] = dict(state.figures.get(name, {}), base=state.bases.get(name))
    return result
