"""The PS side of delta updates: a version's delta as a companion checkpoint, and its update.

``register_checkpoint("B", ..., base="A")`` registers B as usual (the PS keeps every version whole:
the base of the next delta, and what a full update or a fallback sends) and, per tensor of this
rank's share, encodes B against A (``encode.encode_tensor``'s payloads, for all the tensors together:
``batch.py``). The payloads are registered as a
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
import re
import time
from typing import Callable

import numpy as np

from ckpt_core.checkpoint.sources import RegisteredCheckpoint, build_packed
from ckpt_core.delta.batch import encode_registration
from ckpt_core.errors import ConfigError, DeltaBaseError, RemoteWorkerError

SUFFIX = "@delta"
PAYLOAD = "ckpt.delta:"              # + tensor name
MANIFEST = "ckpt.delta.manifest:"    # + JSON [base, version, rank, world]
DELTA_MODES = (True, "fallback")
ReqFunc = Callable[[list[tuple[str, str]]], object]   # transfer/broadcast.ReqFunc


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
        self.figures: dict[str, dict[str, object]] = {}
        self.engines_hold: str | None = None

    # -- registration ------------------------------------------------------------
    def encode(self, name: str, ckpt, base: str, base_ckpt, backend) -> RegisteredCheckpoint:
        """The companion checkpoint (``companion(name)``, on ``backend``): this rank's payloads of ``name``
        against ``base``, and its manifest, written in place into its region."""
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
        counts = {"changed_tensors": 0, "changed_elements": 0, "elements": 0, "payload_bytes": 0, "full_bytes": 0}
        encodings: dict[str, int] = {}
        encoded = encode_registration(ckpt, base_ckpt, old)
        changed: list[tuple[int, str, int]] = []   # (meta index, payload name, bytes)
        for i, (m, info) in enumerate(zip(ckpt.metas, encoded.infos)):
            counts["elements"] += info["numel"]
            counts["full_bytes"] += m.nbytes
            if info["encoding"] is None:
                continue
            changed.append((i, PAYLOAD + m.name, info["bytes"]))
            counts["changed_tensors"] += 1
            counts["changed_elements"] += info["count"]
            counts["payload_bytes"] += info["bytes"]
            encodings[info["encoding"]] = encodings.get(info["encoding"], 0) + 1
        manifest = json.dumps({"changed": sorted(n for _, n, _ in changed)}).encode()
        t1 = time.perf_counter()
        comp, offsets = build_packed(companion(name), backend, [(n, size) for _, n, size in changed]
                                     + [(manifest_name(base, name, self.rank, self.world), len(manifest))])
        try:
            buf = comp.regions[0].tensor.numpy()
            encoded.write(buf, {i: off for (i, _, _), off in zip(changed, offsets)},
                          {r: region.tensor.numpy() for r, region in ckpt.regions.items()})
            buf[offsets[-1]: offsets[-1] + len(manifest)] = np.frombuffer(manifest, dtype=np.uint8)
        except BaseException:
            comp.release()
            raise
        phases = dict(encoded.phases, write=time.perf_counter() - t1)
        fig: dict[str, object] = {"tensors": len(ckpt.metas), **counts, "encodings": encodings,
                                  "encode_s": time.perf_counter() - t0, "phases": phases}
        ckpt.digests.update(encoded.digests)
        self.bases[name] = base
        self.figures[name] = fig
        return comp

    def forget(self, name: str) -> None:
        self.bases.pop(name, None)
        self.figures.pop(name, None)

    # -- update ------------------------------------------------------------------
    def precheck(self, name: str, holds: str | None = None, bases: dict[str, str] | None = None) -> None:
        """This rank's refusal of a delta update of ``name`` into engines that hold ``holds`` (default:
        what this rank last made live); ``bases``: every delta this rank knows, for the advice."""
        base = (bases or self.bases).get(name)
        holds = self.engines_hold if holds is None else holds
        if base is None:
            raise DeltaBaseError(f"{name!r} was not registered with a base on rank {self.rank}: update it whole")
        if holds is not None and holds != base:
            raise DeltaBaseError(f"the delta of {name!r} applies to {base!r}, but rank {self.rank} last made "
                                 f"{holds!r} live in its engines; {advice(bases or self.bases, name, holds)}")

    def made_live(self, name: str | None) -> None:
        self.engines_hold = name


def base_of_manifests(names, name: str) -> str | None:
    """The base that the delta manifests among tensor ``names`` of ``name``'s companion agree on
    (what a rank that only loaded the owners' metas learns of a delta); None if they name none.
    ``DeltaBaseError`` when they disagree, name another version, or a PS rank's manifest is missing."""
    found = [m for m in (parse_manifest_name(n) for n in names) if m is not None]
    if not found:
        return None
    pairs = {(b, v, w) for b, v, _, w in found}
    if len(pairs) != 1:
        raise DeltaBaseError(f"the owners' delta manifests of {name!r} disagree: {sorted(pairs)[:4]}")
    base, version, world = pairs.pop()
    ranks = sorted(r for _, _, r, _ in found)
    if version != name or ranks != list(range(world)):
        raise DeltaBaseError(f"the delta registered as {companion(name)!r} is of {version!r}, with the manifests "
                             f"of PS ranks {ranks} of {world}: register it again on every owner")
    return base


def chain_to(bases: dict[str, str], name: str) -> list[str]:
    """The versions from the oldest known base to ``name`` along registered deltas (``bases``:
    version -> base), oldest first: ``["A", "B", "C"]`` when B has base A and C base B."""
    chain = [name]
    while chain[-1] in bases and bases[chain[-1]] not in chain:
        chain.append(bases[chain[-1]])
    return chain[::-1]


def advice(bases: dict[str, str], name: str, held: str | None) -> str:
    """What would bring an engine that holds ``held`` (None: nothing, or unknown) to ``name``."""
    chain = chain_to(bases, name)
    whole = f"update {name!r} whole (delta=False; delta='fallback' does so when a delta is refused)"
    if held in chain[:-2]:
        steps = chain[chain.index(held) + 1:]
        return (f"registered deltas lead from {held!r} to {name!r} ({' -> '.join(chain)}): apply them in order, "
                f"{', then '.join(repr(v) for v in steps)} (delta=True each), or {whole}")
    if len(chain) < 2:
        return whole
    return f"{whole}, or bring it to one of {chain[:-1]} first: the registered deltas run {' -> '.join(chain)}"


def worker_holds(message: str) -> str | None:
    """The version an engine worker said it holds when it refused a delta (``apply._Update.on_plan``)."""
    found = re.search(r"this worker holds (None|'[^']*')", message)
    return None if found is None or found.group(1) == "None" else found.group(1)[1:-1]


def worker_refusal(message: str) -> str:
    """The line of a worker's refusal (its ``DeltaBaseError``) in a remote failure's text, else its first line."""
    lines = message.splitlines()
    refusal = (ln.strip() for ln in lines if "DeltaBaseError:" in ln or _REFUSAL.search(ln))
    return next(refusal, lines[0] if lines else "")


def with_precheck(req_func: ReqFunc, check: Callable[[], None]) -> ReqFunc:
    """``req_func`` with a ``precheck`` that runs ``check`` and then the caller's own, if any."""
    own = getattr(req_func, "precheck", None)

    def precheck() -> None:
        check()
        if own is not None:
            own()

    def wrapped(handles: list[tuple[str, str]]) -> object:
        return req_func(handles)

    setattr(wrapped, "precheck", precheck)   # read by prechecks.req_precheck in the update's first exchange
    return wrapped


_REFUSAL = re.compile(r"this worker holds (None|'[^']*'), not the base '[^']*' of the delta of")


def refused_by_worker(exc: RemoteWorkerError) -> bool:
    """An engine worker refused the delta's base in its handshake (``apply._Update.on_plan``). The
    refusal reaches the PS either typed, over the worker's socket, or first as the text of the
    engine's answer to ``req_func`` (vLLM's ``/collective_rpc`` answers 500 with the worker's
    message, without its type); which one arrives first is a race, so both are recognized."""
    text = str(exc)
    return "DeltaBaseError" in text or _REFUSAL.search(text) is not None


def run_delta_update(state: DeltaVersions, name: str, req_func: ReqFunc, mode, *, prepare: Callable[[], str | None],
                     update: Callable[[str, ReqFunc], dict], bases: Callable[[], dict[str, str]],
                     affects_engine: bool = True) -> dict:
    """A delta update of version ``name`` (``ParameterServer.update(..., delta=mode)``), broadcast or P2P.

    ``prepare()`` makes the companion's metas known on every rank and returns the delta's base,
    refusing (``DeltaBaseError`` on every rank alike) what it can before anything moves;
    ``update(checkpoint, req_func)`` runs the transfer of a checkpoint (both collectives: the
    caller hands them in); ``bases()`` the deltas this rank knows (version -> base), for the
    advice a refusal carries. ``affects_engine``: this rank's engine takes part (False on a rank
    outside a P2P update's ``ranks``, whose engine keeps what it held). ``mode``: True, or
    ``"fallback"`` (a refused delta becomes a full update of ``name``). The result is the update's,
    with ``delta`` = this rank's figures (or ``{"fallback": reason}``)."""
    if mode not in DELTA_MODES:
        raise ConfigError(f"delta must be False, True or 'fallback', got {mode!r}")
    live = state.made_live if affects_engine else (lambda _name: None)
    base = None
    try:
        try:
            base = prepare()
            result = update(companion(name), req_func)
        except RemoteWorkerError as exc:
            if not refused_by_worker(exc):
                raise   # the apply failed: every worker undid it, the engines hold the base still
            live(None)   # the engines hold something else than this PS thought
            raise DeltaBaseError(f"an engine worker refused the delta of {name!r}: it does not hold its base "
                                 f"{base!r} ({worker_refusal(str(exc))}); "
                                 f"{advice(bases(), name, worker_holds(str(exc)))}") from exc
    except DeltaBaseError as exc:
        if mode != "fallback":
            raise
        live(None)   # until the full update succeeds, the engines hold a mix
        result = update(name, req_func)
        live(name)
        result["delta"] = {"fallback": str(exc)}
        return result
    live(name)
    result["delta"] = {**state.figures.get(name, {}), **result.get("delta", {}), "base": base}
    return result
