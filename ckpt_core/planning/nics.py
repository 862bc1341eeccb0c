"""Pure planning for the P2P store: which NIC a rank uses, which target rank reads which bucket.

Plain data in, plain data out; no Mooncake, no torch, no I/O (the caller lists
``/sys/class/infiniband`` and passes the names). Every rank of a world runs the
same functions on the same inputs and so agrees without talking.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ckpt_core.errors import ConfigError

__all__ = ["HcaFilter", "parse_nccl_ib_hca", "select_rdma_devices", "nic_for_rank", "assign_readers",
           "is_loopback", "choose_p2p_host", "loopback_owners"]


@dataclass(frozen=True)
class HcaFilter:
    """NCCL_IB_HCA as NCCL reads it: a list of names, matched as prefixes unless ``exact``,
    selecting the devices that match (or, with ``exclude``, those that do not)."""
    names: tuple[str, ...]
    exclude: bool = False
    exact: bool = False

    def matches(self, device: str) -> bool:
        hit = any(device == n if self.exact else device.startswith(n) for n in self.names)
        return hit != self.exclude


def parse_nccl_ib_hca(text: str) -> HcaFilter | None:
    """Parse NCCL's ``NCCL_IB_HCA`` syntax; ``None`` when it selects nothing in particular.

    ``^`` first: exclude the listed devices; ``=`` first (after any ``^``): names are exact,
    otherwise prefixes (``mlx5`` matches ``mlx5_0``). ``:port`` suffixes are ignored
    (the P2P store uses a device's first active port). Empty entries are skipped.
    """
    spec = (text or "").strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    names = []
    for entry in spec.split(","):
        name = entry.strip().split(":", 1)[0].strip()
        if name:
            names.append(name)
    if not names:
        if exclude or exact:
            raise ConfigError(f"NCCL_IB_HCA={text!r} names no device")
        return None
    return HcaFilter(tuple(names), exclude, exact)


def select_rdma_devices(available: list[str], *, ps_devices: str = "", nccl_ib_hca: str = "") -> list[str]:
    """The RDMA NICs the P2P store may use, in a stable order; ``[]`` means TCP.

    Precedence: ``PS_P2P_STORE_RDMA_DEVICES`` (comma-separated exact names, each must
    exist), then ``NCCL_IB_HCA`` (NCCL's syntax), then every available device.
    """
    avail = sorted(set(available))
    wanted = [d.strip() for d in (ps_devices or "").split(",") if d.strip()]
    if wanted:
        missing = [d for d in wanted if d not in avail]
        if missing:
            raise ConfigError(f"PS_P2P_STORE_RDMA_DEVICES names {missing}, which this host does not have "
                              f"(RDMA devices here: {avail or 'none'})")
        return list(dict.fromkeys(wanted))
    hca = parse_nccl_ib_hca(nccl_ib_hca)
    if hca is None:
        return avail
    return [d for d in avail if hca.matches(d)]


def nic_for_rank(local_rank: int, devices: list[str]) -> str | None:
    """The NIC of the rank with this local rank: ranks of one host take distinct NICs while
    there are enough, so concurrent reads leave and arrive through different NICs. ``None``: TCP."""
    if not devices:
        return None
    if local_rank < 0:
        raise ConfigError(f"local rank must be >= 0, got {local_rank}")
    return devices[local_rank % len(devices)]


def assign_readers(buckets: list[tuple[int, int]], targets: list[int]) -> list[int]:
    """Which target rank reads each bucket ``(owner, nbytes)`` from its owner.

    Balances bytes over the targets (greedy: least loaded first; ties go round-robin), so
    that consecutive buckets, whose reads overlap in the pipeline, go to distinct readers;
    the plan already alternates owners from bucket to bucket, so overlapping reads also
    leave from distinct owners (and, through ``nic_for_rank``, distinct NICs on both sides).
    Deterministic: the same inputs give the same list on every rank.
    """
    if not targets:
        raise ConfigError("a P2P update needs at least one target rank")
    if len(set(targets)) != len(targets):
        raise ConfigError(f"P2P target ranks repeat: {targets}")
    load = {t: 0 for t in targets}
    out = []
    start = 0
    for _owner, nbytes in buckets:
        order = targets[start:] + targets[:start]   # rotate, so equal loads go round-robin
        best = min(order, key=lambda t: load[t])
        out.append(best)
        load[best] += max(int(nbytes), 1)
        start = (targets.index(best) + 1) % len(targets)
    return out


def is_loopback(host: str) -> bool:
    """``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``: other hosts cannot reach it."""
    h = (host or "").strip().strip("[]")
    if h.lower() == "localhost" or h.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def choose_p2p_host(explicit: str, to_master: str | None, outward: str | None) -> str:
    """The address a P2P store publishes: ``PS_P2P_HOST`` when set; else the local address on the
    route to MASTER_ADDR, unless that is loopback (a ``torchrun --standalone`` world has
    MASTER_ADDR=localhost), then the outward interface's (the route to the default gateway, as the
    reference's ``get_ip()``); loopback only when the host has nothing else."""
    if explicit:
        return explicit
    for candidate in (to_master, outward):
        if candidate and not is_loopback(candidate) and candidate not in ("0.0.0.0", "::"):
            return candidate
    return to_master or "127.0.0.1"


def loopback_owners(doc: dict) -> list[tuple[str, int, str]]:
    """``(checkpoint, owner rank, address)`` of every owner in a metas document whose P2P store
    publishes a loopback address (a joiner on another host would read from its own loopback)."""
    out = []
    for name, ck in sorted((doc.get("checkpoints") or {}).items()):
        for o in ck.get("owners") or ():
            p2p = o.get("p2p")
            if p2p and is_loopback(p2p.get("host", "")):
                out.append((name, o.get("rank"), p2p.get("address")))
    return out
