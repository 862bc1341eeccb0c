"""The ParameterServer facade: register checkpoints, gather metas, update engines."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable

from ckpt_core._settings import load_settings
from ckpt_core.checkpoint.device import build_device_checkpoint
from ckpt_core.checkpoint.host import SharedPool
from ckpt_core.checkpoint.sources import build_checkpoint
from ckpt_core.delta.dispatch import Updates
from ckpt_core.delta.versions import DeltaVersions, refuse_mixed_sides
from ckpt_core.devices import default_kind, get_backend
from ckpt_core.errors import CheckpointNotFoundError, ClosedError, ConfigError, DeviceResidentError, TransportError
from ckpt_core.ops.gc import gc_paused
from ckpt_core.ops.log import rank_logger
from ckpt_core.p2p import metas as _metas
from ckpt_core.p2p.state import P2PState, check_reachable
from ckpt_core.transfer.broadcast import ReqFunc
from ckpt_core.transfer.collectives import ABORT_WAIT_S, Collectives
from ckpt_core.transfer.context import Catalog, UpdateContext, agree_device_keys
from ckpt_core.transfer.prechecks import parse_metas
from ckpt_core.transfer.share_plan import SharedPlans, share_plan
from ckpt_core.wire.stock import check_wire

CLOSE_GRACE_S = 5.0  # close(): how much longer than a collective a running update may take to stop
GiB = float(1 << 30)


def _check_on_device_call(files, use_shared_memory_pool: bool) -> None:
    """``register_checkpoint(on_device=True)``'s refusals of the other options (nothing is kept)."""
    asked = [k for k, v in (("files", files), ("use_shared_memory_pool", use_shared_memory_pool)) if v]
    if asked:
        raise DeviceResidentError(f"on_device=True registers named_tensors in place on this rank's device; "
                                  f"{', '.join(asked)} need(s) host memory: register those without on_device")


class _OnContext:
    """A public attribute of the facade that lives on its UpdateContext: one value, which the flows read."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, ps, owner=None):
        return self if ps is None else getattr(ps._ctx, self.name)

    def __set__(self, ps, value) -> None:
        setattr(ps._ctx, self.name, value)


class ParameterServer:
    """One parameter-server rank, beside one engine worker (one device).

    Example (run under ``torchrun --nproc-per-node N``)::

        ps = ParameterServer()                      # RANK/WORLD_SIZE/MASTER_* from the environment
        ps.register_checkpoint("step-7", files=my_share_of_files)
        ps.gather_metas("step-7")
        # req_func runs on every rank; here one engine of N devices, reached by rank 0 only
        ps.update("step-7", lambda handles: ps.rank == 0 and request_inference_to_update(url, dict(handles)))

    ``gpu_count`` (the reference's keyword): devices per host; when given, this rank's device index is
    ``rank % gpu_count`` instead of ``LOCAL_RANK``.

    ``serve_p2p`` (default ``PS_P2P_SERVE``, off): serve registered checkpoints to P2P readers (other ranks'
    ``update(..., ranks=[...])``, joining worlds). Mooncake then exposes their host memory, readable and
    writable, to whoever reaches its ports (docs/p2p.md); off, nothing is registered with Mooncake and no P2P
    port opens unless this rank itself reads P2P.

    A facade: it owns the collectives, the :class:`Catalog` (checkpoints, metas, plans), one
    :class:`UpdateContext` (``transfer/context.py``), the P2P state and the delta versions, and hands them to
    the update flows (``delta/dispatch.py``: broadcast, P2P, or a delta of either).
    """

    wire = _OnContext()                  # "stock"/"stock-0.3": engine workers run stock checkpoint-engine
    keep_device_buffers = _OnContext()   # keep the IPC buffer between updates
    last_update = _OnContext()           # the latest update's figures on this rank (None: none yet)

    def __init__(self, rank: int | None = None, world_size: int | None = None, *, device: str | None = None,
                 auto_pg: bool = True, mem_fraction: float | None = None, master_addr: str | None = None,
                 master_port: int | None = None, max_bucket_gb: float | None = None,
                 keep_device_buffers: bool = False, gpu_count: int | None = None,
                 wire: str = "native", serve_p2p: bool | None = None):
        self.settings = load_settings(rank=rank, world_size=world_size, master_addr=master_addr,
                                      master_port=master_port, mem_fraction=mem_fraction, max_bucket_gb=max_bucket_gb,
                                      serve_p2p=serve_p2p)
        self.rank, self.world_size = self.settings.rank, self.settings.world_size
        self.backend = get_backend(device or default_kind())
        if not self.backend.is_available():
            raise ConfigError(f"device kind {self.backend.kind!r} is not available on this machine")
        if gpu_count is not None and (not isinstance(gpu_count, int) or gpu_count < 1):
            raise ConfigError(f"gpu_count must be a positive int, got {gpu_count!r}")
        self.device_index = self.settings.local_rank if gpu_count is None else self.rank % gpu_count
        self.backend.set_device(self.device_index)
        self.device_uuid = self.backend.device_key(self.device_index)
        wire = check_wire(wire)
        self._log = rank_logger(f"ps rank {self.rank}/{self.world_size} {self.backend.kind}:{self.device_index}")
        self._coll = Collectives(self.settings, self.backend.collective_backend, auto_pg=auto_pg)
        self._catalog = Catalog()   # registered checkpoints, gathered or loaded metas, plans per layout
        ctx = None
        try:
            device_keys, run_id = agree_device_keys(self._coll, self.device_uuid)
            ctx = UpdateContext(settings=self.settings, backend=self.backend, device_index=self.device_index,
                                device_key=self.device_uuid, device_keys=device_keys, run_id=run_id,
                                coll=self._coll, wire=wire, keep_device_buffers=keep_device_buffers,
                                log=self._log, tell=self._tell)
            # Mooncake store (serving: now; reading: when first needed), target groups
            self._p2p = P2PState(ctx, self._catalog)
            if self.settings.serve_p2p:   # asked for: a store that cannot start is this constructor's error
                self._p2p.ensure_store(required=True)
        except BaseException:
            if ctx is not None:
                ctx.close()
            self._coll.close()   # a constructor that fails leaves no process group behind
            raise
        self._ctx = ctx
        self.deltas = DeltaVersions(self.rank, self.world_size)   # versions registered with a base (docs/deltas.md)
        self._flows = Updates(ctx, self._catalog, self._p2p, self.deltas)   # which transfer an update becomes
        self._shared_plans = SharedPlans()   # slice plans shared before: the next share sends a digest only
        self._pool: SharedPool | None = None
        self._update_lock = threading.Lock()
        self._closed = False
        self._broken: str | None = None
        self.last_register: dict | None = None   # the latest registration's phases (seconds)
        # Optional progress(operation, phase, done, total): the service's status, progress bars. Called on the
        # thread doing the work; whatever it raises is logged, never propagated.
        self.progress: Callable[[str, str, int | None, int | None], None] | None = None
        self._log.info("ready: device key %s, %s collectives", self.device_uuid, self.backend.collective_backend)

    # -- lifecycle -------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this ParameterServer is closed")
        if self._broken:
            raise TransportError(f"this ParameterServer's process groups broke in an earlier update "
                                 f"({self._broken}); close it and create a new one")

    def close(self) -> None:
        """Free host memory, device buffers, sockets and the process groups it created. Idempotent.

        An update running in another thread is stopped first (every rank's ``update`` raises ``RemoteWorkerError``
        naming this rank; the engine workers abort) and nothing is freed under it. close() waits for it up to
        ``PS_COLLECTIVE_TIMEOUT_S`` + a grace; if it still runs, the process groups are aborted and the memory is
        left to the process's exit."""
        if self._closed:
            return
        self._closed = True
        self._ctx.stop(f"close() was called on rank {self.rank} during the update")   # tells every rank at once
        wait = self.settings.collective_timeout_s + CLOSE_GRACE_S
        if not self._update_lock.acquire(timeout=wait):
            self._coll.abort()
            if not self._update_lock.acquire(timeout=CLOSE_GRACE_S):
                self._log.warning("close(): an update still runs after %.0f s; its memory is not freed", wait)
                return
        try:
            self._free()
        finally:
            self._update_lock.release()

    def _free(self) -> None:
        self._p2p.close()   # first: waits (bounded) for unsettled P2P reads before their buffers go
        self._catalog.release()
        if self._pool is not None:
            self._pool.close()
        self._ctx.close()   # the IPC buffer, the ZeroMQ context
        self._coll.close()

    def init_process_group(self, *, timeout=None) -> None:
        """The reference's explicit call. Here the process groups exist from construction on and
        live as long as this ParameterServer, so it only checks that this one is usable."""
        self._check_open()

    def store_based_barrier(self, timeout=None) -> None:
        """Collective: wait until every rank got here (the reference's name; the wait is bounded
        by PS_COLLECTIVE_TIMEOUT_S, not by ``timeout``)."""
        self._check_open()
        self._coll.barrier()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- checkpoints -----------------------------------------------------------
    def register_checkpoint(self, checkpoint_name: str, *, files=None, named_tensors=None,
                            use_shared_memory_pool: bool = False, use_inplace_pin_memory: bool = True,
                            unlink_inplace_files: bool = False, base: str | None = None,
                            on_device: bool = False, on_device_digest: bool = True) -> None:
        """Load this rank's share of checkpoint ``checkpoint_name`` into host memory (local; no collective).

        ``files``: safetensors paths (validated before anything is read); files under /dev/shm are mapped and
        pinned in place when ``use_inplace_pin_memory`` (and deleted only if ``unlink_inplace_files``).
        ``named_tensors``: name -> tensor, copied. ``use_shared_memory_pool``: copy into one reusable pinned pool
        (RL loops; a version registered with a ``base`` that holds the pool takes a second region beside it, and
        the versions of a chain alternate between the two). ``base``: a checkpoint registered earlier on this
        rank that this one is the next version of: its delta is encoded too, for ``update(name, ..., delta=True)``
        (docs/deltas.md).

        ``on_device``: keep ``named_tensors`` where they lie instead, on this rank's own device (a trainer's
        weights beside the engine): no host copy, no pinning, no pool; each update copies them device-to-device
        into the IPC buffer (``checkpoint/device.py``). The update reads them in place: what the caller writes
        into them before an update is what it sends, and the caller must not modify them until that update()
        returns (their producing work must be ordered before update() on the calling thread's current stream,
        or synchronized). Each tensor (a piece's local view) must lie on this rank's device and be contiguous,
        and ``files`` and ``use_shared_memory_pool`` are refused (``DeviceResidentError``, nothing kept); such a
        checkpoint is never served to P2P readers, and P2P updates of it are refused on every rank. With
        ``base`` (a version registered ``on_device`` too: the trainer's previous weights, kept on its device),
        the delta is encoded on the device and its payloads stay there; they are of the tensors' bytes at
        registration, so register each version as its own copy: a base whose bytes changed since its
        registration is refused, as are a version and its base on different sides (device and host)
        (``DeviceResidentError``). ``on_device_digest`` (default True): record a ``lin64`` of each tensor
        at registration, on the device (one read of the version), which that check needs; False skips it
        (a version registered so cannot be a delta's base: a trainer that only sends full updates).
        """
        self._check_open()
        name = checkpoint_name   # the reference's spelling outside, a short one inside
        if not isinstance(name, str) or not name:
            raise ConfigError(f"checkpoint name must be a non-empty string, got {name!r}")
        if name in self._catalog.checkpoints:
            raise ConfigError(f"checkpoint {name!r} is already registered on rank {self.rank}; unregister it first")
        base_ckpt = self._catalog.checkpoints.get(base) if base is not None else None
        if base_ckpt is not None:   # a delta compares both versions where they lie (delta/versions.py): same side
            refuse_mixed_sides(name, bool(on_device), str(base), base_ckpt.on_device, self.rank)
        pool = None
        if use_shared_memory_pool and not on_device:
            self._pool = self._pool or SharedPool(self.backend)
            pool = self._pool
        t0 = time.perf_counter()
        self._tell("register", "validate")
        with gc_paused():
            if on_device:
                _check_on_device_call(files, use_shared_memory_pool)
                ckpt = build_device_checkpoint(name, self.backend, self.device_index, named_tensors)
            else:
                ckpt = build_checkpoint(name, self.backend, files=files, named_tensors=named_tensors,
                                        pool=pool, pool_beside=base, inplace=use_inplace_pin_memory,
                                        unlink_inplace_files=unlink_inplace_files,
                                        progress=lambda phase, done, total: self._tell("register", phase, done, total))
        # and its delta against base; served to P2P readers (serve_p2p only)
        self._flows.add(name, ckpt, base, snapshot=bool(on_device and on_device_digest))
        dt = time.perf_counter() - t0
        self.last_register = {"name": name, "bytes": ckpt.nbytes, "seconds": dict(ckpt.seconds, total=dt),
                              "on_device": ckpt.on_device}
        self._tell("register", "done", ckpt.nbytes, ckpt.nbytes)
        self._log.info("registered %r: %d tensors, %.3f GiB in %.3f s (%.2f GB/s; %s)", name, len(ckpt.metas),
                       ckpt.nbytes / GiB, dt, ckpt.nbytes / max(dt, 1e-9) / 1e9,
                       ", ".join(f"{k} {v:.3f} s" for k, v in ckpt.seconds.items() if v >= 0.0005))

    def fold_delta(self, checkpoint_name: str, *, base: str) -> dict:
        """Register this rank's delta of version ``checkpoint_name`` from an older version ``base`` (local; no
        collective, like ``register_checkpoint``): the chain of deltas folded into one, for engines that hold
        ``base`` (``delta/fold.py``). Encoded against ``base`` when it is still registered here, else from the
        registered deltas that lead from ``base`` to ``checkpoint_name`` (their payloads' union, with its values).
        Registered as the companion ``<name>@delta:<base>``; ``gather_metas(name)`` carries it for joining worlds
        when every rank folded it, and ``update(name, ..., delta=True)`` moves it to engines that hold ``base``.
        Unregistering the version removes its folds. Nothing to do when ``name`` was registered with that base or
        the fold exists. Returns this rank's figures (bytes, encodings, seconds). ``DeltaBaseError`` when no
        registered version or chain leads from ``base``; nothing is kept then (docs/deltas.md)."""
        self._check_open()
        with gc_paused():
            fig = self._flows.fold(checkpoint_name, base)
        self._log.info("folded the deltas of %r from %r: %s bytes of payload", checkpoint_name, base,
                       fig.get("payload_bytes"))
        return fig

    def unregister_checkpoint(self, checkpoint_name: str, force: bool = False) -> None:
        """Free checkpoint ``checkpoint_name``. With ``force``, also free the shared pool's memory if it
        held it (positional, as in the reference: ``unregister_checkpoint("a", True)``); a pool region that
        another version holds (a delta chain's, ``SharedPool``) stays."""
        self._check_open()
        if checkpoint_name not in self._catalog.checkpoints:
            raise CheckpointNotFoundError(f"checkpoint {checkpoint_name!r} is not registered on rank {self.rank}")
        if not self._update_lock.acquire(blocking=False):   # held while we free: no update can start
            raise ConfigError(f"cannot unregister {checkpoint_name!r} while an update is running")
        try:
            self._unregister(checkpoint_name, force)
        finally:
            self._update_lock.release()

    def _unregister(self, name: str, force: bool) -> None:
        ckpt = self._flows.remove(name)   # with its delta, its metas, plans and P2P service
        if force and ckpt.pool is not None and self._pool is not None:   # the regions no other version holds
            self._pool.release_free()
            if not self._pool.regions:
                self._pool = None

    def _tell(self, operation: str, phase: str, done: int | None = None, total: int | None = None) -> None:
        if self.progress is not None:
            try:
                self.progress(operation, phase, done, total)
            except Exception:   # a progress display must never break a transfer
                self._log.exception("progress callback failed (ignored)")

    def checkpoints(self) -> list[str]:
        return sorted(self._catalog.checkpoints)

    # -- what an operator's status reads (the service's /v1/status and /metrics) --------------------
    def gathered(self) -> list[str]:
        """Checkpoints whose metas every rank has (gathered or loaded)."""
        return sorted(self._catalog.metas)

    def registered_bytes(self, name: str | None = None) -> int | None:
        """Host bytes of checkpoint ``name`` on this rank (None: of every checkpoint; an unknown name: None).
        A device-resident checkpoint (``on_device``) holds none."""
        return self._catalog.registered_bytes(name)

    def health_problem(self) -> str | None:
        """Why this PS cannot update any more (closed, or its process groups broke), or None."""
        if self._closed:
            return "this parameter server is closed"
        if self._broken:
            return f"process groups broke in an earlier update ({self._broken}); restart this world"
        return None

    def pool_bytes(self) -> int:
        """Bytes of the shared pinned pool (``use_shared_memory_pool``: one region, two along a delta chain),
        0 when there is none yet."""
        return 0 if self._pool is None else self._pool.nbytes

    def pool_free_bytes(self) -> int:
        """Bytes of the largest shared pool region no checkpoint holds (what a registration into the pool
        can take without allocating), 0 when there is none."""
        return 0 if self._pool is None else self._pool.free_bytes

    # -- metas -----------------------------------------------------------------
    def gather_metas(self, checkpoint_name: str) -> None:
        """Collective: every rank learns every rank's tensors of ``checkpoint_name``. All ranks must call it."""
        self._check_open()
        with gc_paused():
            self._flows.gather(checkpoint_name)   # and every owner's P2P store, and the version's delta

    def tensor_specs(self, name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{tensor: (dtype code, shape)}`` of every tensor of gathered checkpoint ``name`` (all
        ranks' together): what an engine records a slice plan over (``VllmClient.slice_plan``)."""
        return self._catalog.tensor_specs(name)

    def share_slice_plan(self, plan=None, *, src: int | None = 0, error: str | None = None):
        """Collective: every rank gets rank ``src``'s slice plan (``ckpt_core.planning.slices``) as JSON over
        the control group, checked again on each rank, or by digest alone when every rank shared it before
        (``transfer/share_plan.py``). Rank ``src`` passes the plan (e.g. ``VllmClient.slice_plan``), the others
        nothing; ``src=None``: the lowest rank that passed one. ``error``: why this rank has no plan; every rank
        raises it, as it raises a ``plan`` that is not a ``SlicePlan`` (ConfigError, the world intact)."""
        self._check_open()
        with self._collective():
            return share_plan(self._coll, self.rank, plan, src=src, error=error, known=self._shared_plans)

    def get_metas(self, *, slices=None) -> dict:
        """Every gathered (or loaded) checkpoint's metas as a versioned JSON document (``ckpt_core.p2p.metas``):
        tensors per owner rank, and each owner's P2P store address (and a version's delta, gathered with it).

        ``slices``: a slice plan (or a list) that joining worlds will update with. Then a collective of this
        world (every rank calls it): each owner checks its tensors against their registration digests and
        digests the boxes the plan reads of them, for every gathered checkpoint the plan fits; this document and
        every later one of this rank (until gather_metas or unregister) carry them, so that a joiner checks each
        slice it reads (docs/p2p.md, "Slices"). A problem on any rank is raised on every rank, publishing nothing."""
        if slices is not None:
            self._check_open()
            with gc_paused():
                self._p2p.publish_slices(slices)
        return self._p2p.metas_document()

    def save_metas(self, path, *, slices=None) -> None:
        """Write ``get_metas()`` to ``path`` as JSON (atomically), for readers on other hosts: refused (``ConfigError``
        naming PS_P2P_HOST) while an owner publishes a loopback address, unless this rank's PS_P2P_HOST was set to
        one on purpose. ``slices``: as in ``get_metas``, a collective then: every rank calls it and writes ``path``."""
        doc = self.get_metas(slices=slices)
        self.check_metas_reachable(doc)
        _metas.save(path, doc)

    def check_metas_reachable(self, doc: dict | None = None) -> None:
        """``save_metas``' check alone; every rank can run it (same document, same verdict)."""
        check_reachable(self.get_metas() if doc is None else doc)

    def load_metas(self, metas) -> None:
        """Install metas from ``get_metas()``/``save_metas()`` (a dict or a file path), e.g. in a separate world
        whose ranks own nothing and pull with ``update(..., ranks=[...])``. All or nothing: the whole document is
        validated before anything is installed (a ``ConfigError``: nothing changed). Metas of a world of this size
        also serve broadcast updates (a rank they give no tensors takes part without registering anything)."""
        self._check_open()
        sources, legacy = self._p2p.parse(metas)       # versioned/path -> validated; legacy dicts pass through
        broadcast = parse_metas(legacy, self.world_size)
        self._p2p.loaded.update(sources)                # installed only once everything was validated
        self._catalog.metas.update(broadcast)

    # -- update ----------------------------------------------------------------
    def update(self, checkpoint_name: str, req_func: ReqFunc, *, ranks: list[int] | None = None,
               timeout: float | timedelta = timedelta(minutes=10), slices=None, delta=False) -> dict:
        """Collective: push checkpoint ``checkpoint_name`` into every rank's engine worker.

        ``ranks=[...]``: a P2P update of those ranks' engines only, read from the owners' host
        memory (docs/p2p.md); still called on every rank, ``req_func`` runs on those ranks only.

        ``req_func(handles)`` runs in a thread on every rank with ``handles`` = ``[(device_uuid, zmq_handle)]``
        of all ranks, in rank order (the reference's contract); between them, the calls must make every engine
        worker call ``update_weights_from_ipc``; typically the first rank of each inference group posts its
        group's handles to its own engine and the others return. Raises ``RemoteWorkerError`` (naming the rank
        and carrying the traceback) if any engine worker or any rank's ``req_func`` failed, ``UpdateTimeoutError``
        if a worker stayed silent or a ``req_func`` did not return within ``timeout``. Returns timings (also
        kept in ``last_update``).

        ``slices``: a :class:`ckpt_core.planning.slices.SlicePlan` recorded from the engine (the same on every
        rank; ``VllmClient.slice_plan``): each engine rank then receives only what its loaders read (our wire
        only). Broadcast: PS rank p feeds engine rank p % T of the plan's T (a world of R x T ranks feeds R
        data-parallel replicas, one transfer of each slice; tensors in pieces are assembled from their owners).
        With ``ranks`` (P2P), the targets in rank order are engine ranks 0, 1, ..., each reading its own slices
        (docs/p2p.md). Each worker refuses slices routed for another rank or plan. The result's ``slices``
        gives the bytes each engine rank received. None (the default): every tensor whole.

        ``delta``: True sends (or, with ``ranks``, has the targets read) only what changed since the
        version's base (registered with ``base=``), which the engines must hold (else
        ``DeltaBaseError`` on every rank, nothing written); ``"fallback"``: a refused delta becomes
        a full update (``delta/dispatch.py``, docs/deltas.md).
        """
        self._check_open()
        if not self._update_lock.acquire(blocking=False):
            raise ConfigError("another update is already running on this ParameterServer")
        try:
            self._check_open()   # again: close() may have run between the first check and the lock
            with gc_paused():   # broadcast, P2P, or a delta of either (delta/dispatch.py)
                return self._flows.run(checkpoint_name, req_func, ranks=ranks, timeout=timeout, slices=slices,
                                         delta=delta)
        except TransportError as exc:
            self._groups_broke(exc)
            raise
        finally:
            self._update_lock.release()

    # -- collectives of the facade ---------------------------------------------
    def all_gather_json(self, obj) -> list:
        """Collective: every rank's ``obj`` (JSON), in rank order, over the control group: what a caller that drives
        every rank (the HTTP service) agrees on before it starts a collective, so that what one rank would refuse
        is refused on every rank. Bounded by ``PS_COLLECTIVE_TIMEOUT_S``; a failure breaks the groups
        (TransportError)."""
        self._check_open()
        with self._collective():
            return self._coll.all_gather_json(obj)

    @contextmanager
    def _collective(self):
        """Around a collective of this facade: one that failed or never finished marks the groups broken."""
        try:
            yield
        except TransportError as exc:
            self._groups_broke(exc)
            raise

    def _groups_broke(self, exc: TransportError) -> None:
        """After ``exc``: if a collective failed or never finished (``groups_broken``), the process groups cannot be
        trusted again, and a device buffer may still be the target of a stuck collective: abort them, and refuse
        every later call (``_check_open``)."""
        if not getattr(exc, "groups_broken", False):
            return
        self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        self._coll.abort()
        if self._coll.abort_finished is False:
            self._log.warning("aborting the process groups did not finish within %.0f s; this rank "
                              "cannot update again: close() it and start a new ParameterServer", ABORT_WAIT_S)
