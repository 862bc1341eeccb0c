"""Tensor digests of a served checkpoint: what the transport cannot guarantee, checked by the reader.

Mooncake registers memory readable *and writable* by any peer that reaches its ports (no
read-only registration, no peer authentication; docs/p2p.md). So an owner that serves P2P takes
a digest of every tensor when it registers the checkpoint (SHA-256 cut to 16 bytes: with SHA-NI
2-3x faster than BLAKE2b on our hosts), publishes them in
its metas, and a reader checks every tensor of a bucket it read before any engine is told to
load that bucket: bytes rewritten in the owner's memory after registration (a foreign peer, a
bug) fail the update instead of reaching an engine. Buckets hold whole tensors (the planner
never splits one), so a bucket can be checked on its own.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from ckpt_core._settings import fault_threads

DIGEST_BYTES = 16


def digest_of(view) -> str:
    """The digest of a CPU uint8 tensor's bytes (hashlib reads them in place, without the GIL)."""
    return hashlib.sha256(memoryview(view.numpy())).digest()[:DIGEST_BYTES].hex()


def tensor_digests(ckpt) -> dict[str, str]:
    """Every tensor of a registered checkpoint: name -> digest of its bytes in host memory."""
    def one(meta):
        region = ckpt.regions[meta.base].tensor
        return meta.name, digest_of(region[meta.base_offset: meta.base_offset + meta.nbytes])
    metas = list(ckpt.metas)
    if len(metas) < 2:
        return dict(map(one, metas))
    with ThreadPoolExecutor(min(fault_threads(), len(metas)), thread_name_prefix="ckpt-digest") as pool:
        return dict(pool.map(one, metas))


def bucket_mismatch(placements, slot, digests: dict[str, str] | None) -> str | None:
    """Why the tensors of a bucket just read into ``slot`` (its staging bytes) must not be loaded,
    or None when every one matches the digest its owner published."""
    if digests is None:
        return ("its owner published no tensor digests (metas of an older ckpt-engine?), so the bytes "
                "cannot be checked")
    end = max((p.offset + p.meta.nbytes for p in placements), default=0)
    host = slot[:end] if slot.device.type == "cpu" else slot[:end].cpu()   # device slots: one copy per bucket
    for p in placements:
        want = digests.get(p.meta.name)
        got = digest_of(host[p.offset: p.offset + p.meta.nbytes])
        if want != got:
            return (f"tensor {p.meta.name!r} does not match the digest its owner took at registration "
                    "(its memory was written after registration: a foreign Mooncake peer can write registered "
                    "memory, docs/p2p.md)" if want else f"its owner published no digest for tensor {p.meta.name!r}")
    return None
