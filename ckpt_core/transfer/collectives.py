"""Process-group lifecycle and the few collectives the PS needs.

The groups are created once per ParameterServer and reused by every update
(creating NCCL communicators per update is most of the reference's fixed
cost). Control traffic (metas, status) goes over a gloo group as raw bytes;
data goes over the device kind's backend.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ckpt_core._settings import Settings
from ckpt_core.errors import ConfigError, TransportError, UpdateTimeoutError
from ckpt_core.ops.sockets import listening_sockets
from ckpt_core.planning.nics import is_loopback


def store_bind_address(master_addr: str, world_size: int, local_world_size: int | None) -> str | None:
    """Where rank 0 binds the rendezvous store; None: every interface (other hosts must reach it).

    A world known to sit on one host binds one address: MASTER_ADDR a loopback literal or
    ``localhost`` (peers can only be local), one rank, or torchrun's LOCAL_WORLD_SIZE equal to the
    world size. It binds the address MASTER_ADDR resolves to here, which is what its peers connect to
    (on one host they resolve it alike). A hostname that resolves to loopback here but not elsewhere
    (Debian's 127.0.1.1) does not count as one host.
    """
    literal = master_addr.strip().strip("[]")
    if not (is_loopback(literal) and not _is_name(literal) or literal.lower() == "localhost"
            or world_size == 1 or local_world_size == world_size):
        return None
    try:
        infos = socket.getaddrinfo(literal, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None   # unresolvable: TCPStore reports it, naming MASTER_ADDR
    return infos[0][4][0] if infos else None


def _is_name(host: str) -> bool:
    import ipaddress
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return True


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port`` for the TCPStore to serve on (``master_listen_fd``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


class _Store:
    """The rendezvous store behind one seam: its failures (rank 0, which serves it, died or
    hung) become a :class:`TransportError` naming the operation, not a raw DistNetworkError."""

    def __init__(self, raw, rank: int):
        self.raw, self.rank = raw, rank

    def set(self, key: str, value) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def wait(self, keys: list[str], *timeout) -> None:
        self._call("wait", keys, *timeout)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def _call(self, op: str, *args):
        try:
            return getattr(self.raw, op)(*args)
        except (RuntimeError, OSError) as exc:   # DistNetworkError / DistStoreError are RuntimeErrors
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            kind = UpdateTimeoutError if "imeout" in text or "imed out" in text else TransportError
            raise groups_broken(kind(f"rank {self.rank}: store.{op}({args[0]!r}) failed; rank 0 serves the "
                                     f"store: did it die? ({text})")) from exc


# How the NCCL process groups we create react to a collective that times out (a peer rank died):
# abort the communicators but keep the process (the default tears the whole process down, and
# with it a trainer that hosts the PS), and skip the debug dump that holds the abort for ~60 s.
# Values the user set win.
NCCL_ERROR_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
ABORT_WAIT_S = 1.0     # how long abort() waits for the collective library; it carries on in the background
CLOSE_WAIT_S = 30.0    # the same for close(): freeing communicators normally takes well under a second
log = logging.getLogger("ckpt_core")
STORE_CLOSE_WAIT_S = 5.0   # close(): how long rank 0 waits for the store it served to stop listening


def nccl_error_defaults() -> None:
    for key, value in NCCL_ERROR_ENV.items():
        os.environ.setdefault(key, value)


def groups_broken(exc: Exception) -> Exception:
    """Mark an error after which the process groups cannot be used again."""
    exc.groups_broken = True  # type: ignore[attr-defined]  # a mark read with getattr(exc, ..., False)
    return exc


class Collectives:
    """Owns (or borrows) the process groups; ``close()`` is idempotent."""

    def __init__(self, settings: Settings, data_backend: str, *, auto_pg: bool):
        self.rank, self.world_size = settings.rank, settings.world_size
        if data_backend == "nccl":
            nccl_error_defaults()
        self.timeout = timedelta(seconds=settings.collective_timeout_s)
        self._owns_default = False
        self.store = None
        self._listen_sock: socket.socket | None = None   # rank 0, one host: the store's socket (we bound it)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise ConfigError(f"the existing process group is rank {dist.get_rank()}/{dist.get_world_size()}, "
                                  f"but the ParameterServer was given rank {self.rank}/{self.world_size}")
        elif auto_pg:
            self._init_default(settings, data_backend)
        else:
            raise ConfigError("no torch.distributed process group exists and auto_pg=False: "
                              "call torch.distributed.init_process_group first or pass auto_pg=True")
        self.store = _Store(self.store or dist.distributed_c10d._get_default_store(), self.rank)
        default_backend = dist.get_backend()
        self.ctrl_group = self.data_group = None   # None: the default group
        self.data_backend = data_backend
        self._subgroups: list = []   # made by new_group() (e.g. P2P target groups); freed with ours
        self._groups_of: dict[tuple[int, ...], object] = {}   # group(): one per set of ranks, kept
        self._closed = False
        try:
            if default_backend != "gloo":
                self.ctrl_group = dist.new_group(backend="gloo", timeout=self.timeout)
            if data_backend != default_backend:
                self.data_group = dist.new_group(backend=data_backend, timeout=self.timeout)
        except BaseException:
            self.close()
            raise
        self.abort_finished: bool | None = None   # set by abort()

    def _init_default(self, s: Settings, backend: str) -> None:
        try:
            # Under torchrun the elastic agent already serves the store on MASTER_PORT.
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            master = s.rank == 0 and not agent_store
            local = os.environ.get("LOCAL_WORLD_SIZE")
            bind = store_bind_address(s.master_addr, s.world_size, int(local) if local and local.isdigit() else None)
            fd = None
            if master and bind is not None:   # one host: the store listens there only (else on every interface)
                self._listen_sock = _listen(bind, s.master_port)
                fd = self._listen_sock.fileno()
            self.store = dist.TCPStore(s.master_addr, s.master_port, s.world_size, is_master=master,
                                       timeout=self.timeout, wait_for_workers=False, master_listen_fd=fd)
            self._served_port = s.master_port if master else None
            if self._listen_sock is not None:   # the store owns the fd now and closes it when destroyed
                self._listen_sock.detach()
                self._listen_sock = None
        except (RuntimeError, OSError) as exc:
            if self._listen_sock is not None:
                self._listen_sock.close()
                self._listen_sock = None
            raise TransportError(f"rank {s.rank}: cannot reach the rendezvous store at "
                                 f"{s.master_addr}:{s.master_port}: {exc}") from exc
        dist.init_process_group(backend, store=self.store, rank=s.rank, world_size=s.world_size,
                                timeout=self.timeout)
        self._owns_default = True

    # -- control plane -------------------------------------------------------
    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, over the gloo control group."""
        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._call(dist.all_gather, sizes, n, group=self.ctrl_group)
        longest = max(int(t.item()) for t in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        self._call(dist.all_gather, outs, mine, group=self.ctrl_group)
        return [bytes(o[: int(s.item())].numpy()) for o, s in zip(outs, sizes)]

    def all_gather_json(self, obj) -> list:
        return [json.loads(b) for b in self.all_gather_bytes(json.dumps(obj).encode())]

    def barrier(self) -> None:
        self._call(dist.barrier, group=self.ctrl_group)

    # -- data plane ----------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int, *, async_op: bool, group=None):
        """``src`` is a global rank; ``group`` (default: the data group) e.g. a P2P update's target group."""
        if self._closed:   # never fall back to the caller's default group
            raise TransportError("the process groups of this ParameterServer are closed")
        group = self.data_group if group is None else group
        if dist.get_world_size(group) == 1:
            # The only member is the source: the bytes are already in place. Skipping the call also
            # spares a one-rank world the collective library's communicator setup (NCCL: ~0.3 s on
            # the first update).
            return None
        return self._data_op(f"broadcast of {tensor.numel()} bytes from rank {src}",
                             lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op))

    def send(self, tensor: torch.Tensor, dst: int, *, async_op: bool):
        """Point to point over the data group (a bucket of slices for one engine rank)."""
        if self._closed:
            raise TransportError("the process groups of this ParameterServer are closed")
        fn = dist.isend if async_op else dist.send
        return self._data_op(f"send of {tensor.numel()} bytes to rank {dst}",
                             lambda: fn(tensor, dst=dst, group=self.data_group))

    def recv(self, tensor: torch.Tensor, src: int, *, async_op: bool):
        if self._closed:
            raise TransportError("the process groups of this ParameterServer are closed")
        fn = dist.irecv if async_op else dist.recv
        return self._data_op(f"receive of {tensor.numel()} bytes from rank {src}",
                             lambda: fn(tensor, src=src, group=self.data_group))

    def _data_op(self, what: str, call):
        try:
            work = call()
        except Exception as exc:  # collective libraries raise RuntimeError/DistBackendError
            text = str(exc)
            if "imed out" in text or "imeout" in text:
                raise groups_broken(UpdateTimeoutError(
                    f"rank {self.rank}: {what} timed out after {self.timeout.total_seconds():g} s "
                    f"(PS_COLLECTIVE_TIMEOUT_S): a peer rank died or is stuck: {text}")) from exc
            raise groups_broken(TransportError(f"rank {self.rank}: {what} failed (a peer rank died?): "
                                               f"{text}")) from exc
        return None if isinstance(work, int) else work

    def new_group(self, ranks: list[int]):
        """A data-backend group of ``ranks`` (global ranks); a collective of the whole world.

        Owned here like the control and data groups: ``close()`` and ``abort()`` free it, also
        when the caller owns the default group. Ranks outside ``ranks`` get torch's non-member.
        """
        group = self._call(dist.new_group, ranks=list(ranks), backend=self.data_backend, timeout=self.timeout)
        self._subgroups.append(group)
        return group

    def group(self, ranks) -> object:
        """The data-backend group of exactly ``ranks`` (ascending global ranks), made by
        :meth:`new_group` the first time it is asked for and kept (freed with the others by
        ``close()``/``abort()``). The first call is a collective of the whole world: every rank
        must ask for the same groups in the same order (e.g. the slices' replica groups, in the
        order a plan first uses them)."""
        key = tuple(ranks)
        if key not in self._groups_of:
            self._groups_of[key] = self.new_group(list(key))
        return self._groups_of[key]

    def _call(self, fn, *args, **kwargs):
        if self._closed:
            raise TransportError("the process groups of this ParameterServer are closed")
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            text = str(exc)
            kind = UpdateTimeoutError if "imeout" in text or "imed out" in text else TransportError
            raise groups_broken(kind(f"rank {self.rank}: {fn.__name__} on the control group failed "
                                     f"(a peer rank died or is stuck?): {text}")) from exc

    def abort(self) -> None:
        """Give up on groups that a failed or stuck collective left behind; idempotent.

        Aborting (rather than destroying) does not wait for the collectives in flight,
        which may never finish when a peer died.
        """
        self._release(graceful=False, wait_s=ABORT_WAIT_S)

    def close(self) -> None:
        """Free every group we created: the default group (and all with it) if ours, else our
        own sub-groups, so that a trainer's default group never accumulates them. Local: never
        waits for the peers.

        A collective library's graceful destroy (NCCL's finalize) is itself a collective: it
        blocks until every peer destroys too, so one rank closing while the others keep their
        ParameterServer (close() during an update, a service stopping rank by rank) would hang.
        Those groups are aborted instead; nothing of ours is in flight when close() runs (an
        update synchronizes its device before it returns). Gloo groups are destroyed.
        """
        self._release(graceful=self.data_backend == "gloo", wait_s=CLOSE_WAIT_S)

    def _own_groups(self) -> list:
        """The groups this object created inside a default group it does not own."""
        return [g for g in (*self._subgroups, self.ctrl_group, self.data_group) if g is not None]

    def _release(self, *, graceful: bool, wait_s: float) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        # The rendezvous store (rank 0: its listening socket) goes with its last reference too: the
        # default group's is dropped by destroying the group, ours here. A borrowed store is the caller's.
        self.store = None
        if not dist.is_initialized():
            return
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is None:
            graceful = True
        # Ours only: the whole world if we created it, else the groups we added to the caller's.
        groups = [None] if self._owns_default else self._own_groups()
        self.ctrl_group = self.data_group = None   # a destroyed group's sockets go with its last reference
        self._subgroups = []
        self._groups_of = {}

        def run() -> None:
            for g in groups:
                try:
                    dist.destroy_process_group(g) if graceful or abort is None else abort(g)   # None: graceful
                except Exception:  # torn down by the backend's own error handling, or no abort in it
                    if not graceful:
                        try:   # a backend without abort (e.g. a device plugin's) is destroyed instead
                            dist.destroy_process_group(g)
                        except Exception:
                            pass

        # The collective library may itself block (on a stuck collective, or on a peer); the
        # caller must not wait for it longer than wait_s: it carries on in the background.
        t = threading.Thread(target=run, name="ckpt-release-groups", daemon=True)
        t.start()
        t.join(wait_s)
        self.abort_finished = not t.is_alive()
        if self.abort_finished:
            self._await_store_closed()

    def _await_store_closed(self, wait_s: float = STORE_CLOSE_WAIT_S) -> None:
        """Rank 0: the store we served stops listening with its last reference, but its server
        thread may take a moment (and a reference cycle needs the GC): so that close() leaves
        nothing listening, collect and wait a bounded time for its port, then say if it stayed."""
        port = getattr(self, "_served_port", None)
        if port is None:
            return
        gc.collect()
        deadline = time.monotonic() + wait_s
        while any(p == port for _, p in listening_sockets()):
            if time.monotonic() >= deadline:
                log.warning("rank %d: the rendezvous store still listens on port %d %.0f s after close()",
                            self.rank, port, wait_s)
                return
            time.sleep(0.02)
