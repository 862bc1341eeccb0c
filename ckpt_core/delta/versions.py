"""The PS side of delta updates: a version's delta as a companion checkpoint, and its update.

``register_checkpoint("B", ..., base="A")`` registers B as usual (the PS keeps every version whole:
the base of the next delta, and what a full update or a fallback sends) and, per tensor of this
rank's share, encodes B against A (``encode.encode_tensor``'s payloads, all tensors together:
``batch.py``). The payloads are registered as a
second checkpoint, ``B@delta``, of uint8 tensors named ``ckpt.delta:<tensor>``, plus one
manifest tensor per rank whose *name* says ``[base, version, rank, world]``. So the delta moves
through the unchanged broadcast pipeline (buckets, IPC buffer, agreements), and an engine worker
learns from the plan's names alone, before anything is mapped or written, that an update is a
delta, of which base, from every rank.

``fold_delta("D", base="A")`` (``fold.py``) registers a second companion of D, ``D@delta:A``: D's
deltas folded into one from an older version, for engines that hold A.

``update("B", req_func, delta=True)`` then

1. picks, in one exchange of every rank before any collective of the transfer (``choose.py``), the
   companion whose base the engines hold (by what this PS last made live in them), and refuses, on
   every rank alike, a version registered without a base, or one none of whose companions leads from
   what the engines hold (``DeltaBaseError``, with the advice: the chain to apply, or ``fold_delta``);
2. updates that companion; each engine worker refuses a base it does not hold (a restarted engine, a
   version it skipped) in its handshake, which every rank raises as ``DeltaBaseError`` too;
3. with ``delta="fallback"``, a refused delta (either way) becomes a full update of ``B``.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from ckpt_core._settings import delta_threads
from ckpt_core.checkpoint.device import device_tensor
from ckpt_core.delta.batch import encode_registration
from ckpt_core.delta.encode_device import encode_on_device
from ckpt_core.delta.fold import fold_tensor
from ckpt_core.delta.lin64 import lin64_many
from ckpt_core.delta.pieces import PiecesMismatch, piece_name_of, pieces_mismatch
from ckpt_core.errors import ConfigError, DeltaBaseError, DeviceResidentError, RemoteWorkerError
from ckpt_core.planning.buckets import DELTA_SUFFIX
from ckpt_core.planning.pieces import meta_key

SUFFIX = DELTA_SUFFIX                # "@delta" (planning/buckets.py sizes a companion's buckets by it)
FOLD = DELTA_SUFFIX + ":"            # version + FOLD + base: a fold's companion (fold.py)
PAYLOAD = "ckpt.delta:"              # + tensor name
MANIFEST = "ckpt.delta.manifest:"    # + JSON [base, version, rank, world]
DELTA_MODES = (True, "fallback")
ReqFunc = Callable[[list[tuple[str, str]]], object]   # transfer/broadcast.ReqFunc


def companion(name: str) -> str:
    """The name of version ``name``'s delta checkpoint."""
    return name + SUFFIX


def fold_companion(name: str, base: str) -> str:
    """The name of the fold of version ``name``'s deltas from ``base`` (``fold_delta``): beside ``name@delta``
    (the delta from its registered base), one per base, so folds from several older versions coexist."""
    return name + FOLD + base


def manifest_name(base: str, version: str, rank: int, world: int) -> str:
    return MANIFEST + json.dumps([base, version, rank, world])


def payload_name(meta) -> str:
    """The name of a tensor's delta payload: ``ckpt.delta:<tensor>``, or a piece's (``pieces.piece_name``)."""
    return PAYLOAD + meta.name if meta.box is None else piece_name_of(meta)


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


# below this average tensor size the encode's threads contend for the GIL more than numpy's work
# releases it (dense16 x0.005, 220 KB tensors, 2 cores: 0.13 s on one thread, 0.26 s on two)
_POOL_MIN_AVG_BYTES = 1 << 20


def _each_tensor(ckpt, one: Callable) -> list:
    """``one(meta)`` of every tensor of ``ckpt``, in order; tensors of 1 MiB and more on average are
    encoded side by side on ``PS_FAULT_THREADS`` threads (numpy releases the GIL)."""
    threads = min(delta_threads(), os.cpu_count() or 1, len(ckpt.metas))
    if threads < 2 or sum(m.nbytes for m in ckpt.metas) < _POOL_MIN_AVG_BYTES * len(ckpt.metas):
        return [one(m) for m in ckpt.metas]
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-delta-encode") as pool:
        return list(pool.map(one, ckpt.metas))


class DeltaVersions:
    """One PS rank's delta state: each version's base and encoding figures, and the version this
    rank last made live in its engines (None: unknown, e.g. after a failed full update)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.bases: dict[str, str] = {}
        self.figures: dict[str, dict[str, object]] = {}
        self.folds: dict[str, dict[str, dict]] = {}   # version -> base -> figures of its fold (fold_delta)
        self.engines_hold: str | None = None
        # device-resident versions: the lin64 of each tensor when registered (a base must still hold them)
        self.snapshots: dict[str, list[str]] = {}
        # versions registered with a base but no delta: pieced unlike it on this rank (pieces.py), and why
        self.refused: dict[str, str] = {}

    # -- registration ------------------------------------------------------------
    def encode(self, name: str, ckpt, base: str, base_ckpt,
               device: torch.device | None = None, alloc=None) -> dict[str, torch.Tensor] | None:
        """The companion's named tensors: this rank's payloads of ``name`` against ``base``, and its manifest.
        A device-resident version (``on_device``) is encoded on ``device`` against a device-resident base
        (``encode_device.py``), and its payloads and manifest lie there. None when the two are not pieced
        alike here (``pieces.py``): no companion; why is kept in ``refused`` for the update's agreement.
        ``alloc``: where a host version's payloads are written (``Encoded.payload_list``)."""
        if not isinstance(base, str) or base_ckpt is None:
            raise DeltaBaseError(f"base {base!r} of {name!r} is not registered on rank {self.rank}")
        try:
            out, fig = self._direct(name, ckpt, base, base_ckpt, device, alloc)
        except PiecesMismatch as exc:   # a layout change: registered whole, its delta refused when asked for
            self.refused[name] = str(exc)
            return None
        self.bases[name] = base
        self.refused.pop(name, None)
        self.figures[name] = fig
        return out

    def _direct(self, name: str, ckpt, base: str, base_ckpt,
                device: torch.device | None = None, alloc=None) -> tuple[dict[str, torch.Tensor], dict]:
        """``name`` encoded against registered ``base`` on this rank: the companion's tensors, its figures
        (a device-resident pair on ``device``, where the payloads then lie)."""
        refuse_mixed_sides(name, ckpt.on_device, base, base_ckpt.on_device, self.rank)
        if ckpt.on_device and any(m.box is not None for m in ckpt.metas):
            raise ConfigError(f"{name!r}: device-resident tensors registered in pieces cannot take a base yet "
                              "(register the pieces in host memory, or update it whole)")
        mismatch = pieces_mismatch(name, ckpt.metas, base, base_ckpt.metas, self.rank)
        if mismatch:
            raise PiecesMismatch(mismatch)
        old = {meta_key(m): m for m in base_ckpt.metas}   # a piece pairs with the base's piece of its box
        gone = sorted(set(old) - {meta_key(m) for m in ckpt.metas})
        if gone:
            raise ConfigError(f"{name!r} lacks tensors of its base {base!r} on rank {self.rank}: {gone[:4]}; "
                              "a delta cannot remove tensors from an engine: register it without a base")
        t0 = time.perf_counter()
        phases = None
        if ckpt.on_device:
            self._check_unchanged(base, base_ckpt)
            encoded = encode_on_device([(device_tensor(ckpt, m), device_tensor(base_ckpt, old[meta_key(m)])
                                         if meta_key(m) in old else None) for m in ckpt.metas],
                                       digests=self.snapshots.get(name))
        else:
            rewritten = base_ckpt.rewritten_problem()
            if rewritten:   # its registered bytes are the file's: not what the engines received
                raise DeltaBaseError(f"base {base!r} of {name!r} changed since it was registered on rank {self.rank}: "
                                     f"{rewritten}; a delta applies to the bytes the engines received: write each "
                                     "version to its own file (or register with use_inplace_pin_memory=False, a "
                                     "copy), or update the new version whole")
            batch = encode_registration(ckpt, base_ckpt, old)   # all tensors together (batch.py)
            encoded = batch.payload_list({r: region.tensor.numpy() for r, region in ckpt.regions.items()}, alloc)
            ckpt.digests.update(batch.digests)
            phases = batch.phases
        out, fig = self._companion(name, base, ckpt, encoded, t0, device=device)
        if phases is not None:
            fig["phases"] = phases
        return out, fig

    def _companion(self, name: str, base: str, ckpt, encoded: list, t0: float,
                   manifest: dict | None = None,
                   device: torch.device | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """The companion's named tensors from ``encoded`` (``(payload or None, info)`` per tensor of
        ``ckpt``), with this rank's manifest, and its figures."""
        out: dict[str, torch.Tensor] = {}
        counts = {"changed_tensors": 0, "changed_elements": 0, "elements": 0, "payload_bytes": 0, "full_bytes": 0}
        encodings: dict[str, int] = {}
        for m, (payload, info) in zip(ckpt.metas, encoded):
            counts["elements"] += info["numel"]
            counts["full_bytes"] += m.nbytes
            if payload is None:
                continue
            out[payload_name(m)] = payload
            counts["changed_tensors"] += 1
            counts["changed_elements"] += info["count"]
            counts["payload_bytes"] += info["bytes"]
            encodings[info["encoding"]] = encodings.get(info["encoding"], 0) + 1
        listing = torch.frombuffer(bytearray(json.dumps({"changed": sorted(out), **(manifest or {})}).encode()),
                                   dtype=torch.uint8)
        out[manifest_name(base, name, self.rank, self.world)] = listing if device is None else listing.to(device)
        fig: dict[str, object] = {"tensors": len(ckpt.metas), **counts, "encodings": encodings,
                                  "encode_s": time.perf_counter() - t0}
        return out, fig

    def fold(self, name: str, ckpt, base: str, base_ckpt, steps: list) -> dict[str, torch.Tensor]:
        """The tensors of the fold of ``name``'s deltas from ``base`` (``fold.py``): ``name`` encoded against
        ``base_ckpt`` when ``base`` is registered here, else from ``steps``, the companions of the registered
        chain after ``base`` (``[(version, its companion checkpoint)]``, oldest first, ``name``'s last)."""
        t0 = time.perf_counter()
        if base_ckpt is not None:
            out, fig = self._direct(name, ckpt, base, base_ckpt)
            fig["fold"] = "encoded against the registered base"
        else:
            # payloads by name: a piece's are of its box, which every step kept (each was pieced as its base)
            payloads = [{m.name: comp.host_tensor(m) for m in comp.metas if not m.name.startswith(MANIFEST)}
                        for _, comp in steps]
            chain = [base] + [v for v, _ in steps]

            def one(m):
                return fold_tensor(ckpt.host_tensor(m), [p.get(payload_name(m)) for p in payloads], meta_key(m))
            out, fig = self._companion(name, base, ckpt, _each_tensor(ckpt, one), t0, {"chain": chain})
            fig["fold"] = " -> ".join(chain)
        self.folds.setdefault(name, {})[base] = fig
        return out

    def figures_of(self, name: str, base: str | None) -> dict:
        """This rank's encoding figures of ``name``'s delta from ``base`` (registered or folded), {} if none."""
        if base is not None and base in self.folds.get(name, {}):
            return dict(self.folds[name][base])
        return dict(self.figures.get(name, {})) if self.bases.get(name) == base else {}

    def forget(self, name: str) -> None:
        self.bases.pop(name, None)
        self.refused.pop(name, None)
        self.figures.pop(name, None)
        self.folds.pop(name, None)

    def snapshot(self, name: str, ckpt) -> None:
        """Record what device-resident version ``name`` holds as it is registered (a ``lin64`` per tensor,
        on the device: one read of the version). A trainer's tensors are its own to change; a version that
        changed afterwards is no base for a delta (``_check_unchanged``)."""
        self.snapshots[name] = lin64_many(device_tensor(ckpt, m) for m in ckpt.metas)

    def _check_unchanged(self, base: str, base_ckpt) -> None:
        """``DeviceResidentError`` unless device-resident ``base`` still holds the bytes it was registered
        with: a delta against tensors the trainer changed since (stepped in place) would leave the engines,
        which received the registered bytes, silently different from the new version."""
        then = self.snapshots.get(base)
        now = lin64_many(device_tensor(base_ckpt, m) for m in base_ckpt.metas)
        changed = [m.name for m, a, b in zip(base_ckpt.metas, then or [], now) if a != b]
        if then is None or changed:
            raise DeviceResidentError(
                f"base {base!r} cannot be shown unchanged on the device since it was registered on rank {self.rank} "
                f"({', '.join(changed[:4]) or 'registered with on_device_digest=False: no record of its bytes'}"
                f"{' ...' if len(changed) > 4 else ''}): a delta applies to the bytes the engines received; "
                "register each version as its own copy (e.g. {n: p.detach().clone()}) and do not change it while "
                "a later version names it as base, or update the new version whole")

    def drop_snapshot(self, name: str) -> None:
        self.snapshots.pop(name, None)

    # -- update ------------------------------------------------------------------
    def made_live(self, name: str | None) -> None:
        self.engines_hold = name


def refuse_mixed_sides(name: str, on_device: bool, base: str, base_on_device: bool, rank: int) -> None:
    """``DeviceResidentError`` when version ``name`` and its base are not registered on the same side
    (both on the device, or both in host memory): a delta compares them where they both lie."""
    if on_device != base_on_device:
        where = {True: "on the device (on_device=True)", False: "in host memory"}
        raise DeviceResidentError(f"{name!r} is registered {where[on_device]} and its base {base!r} "
                                  f"{where[base_on_device]} on rank {rank}: a delta compares two versions where "
                                  "they both lie; register both on the device (a trainer's previous weights kept "
                                  "there) or both in host memory")


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
    fold = (f"fold_delta({name!r}, base={held!r}) on every rank (owners: then gather_metas({name!r}) for joining "
            "worlds) and one delta=True update")
    if held in chain[:-2]:
        steps = chain[chain.index(held) + 1:]
        return (f"registered deltas lead from {held!r} to {name!r} ({' -> '.join(chain)}): apply them in order, "
                f"{', then '.join(repr(v) for v in steps)} (delta=True each), or fold them into one: "
                f"{fold}, or {whole}")
    if len(chain) < 2:
        return whole if held is None else f"{whole}, or, where {held!r} is still registered, {fold}"
    return (f"{whole}, or bring it to one of {chain[:-1]} first: the registered deltas run {' -> '.join(chain)}"
            + ("" if held is None else f"; or, where {held!r} is still registered, {fold}"))


def worker_holds(message: str) -> str | None:
    """The version an engine worker said it holds when it refused a delta (``apply._Update.on_plan``)."""
    found = re.search(r"this worker holds (None|'[^']*')", message)
    return None if found is None or found.group(1) == "None" else found.group(1)[1:-1]


def worker_refusal(message: str) -> str:
    """The line of a worker's refusal (its ``DeltaBaseError``) in a remote failure's text, else its first line."""
    lines = message.splitlines()
    refusal = (ln.strip() for ln in lines if "DeltaBaseError:" in ln or _REFUSAL.search(ln))
    return next(refusal, lines[0] if lines else "")


def accepts_deltas(req_func):
    """Mark ``req_func`` as one whose engine applies deltas (returns it). On the stock wire a
    ``ParameterServer.update(..., delta=True)`` needs it on every rank's ``req_func`` (asked before
    anything moves): a stock worker such as SGLang's own IPC route would load a delta's payloads as
    tensors of those names, and SGLang's loaders skip names they do not know, with a warning. Our
    SGLang loader applies them (``SglangClient.req_func(deltas=True, ...)`` is marked); a rank whose
    ``req_func`` posts nothing may be marked too (nothing it posts can drop a payload)."""
    setattr(req_func, "accepts_deltas", True)
    return req_func


def check_accepts_deltas(req_func: ReqFunc, wire: str) -> None:
    """``ConfigError`` when a delta over ``wire`` could reach an engine that does not apply it (see
    :func:`accepts_deltas`)."""
    if wire != "native" and not getattr(req_func, "accepts_deltas", False):
        raise ConfigError(f"a delta over the {wire!r} wire needs a req_func marked with ckpt_core.delta.versions."
                          "accepts_deltas (SglangClient.req_func(deltas=True, weight_version=...) is): a stock worker "
                          "such as SGLang's /update_weights_from_ipc would load its payloads as unknown tensors")


_REFUSAL = re.compile(r"this worker holds (None|'[^']*'), not the base '[^']*' of the delta of")


def refused_by_worker(exc: RemoteWorkerError) -> bool:
    """An engine worker refused the delta's base in its handshake (``apply._Update.on_plan``). The
    refusal reaches the PS either typed, over the worker's socket, or first as the text of the
    engine's answer to ``req_func`` (vLLM's ``/collective_rpc`` answers 500 with the worker's
    message, without its type); which one arrives first is a race, so both are recognized."""
    text = str(exc)
    return "DeltaBaseError" in text or _REFUSAL.search(text) is not None


def run_delta_update(state: DeltaVersions, name: str, req_func: ReqFunc, mode, *,
                     prepare: Callable[[], tuple[str, str]],
                     update: Callable[[str, ReqFunc], dict], bases: Callable[[], dict[str, str]],
                     affects_engine: bool = True) -> dict:
    """A delta update of version ``name`` (``ParameterServer.update(..., delta=mode)``), broadcast or P2P.

    ``prepare()`` picks the companion (``name@delta``, or a fold ``name@delta:<base>``), makes its
    metas known on every rank and returns ``(base, companion)``, refusing (``DeltaBaseError`` on
    every rank alike) what it can before anything moves;
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
            base, comp = prepare()
            result = update(comp, req_func)
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
    result["delta"] = {**state.figures_of(name, base), **result.get("delta", {}), "base": base, "companion": comp}
    return result
