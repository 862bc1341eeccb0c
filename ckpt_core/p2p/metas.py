"""The metas file: what a reader needs to pull a checkpoint from its owners, as versioned JSON.

Never pickle (a pickled metas file, as the reference writes, can run code when read).
Layout (version 1; version 2 is the same plus the owners' ``"slices"``)::

    {"format": "ckpt-engine/metas", "version": 1 | 2,
     "checkpoints": {NAME: {"owners": [            # one entry per owner rank, in rank order
         {"rank": 0,
          "p2p": {"address": "10.0.0.5:15021", "host": "10.0.0.5", "nic": "mlx5_0" | null,
                  "regions": {"0": [remote_ptr, nbytes], ...},
                  "stamp": [remote_ptr, "32 hex digits"],
                  "digests": {tensor name: "32 hex digits", ...},
                  # version 2 only: per slice plan digest, the owner's digest of each box it serves
                  "slices": {plan digest (40 hex): {tensor name: {box key: "32 hex digits"}}}} | null,
          "tensors": [[name, dtype, shape, nbytes, itemsize, region, offset], ...]}]}}}

``parse`` validates everything a reader will dereference (types, ranges, dtype codes
against itemsizes, every tensor with bytes inside a region that the owner registered)
before anything is installed, and names what is wrong; a foreign or malformed document
is a ``ConfigError``, never a crash. Tensor rows are checked by the one validation that
the unversioned dicts and gathered metas go through too (``prechecks.tensor_meta``).

A document carries box digests (``"slices"``, ``ParameterServer.get_metas(slices=plan)``) only
in version 2; one without them is written as version 1, so older readers still read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ckpt_core.errors import ConfigError
from ckpt_core.planning.buckets import TensorMeta
from ckpt_core.planning.pieces import group_pieces
from ckpt_core.transfer.prechecks import check_count, meta_row, tensor_meta

FORMAT = "ckpt-engine/metas"
VERSION = 2              # written when an owner publishes box digests ("slices"); else VERSION_PLAIN
VERSION_PLAIN = 1
READS = (VERSION_PLAIN, VERSION)
STAMP_BYTES = 16
PLAN_DIGEST_BYTES = 20   # SlicePlan.digest: SHA-1


@dataclass(frozen=True)
class Peer:
    """An owner rank's P2P store as a reader sees it."""
    address: str                      # "host:rpc_port" of its Mooncake TransferEngine
    host: str
    nic: str | None
    regions: dict[int, tuple[int, int]]   # region id -> (remote pointer, nbytes)
    # (remote pointer, hex token): the owner clears the token before it unregisters the checkpoint,
    # so a reader that still finds it after a read knows the bytes it read were this checkpoint's
    stamp: tuple[int, str] | None = None
    # tensor name -> digest of its bytes at registration (SHA-256, 16 bytes; p2p/digests.py), checked by readers
    digests: dict[str, str] | None = None
    # slice plan digest -> {tensor: {box key (p2p/slices.box_key): digest of the box's packed bytes}}: what a
    # joining world's sliced update checks each slice against (published with get_metas(slices=plan))
    slices: dict[str, dict[str, dict[str, str]]] | None = None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"address": self.address, "host": self.host, "nic": self.nic,
               "regions": {str(k): [p, n] for k, (p, n) in sorted(self.regions.items())}}
        if self.stamp is not None:
            out["stamp"] = [self.stamp[0], self.stamp[1]]
        if self.digests is not None:
            out["digests"] = dict(self.digests)
        if self.slices:
            out["slices"] = {k: {n: dict(b) for n, b in v.items()} for k, v in self.slices.items()}
        return out


@dataclass(frozen=True)
class Source:
    """One checkpoint as readers pull it: every owner's tensors and P2P store."""
    metas: list[list[TensorMeta]]
    peers: list[Peer | None]


def dump(metas: dict[str, list[list[TensorMeta]]], peers: dict[str, list[Peer | None]]) -> dict:
    """The versioned document of these checkpoints (plain JSON types)."""
    out, boxed = {}, False
    for name, per_rank in metas.items():
        ps = peers.get(name) or [None] * len(per_rank)
        boxed = boxed or any(p is not None and p.slices for p in ps)
        out[name] = {"owners": [{"rank": r, "p2p": None if (p := ps[r]) is None else p.to_json(),
                                 "tensors": [meta_row(m) for m in ms]}
                                for r, ms in enumerate(per_rank)]}
    return {"format": FORMAT, "version": VERSION if boxed else VERSION_PLAIN, "checkpoints": out}


def is_versioned(doc) -> bool:
    return isinstance(doc, dict) and "format" in doc


def to_legacy(doc: dict[str, Source]) -> dict[str, list[list[dict]]]:
    """The unversioned per-rank dicts that ``load_metas`` installs for broadcast updates."""
    return {name: [[_legacy(m) for m in ms] for ms in src.metas] for name, src in doc.items()}


def _legacy(m: TensorMeta) -> dict:
    d = m._asdict() | {"shape": list(m.shape)}
    box = d.pop("box")
    return d if box is None else d | {"box": [list(box[0]), list(box[1])]}


def save(path: str | os.PathLike, doc: dict) -> None:
    """Write a document atomically (a reader never sees half a file)."""
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def read(path: str | os.PathLike) -> dict:
    """Read a metas file; anything but our JSON is a ``ConfigError`` naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read metas file {os.fspath(path)!r}: {exc}") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        hint = " (it looks pickled: pickled metas are never read)" if raw[:1] == b"\x80" else ""
        raise ConfigError(f"metas file {os.fspath(path)!r} is not JSON{hint}: {exc}") from exc
    if not is_versioned(doc):
        raise ConfigError(f"metas file {os.fspath(path)!r} is not a ckpt-engine metas document "
                          f"(no 'format' field)")
    return doc


def parse_peer(p, where: str, version: int = VERSION) -> Peer | None:
    if p is None:
        return None
    if not isinstance(p, dict):
        raise ConfigError(f"metas: {where}.p2p must be an object or null")
    addr, host = p.get("address"), p.get("host")
    if not isinstance(addr, str) or ":" not in addr or not isinstance(host, str) or not host:
        raise ConfigError(f"metas: {where}.p2p needs 'address' ('host:port') and 'host', got {addr!r}, {host!r}")
    check_count(int(addr.rsplit(":", 1)[1]) if addr.rsplit(":", 1)[1].isdigit() else -1, f"{where}.p2p port", 1)
    nic = p.get("nic")
    if nic is not None and not isinstance(nic, str):
        raise ConfigError(f"metas: {where}.p2p.nic must be a string or null")
    regions = p.get("regions")
    if not isinstance(regions, dict):
        raise ConfigError(f"metas: {where}.p2p.regions must be an object")
    out = {}
    for k, v in regions.items():
        if not (isinstance(k, str) and k.isdigit()) or not isinstance(v, list) or len(v) != 2:
            raise ConfigError(f"metas: {where}.p2p.regions[{k!r}] must map a region id to [pointer, nbytes]")
        out[int(k)] = (check_count(v[0], f"{where} region {k} pointer", 1),
                       check_count(v[1], f"{where} region {k} size"))
    stamp = p.get("stamp")
    if stamp is not None:
        if not (isinstance(stamp, list) and len(stamp) == 2 and isinstance(stamp[1], str)
                and len(stamp[1]) == 2 * STAMP_BYTES and all(c in "0123456789abcdef" for c in stamp[1])):
            raise ConfigError(f"metas: {where}.p2p.stamp must be [pointer, {2 * STAMP_BYTES} hex digits]")
        stamp = (check_count(stamp[0], f"{where} stamp pointer", 1), stamp[1])
    slices = p.get("slices")
    if slices is not None and version < VERSION:
        raise ConfigError(f"metas: {where}.p2p.slices needs a version {VERSION} document "
                          f"(this one is version {version})")
    return Peer(addr, host, nic, out, stamp, _digests(p.get("digests"), where), _box_digests(slices, where))


def _hex(v, n: int) -> bool:
    return isinstance(v, str) and len(v) == 2 * n and all(c in "0123456789abcdef" for c in v)


def _digests(d, where: str) -> dict[str, str] | None:
    """The owner's tensor digests (p2p/digests.py: 16 bytes each), or None where it published none."""
    if d is None:
        return None
    if not isinstance(d, dict) or not all(isinstance(k, str) and _hex(v, 16) for k, v in d.items()):
        raise ConfigError(f"metas: {where}.p2p.digests must map tensor names to 32 hex digits")
    return dict(d)


def _box_key(key) -> tuple[tuple[int, int, int], ...] | None:
    """A box key (``p2p/slices.box_key``: JSON ``[[dim, start, length], ...]``) as a box, or None if malformed."""
    try:
        box = json.loads(key)
    except ValueError:
        return None
    ok = isinstance(box, list) and box and all(
        isinstance(x, list) and len(x) == 3 and all(type(v) is int and v >= 0 for v in x) and x[2] > 0 for x in box)
    return tuple(tuple(x) for x in box) if ok else None


def _box_digests(d, where: str) -> dict[str, dict[str, dict[str, str]]] | None:
    """The owner's box digests per slice plan (their boxes are checked against its tensors in ``_check_boxes``)."""
    if d is None:
        return None
    bad = f"metas: {where}.p2p.slices must map slice plan digests (40 hex) to {{tensor: {{box key: 32 hex digits}}}}"
    if not isinstance(d, dict) or not d:
        raise ConfigError(bad)
    for plan, per_tensor in d.items():
        if not _hex(plan, PLAN_DIGEST_BYTES) or not isinstance(per_tensor, dict):
            raise ConfigError(f"{bad}: plan {plan!r}")
        for name, boxes in per_tensor.items():
            if not isinstance(name, str) or not isinstance(boxes, dict) or not boxes:
                raise ConfigError(f"{bad}: plan {plan[:12]} tensor {name!r}")
            for key, digest in boxes.items():
                if not isinstance(key, str) or _box_key(key) is None or not _hex(digest, 16):
                    raise ConfigError(f"{bad}: plan {plan[:12]} tensor {name!r} box {key!r}")
    return {k: {n: dict(b) for n, b in v.items()} for k, v in d.items()}


def _check_boxes(peer: Peer | None, metas: list[TensorMeta], where: str) -> None:
    """Every published box is of a tensor this owner lists whole and lies inside it."""
    shapes = {m.name: m.shape for m in metas if m.box is None}
    for plan, per_tensor in ((peer and peer.slices) or {}).items():
        for name, boxes in per_tensor.items():
            if name not in shapes:
                raise ConfigError(f"metas: {where}.p2p.slices of plan {plan[:12]} name tensor {name!r}, which this "
                                  "owner does not list (whole)")
            for key in boxes:
                box = _box_key(key)   # checked when the document was read: never None here
                shape = shapes[name]
                if box is None or any(d >= len(shape) or s + n > shape[d] for d, s, n in box):
                    raise ConfigError(f"metas: {where}.p2p.slices of plan {plan[:12]}: box {key} lies outside "
                                      f"tensor {name!r} of shape {list(shape)}")


def _tensor(t, where: str, peer: Peer | None) -> TensorMeta:
    """A tensor row, validated as every path validates metas (``prechecks.tensor_meta``), and inside
    a region its owner registered. A 0-byte tensor is read from nowhere: it needs no region (an
    owner serves no region of 0 bytes)."""
    if not isinstance(t, list) or len(t) not in (7, 8):
        raise ConfigError(f"metas: {where} must be [name, dtype, shape, nbytes, itemsize, region, offset] "
                          "(+ [global shape, offsets] for a piece)")
    meta = tensor_meta(*t, where=where)
    if peer is not None and meta.nbytes:
        region = peer.regions.get(meta.base)
        end = meta.base_offset + meta.nbytes
        if region is None or end > region[1]:
            raise ConfigError(f"metas: tensor {meta.name!r} lies outside the region {meta.base} its owner "
                              f"registered ({peer.address}): bytes {meta.base_offset}..{end} of {region and region[1]}")
    return meta


def parse(doc) -> dict[str, Source]:
    """Validate a whole document (nothing is returned from a half-valid one)."""
    if not is_versioned(doc):
        raise ConfigError("metas are not a ckpt-engine metas document (no 'format' field)")
    if doc.get("format") != FORMAT:
        raise ConfigError(f"metas are in a foreign format {doc.get('format')!r}, expected {FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or version not in READS:   # JSON true and 1.0 compare equal to 1
        raise ConfigError(f"metas version {version!r} is not supported (this build reads "
                          f"{' and '.join(map(str, READS))})")
    cks = doc.get("checkpoints")
    if not isinstance(cks, dict):
        raise ConfigError("metas: 'checkpoints' must be an object")
    out = {}
    for name, ck in cks.items():
        owners = ck.get("owners") if isinstance(ck, dict) else None
        if not isinstance(owners, list) or not owners:
            raise ConfigError(f"metas: checkpoint {name!r} needs a non-empty 'owners' list")
        metas, peers, seen = [], [], set()
        for r, o in enumerate(owners):
            where = f"checkpoint {name!r} owner {r}"
            if not isinstance(o, dict) or o.get("rank") != r or not isinstance(o.get("tensors"), list):
                raise ConfigError(f"metas: {where} must be {{'rank': {r}, 'p2p': ..., 'tensors': [...]}}")
            peer = parse_peer(o.get("p2p"), where, version)
            ms = [_tensor(t, f"{where} tensor {i}", peer) for i, t in enumerate(o["tensors"])]
            _check_boxes(peer, ms, where)
            for m in (m for m in ms if m.box is None):   # pieces share their name by design
                if m.name in seen:
                    raise ConfigError(f"metas: tensor {m.name!r} of {name!r} is listed by two owners")
                seen.add(m.name)
            metas.append(ms)
            peers.append(peer)
        group_pieces(metas)   # pieces must tile their tensors (CheckpointFormatError), before anything installs
        out[name] = Source(metas, peers)
    return out
