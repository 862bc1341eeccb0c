"""The P2P store: one Mooncake TransferEngine per ParameterServer, behind one seam.

Owners register their host regions with it (readers then pull with one-sided
reads); readers register their staging buffer and read into it. Mooncake's
failures (a -1 return) become a ``TransportError`` naming the owner rank and
address. A read that failed or was abandoned may still land bytes afterwards:
its buffer is *unsettled* and is neither reused nor freed until the read call
returned and ``SETTLE_GRACE_S`` passed (``Quarantine``).

Exposure: Mooncake (0.3.x) listens on two ports on *every* interface (it binds 0.0.0.0 and [::]
whatever address it is given) and lets any peer that reaches them read and write every
registered byte. So a store only registers checkpoints when serving was asked for
(``ParameterServer(serve_p2p=True)`` / ``PS_P2P_SERVE=1``), logs the ports it opened, and
``close()`` destroys the TransferEngine, which closes them.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from ckpt_core._settings import p2p_env
from ckpt_core.errors import ConfigError, TransportError, UpdateTimeoutError
from ckpt_core.ops.sockets import listening_sockets
from ckpt_core.p2p.metas import STAMP_BYTES, Peer
from ckpt_core.planning.nics import choose_p2p_host, nic_for_rank, select_rdma_devices

MAX_DESCRIPTORS = 1024      # Mooncake: keep one batch at or below this many descriptors
PIECE_BYTES = 64 << 20      # large runs are cut so that a batch spreads over Mooncake's slices
SETTLE_GRACE_S = 5.0        # after a failed read returned, slices may still land for this long
POLL_S = 0.01
STAMP_SLOTS = 256           # checkpoints one store can serve at once
STAMP_GONE = -2             # _read_batches: the owner's stamp changed (checkpoint unregistered or replaced)
EXTRA = "p2p"
MARK = "P2P read"           # every read failure's message starts with this


def torch_frombuffer(data: bytes):
    import torch
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def import_mooncake():
    """Mooncake's TransferEngine class, or a ConfigError that says what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise ConfigError(
            "P2P updates (ranks=[...]) need Mooncake's TransferEngine: install the 'p2p' extra "
            "(pip install 'ckpt-engine[p2p]', i.e. mooncake-transfer-engine; on hosts without CUDA "
            f"mooncake-transfer-engine-non-cuda, plus the libibverbs1 system package): {exc}") from exc
    return TransferEngine


_UNSETTLED: list = []   # engines closed while a read may still land: kept alive (and their ports open) until exit


def _route_source(addr: str, port: int) -> str | None:
    """The local address of the route to ``addr`` (no packet is sent: a UDP connect only picks the route)."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, port))
            return s.getsockname()[0]
    except OSError:
        return None


def store_host(explicit: str, master_addr: str, master_port: int) -> str:
    """The address this rank's store publishes (``planning.nics.choose_p2p_host``): PS_P2P_HOST, else
    the route to MASTER_ADDR, else (loopback) the outward interface, i.e. the route to a public address."""
    if explicit:
        return explicit
    return choose_p2p_host("", _route_source(master_addr, master_port), _route_source("8.8.8.8", 53))


def open_store(settings, backend, device_index: int, log, *, serving: bool) -> "P2PStore":
    """The store of a ParameterServer rank, from its settings and the P2P environment variables."""
    env = p2p_env()
    return P2PStore(store_host(env["host"], settings.master_addr, settings.master_port),
                    local_rank=device_index, ps_devices=env["ps_devices"], nccl_ib_hca=env["nccl_ib_hca"],
                    log=log, transport=getattr(backend, "p2p_transport", None), rdma=env["rdma"],
                    serving=serving)


def rdma_devices_here() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


class Quarantine:
    """Buffers that a failed or abandoned read may still write into; freed once settled."""

    def __init__(self):
        self._items: list[tuple[Future | None, float, Callable[[], None]]] = []
        self._lock = threading.Lock()

    def add(self, pending: Future | None, release: Callable[[], None]) -> None:
        with self._lock:
            self._items.append((pending, time.monotonic(), release))

    def __len__(self) -> int:
        return len(self._items)

    def reap(self, wait_s: float = 0.0) -> int:
        """Release what has settled (waiting up to ``wait_s``); returns how many are still unsettled."""
        end = time.monotonic() + wait_s
        while True:
            with self._lock:
                keep = []
                for pending, since, release in self._items:
                    if pending is not None and pending.done():
                        pending, since = None, max(since, time.monotonic())
                    if pending is None and time.monotonic() - since >= SETTLE_GRACE_S:
                        release()
                    else:
                        keep.append((pending, since, release))
                self._items = keep
            if not keep or time.monotonic() >= end:
                return len(keep)
            time.sleep(0.05)


class P2PStore:
    """A Mooncake TransferEngine publishing ``host``: RDMA through this rank's NIC when the host has
    one (see ``planning.nics``), TCP otherwise. ``serving``: it may register checkpoints for
    readers (a reader-only store registers its scratch and, during an update, its staging buffer).
    ``close()`` is idempotent and destroys the engine (its ports close)."""

    def __init__(self, host: str, *, local_rank: int, ps_devices: str, nccl_ib_hca: str, log,
                 transport: str | None = None, rdma: bool = True, serving: bool = False):
        engine_cls = import_mooncake()
        self.log, self.serving = log, serving
        if transport:   # the device backend names its own transport (NPU: "ascend_direct"); no NIC list
            self.nic, self.transport = None, transport
        else:   # a NIC named in PS_P2P_STORE_RDMA_DEVICES that this host lacks is a ConfigError, even with none
            devices = select_rdma_devices(rdma_devices_here(), ps_devices=ps_devices,
                                          nccl_ib_hca=nccl_ib_hca) if rdma else []
            self.nic = nic_for_rank(local_rank, devices)
            self.transport = "rdma" if self.nic else "tcp"
        before = set(listening_sockets())
        self.engine = engine_cls()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.transport, self.nic or "")
        if rc != 0:
            self.engine = None
            raise TransportError(f"Mooncake TransferEngine.initialize({host!r}, {self.transport}, "
                                 f"{self.nic or '-'}) failed ({rc})")
        self.ports = sorted(set(listening_sockets()) - before)   # what Mooncake opened (for the log)
        self.host = host
        self.address = f"{host}:{self.engine.get_rpc_port()}"
        self.registered: dict[int, int] = {}        # pointer -> nbytes
        self.quarantine = Quarantine()
        import torch  # stamps of served checkpoints, and where a reader fetches an owner's stamp into
        self._stamps = torch.zeros(STAMP_SLOTS * STAMP_BYTES, dtype=torch.uint8)
        self._scratch = torch.zeros(STAMP_BYTES, dtype=torch.uint8)
        self._free_slots = list(range(STAMP_SLOTS)) if serving else []
        if serving:
            self.register(self._stamps.data_ptr(), self._stamps.numel())
        self.register(self._scratch.data_ptr(), self._scratch.numel())
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="ckpt-p2p-read")
        self._closed = False
        log.info("P2P store at %s over %s%s (%s)", self.address, self.transport, f" ({self.nic})" if self.nic else "",
                 "serving checkpoints" if serving else "reading only")
        if serving:
            self.log_exposure()

    def log_exposure(self) -> None:
        """Say once, when serving starts, who can reach the served memory (Mooncake cannot fence it)."""
        ports = (", ".join(f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in self.ports)
                 or "two ports in MC_MIN_RPC_PORT..MC_MAX_RPC_PORT")
        self.log.warning("P2P serving is on: every checkpoint registered from now on can be READ AND WRITTEN by any "
                         "process that reaches this store's Mooncake ports (%s; Mooncake listens on every interface "
                         "and has no read-only registration or peer authentication, whatever PS_P2P_HOST=%s says). "
                         "Readers check per-tensor digests; fence the ports with the network or a firewall "
                         "(docs/p2p.md)", ports, self.host)

    # -- registration ----------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        if nbytes <= 0 or self.registered.get(ptr) == nbytes:
            return
        if ptr in self.registered:
            self.unregister(ptr)
        rc = self.engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransportError(f"Mooncake could not register {nbytes} bytes at {ptr:#x} ({rc})")
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        if self.registered.pop(ptr, None) is not None and self.engine is not None:
            rc = self.engine.unregister_memory(ptr)
            if rc != 0:
                self.log.warning("Mooncake could not unregister memory at %#x (%s)", ptr, rc)

    def stamp(self) -> tuple[int, tuple[int, str]]:
        """A fresh stamp for a checkpoint being served: (slot, (pointer, hex token))."""
        if not self.serving:
            raise ConfigError("this P2P store does not serve checkpoints (serve_p2p=False, PS_P2P_SERVE=0)")
        if not self._free_slots:
            raise TransportError(f"this P2P store already serves {STAMP_SLOTS} checkpoints")
        slot = self._free_slots.pop(0)
        token = os.urandom(STAMP_BYTES)
        view = self._stamps[slot * STAMP_BYTES: (slot + 1) * STAMP_BYTES]
        view.copy_(torch_frombuffer(token))
        return slot, (view.data_ptr(), token.hex())

    def clear_stamp(self, slot: int) -> None:
        """Before a served checkpoint's memory is unregistered: readers' next stamp check fails."""
        self._stamps[slot * STAMP_BYTES: (slot + 1) * STAMP_BYTES].zero_()
        self._free_slots.append(slot)

    def describe(self, regions: dict[int, tuple[int, int]], stamp: tuple[int, str] | None = None,
                 digests: dict[str, str] | None = None) -> Peer:
        """This store as readers see it, serving ``regions`` (id -> (pointer, nbytes)) whose tensors have
        ``digests`` (name -> digest, ``p2p.digests``)."""
        return Peer(self.address, self.host, self.nic, dict(regions), stamp, digests)

    # -- reading ---------------------------------------------------------------
    def read(self, peer: Peer, owner: int, descs: list[tuple[int, int, int]], *, what: str,
             deadline: float, should_stop: Callable[[], str | None]) -> Future | None:
        """Read ``(local_ptr, remote_ptr, nbytes)`` descriptors from ``peer`` (owner rank ``owner``).

        Runs on the store's reader thread, in batches of <= MAX_DESCRIPTORS, while this
        thread waits with the deadline. Returns ``None`` on success. On failure raises a
        ``TransportError`` (``UpdateTimeoutError`` past the deadline) whose ``pending``
        attribute is the read's future: the destination is unsettled until it is done.
        """
        pieces = [(lp + a, rp + a, min(PIECE_BYTES, n - a)) for lp, rp, n in descs for a in range(0, n, PIECE_BYTES)]
        batches = [pieces[i: i + MAX_DESCRIPTORS] for i in range(0, len(pieces), MAX_DESCRIPTORS)]
        fut = self._reader.submit(self._read_batches, peer.address, batches, peer.stamp)
        head = f"{MARK} of {what} from owner rank {owner} at {peer.address}"
        while True:
            try:
                rc = fut.result(timeout=POLL_S)
                break
            except TimeoutError:
                pass
            stop = should_stop()
            if stop or time.monotonic() > deadline:
                exc = (TransportError(f"{head} abandoned: {stop}") if stop else
                       UpdateTimeoutError(f"{head} did not finish within the update timeout "
                                          "(owner frozen or unreachable?)"))
                exc.pending = fut
                raise exc
        if rc == STAMP_GONE:
            exc = TransportError(f"{head} is void: the owner unregistered or replaced the checkpoint while "
                                 "it was being read (keep it registered until readers finish)")
            exc.pending = fut
            raise exc
        if rc != 0:
            exc = TransportError(f"{head} failed (Mooncake returned {rc}: the owner died, froze past "
                                 "MC_TRANSFER_TIMEOUT, or no longer registers that memory)")
            exc.pending = fut
            raise exc
        return None

    def _read_batches(self, address: str, batches, stamp) -> int:
        """Read, then (if the owner stamps its checkpoint) check that the stamp is still there:
        the owner clears it before unregistering, so the bytes read were the checkpoint's."""
        for batch in batches:
            lp, rp, n = zip(*batch)
            rc = self.engine.batch_transfer_sync_read(address, list(lp), list(rp), list(n))
            if rc != 0:
                return rc
        if stamp is not None:
            self._scratch.zero_()
            rc = self.engine.batch_transfer_sync_read(address, [self._scratch.data_ptr()], [stamp[0]], [STAMP_BYTES])
            if rc != 0:
                return rc
            if bytes(self._scratch.numpy()).hex() != stamp[1]:
                return STAMP_GONE
        return 0

    def close(self, settle_wait_s: float) -> None:
        """Release what settled (waiting up to ``settle_wait_s``), unregister everything, destroy the
        TransferEngine (its two listening ports close with it). An engine that a read may still
        write through is kept, with its buffers, until the process exits."""
        if self._closed:
            return
        self._closed = True
        left = self.quarantine.reap(settle_wait_s)
        self._reader.shutdown(wait=not left)
        for ptr in list(self.registered):
            self.unregister(ptr)
        if left:
            self.log.warning("%d staging buffer(s) still unsettled at close (a read in flight may land): they and "
                             "the Mooncake engine (ports %s) are kept until the process exits", left, self.ports)
            _UNSETTLED.append((self.engine, self.quarantine))
        self.engine = None   # the last reference: Mooncake's destructor closes its sockets
