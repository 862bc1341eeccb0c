"""Host copies of received device tensors through a small reusable page-locked staging area.

An engine worker keeps a host copy of what a full update with ``deltas=True`` made live (the delta
base of the tensors a later delta rebuilds; on the first such update, every tensor). One
``t.to("cpu")`` per tensor is a synchronous copy into fresh pageable memory: the driver stages it
through its own small pinned buffer and the host pays the first touch of every page, one tensor at
a time (a real 7B, 14.19 GiB: 9.3 s on an H100, about 1.6 GB/s). Here instead:

- the tensors' bytes are laid end to end into chunks of a page-locked staging area (a few chunks of
  tens of MiB, allocated once per copier at their exact size and reused; large tensors split across
  chunks, small ones packed into one: :func:`plan_chunks`, pure);
- each chunk is filled by device-to-host copies on a side stream (``non_blocking``: the copy engine),
  then an event;
- a few threads wait for that event and copy the chunk's bytes into the destinations (ordinary
  pageable tensors, kept long-term: nothing page-locked is kept per tensor), each its share
  (:func:`split_shares`), while the next chunk's device copies run. numpy's copy releases the GIL;
  the memcpy and the first-touch page faults of the fresh destinations are the host's cost.

Every copy of a :meth:`HostCopier.copy` call is complete when it returns (the sources may be reused
then: an IPC buffer's slot); every wait has a deadline (``UpdateTimeoutError`` naming the tensors
of the chunk); a failed device copy or host copy raises ``TransportError`` naming them, from its
cause. Tensors on the host, non-contiguous views, and a copier with no staging (``chunk_bytes=0``)
take one plain ``.to("cpu", copy=True)`` each.

Usage (one copier per worker; ``close()`` releases the staging and the threads)::

    copier = HostCopier(chunk_bytes=64 << 20, chunks=4, threads=4)
    kept = dict(zip(names, copier.copy(list(zip(names, tensors)), timeout=600)))

The staging's allocation and the device side are injectable (``alloc``, ``mover``, ``stage_devices``)
so that the planning, packing and threads run in CPU tests with a plain host tensor as staging.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, cast

import numpy as np
import torch

from ckpt_core._settings import host_copy_mib, host_copy_threads
from ckpt_core.devices import NullEvent
from ckpt_core.errors import CkptError, ClosedError, ConfigError, TransportError, UpdateTimeoutError

__all__ = ["Piece", "plan_chunks", "split_shares", "HostCopier", "HostMover", "CudaMover", "pinned_staging",
           "copier_from_settings", "ALIGN", "MIN_SHARE", "STAGING_CHUNKS"]

ALIGN = 256            # a tensor starts at a multiple of this in its chunk (aligned memcpy on both sides)
STAGING_CHUNKS = 4    # CKPT_HOST_COPY_MIB is split into this many chunks: one filled while threads empty the others
MIN_SHARE = 1 << 20    # a thread's share of a chunk is at least this many bytes (fewer threads for a small one)


@dataclass(frozen=True)
class Piece:
    """``nbytes`` bytes of source ``tensor`` from its byte ``start``, at byte ``at`` of a chunk."""

    tensor: int
    start: int
    at: int
    nbytes: int


def plan_chunks(sizes: Sequence[int], chunk_bytes: int, align: int = ALIGN) -> list[list[Piece]]:
    """Pure: the chunks that carry tensors of byte sizes ``sizes``, in order. A tensor starts at a
    multiple of ``align`` in its chunk; one that fits a chunk is never split (it starts the next chunk
    when the rest of this one is too small); a larger one fills the rest of the current chunk and goes on
    in the next ones. Empty tensors get no piece. Every chunk's pieces lie in ``[0, chunk_bytes)``,
    disjoint; every tensor's pieces cover it once, in order."""
    if chunk_bytes <= 0 or align <= 0 or chunk_bytes % align:
        raise ConfigError(f"a chunk of {chunk_bytes} bytes is not a positive multiple of {align}")
    chunks: list[list[Piece]] = []
    cur: list[Piece] = []
    used = 0
    for i, size in enumerate(sizes):
        if size <= 0:
            continue
        used = -(-used // align) * align
        if used >= chunk_bytes or (size <= chunk_bytes and used + size > chunk_bytes):
            chunks.append(cur)
            cur, used = [], 0
        done = 0
        while done < size:
            if used >= chunk_bytes:
                chunks.append(cur)
                cur, used = [], 0
            n = min(size - done, chunk_bytes - used)
            cur.append(Piece(i, done, used, n))
            used += n
            done += n
    if cur:
        chunks.append(cur)
    return chunks


def split_shares(pieces: Sequence[Piece], parts: int, min_share: int = MIN_SHARE) -> list[list[Piece]]:
    """Pure: a chunk's pieces cut into at most ``parts`` shares of about equal bytes (none under
    ``min_share`` but a chunk's only one), splitting pieces where a share ends. Together the shares
    cover exactly the pieces' bytes."""
    total = sum(p.nbytes for p in pieces)
    n = max(1, min(parts, total // max(1, min_share)))
    target = -(-total // n)
    shares: list[list[Piece]] = [[]]
    room = target
    for p in pieces:
        off = 0
        while off < p.nbytes:
            if room == 0:
                shares.append([])
                room = target
            k = min(room, p.nbytes - off)
            shares[-1].append(Piece(p.tensor, p.start + off, p.at + off, k))
            off += k
            room -= k
    return [s for s in shares if s]


class Done(Protocol):
    def query(self) -> bool: ...


class Mover(Protocol):
    """The device side of a staged copy: ``begin`` orders the copies after the work that produced the
    sources, ``copy`` queues one copy into the staging, ``record`` marks the copies queued so far."""

    def begin(self) -> None: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record(self) -> Done: ...


class HostMover:
    """Sources on the host (tests, and a copier staging CPU tensors): each copy done at once."""

    def begin(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self) -> Done:
        return NullEvent()


class CudaMover:
    """Device-to-host copies on a side stream of ``device``, which first waits for its current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Done:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def pinned_staging(nbytes: int) -> tuple[torch.Tensor, Callable[[], None]]:
    """``nbytes`` of page-locked host memory and its release: a plain host tensor registered with the
    driver at its exact size (torch's caching host allocator would round it up and never give it back)."""
    from ckpt_core.devices import get_backend

    buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf, get_backend("cuda").pin(buf).release


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _wait(done: Done, deadline: float, what: Callable[[], str]) -> None:
    """Poll ``done`` until it reports done (short sleeps: a chunk's copy takes milliseconds)."""
    nap = 1e-5
    while not done.query():
        if time.monotonic() > deadline:
            raise UpdateTimeoutError(f"host copy: the device-to-host copy of {what()} did not finish in time")
        time.sleep(nap)
        nap = min(nap * 2, 2e-4)


class HostCopier:
    """Host copies of tensors through ``chunks`` page-locked chunks of ``chunk_bytes`` each (allocated on
    first use by ``alloc(nbytes) -> (tensor, release)``, reused by every later call) and ``threads`` copy
    threads. ``mover(device)`` makes the device side per source device, for sources on a device kind in
    ``stage_devices``; a thread's share of a chunk is at least ``min_share`` bytes. ``chunk_bytes=0``: no
    staging, plain copies. ``close()`` is idempotent."""

    def __init__(self, *, chunk_bytes: int = 64 << 20, chunks: int = 4, threads: int = 4,
                 alloc: Callable[[int], tuple[torch.Tensor, Callable[[], None]]] = pinned_staging,
                 mover: Callable[[torch.device], Mover] = CudaMover, stage_devices: Sequence[str] = ("cuda",),
                 min_share: int = MIN_SHARE):
        if chunk_bytes < 0 or chunk_bytes % ALIGN or chunks < 2 or threads < 1:
            raise ConfigError(f"a host copier needs chunk_bytes a multiple of {ALIGN} (0: no staging), at least 2 "
                              f"chunks and 1 thread, got chunk_bytes={chunk_bytes}, chunks={chunks}, threads={threads}")
        self.chunk_bytes, self.chunks, self.threads = chunk_bytes, chunks, threads
        self._alloc, self._mover_of, self._stage_devices = alloc, mover, tuple(stage_devices)
        self.min_share = min_share
        self._staging: list[torch.Tensor] | None = None
        self._release: weakref.finalize | None = None   # unregisters the staging, then lets it go
        self._abandoned: list[Any] = []   # staging a failed call may still be written into: kept while the copier lives
        self._movers: dict[torch.device, Mover] = {}
        self._pool: cf.ThreadPoolExecutor | None = None
        self._closed = False
        self.allocations = 0   # times the staging was allocated (once, unless a call failed)
        self.last: dict = {}   # the last call's figures: bytes, staged_bytes, chunks, seconds

    def copy(self, named: Sequence[tuple[str, torch.Tensor]], *, timeout: float) -> list[torch.Tensor]:
        """Fresh contiguous-or-alike host tensors, one per ``(name, tensor)`` in order, each equal to its
        source byte for byte; every copy complete on return. Waits are bounded by ``timeout`` seconds."""
        if self._closed:
            raise ClosedError("the host copier was closed")
        t0 = time.perf_counter()
        out: list[torch.Tensor | None] = [None] * len(named)
        staged: list[int] = []
        for i, (_, t) in enumerate(named):
            if self.chunk_bytes and t.device.type in self._stage_devices and t.is_contiguous():
                staged.append(i)
            else:
                out[i] = t.detach().to("cpu", copy=True)
        devices = {named[i][1].device for i in staged}
        if len(devices) > 1:
            raise ConfigError(f"a host copy takes tensors of one device at a time, got {sorted(map(str, devices))}")
        plan: list[list[Piece]] = []
        if staged:
            dsts = [torch.empty(named[i][1].shape, dtype=named[i][1].dtype) for i in staged]
            for i, d in zip(staged, dsts):
                out[i] = d
            srcs = [_bytes(named[i][1]) for i in staged]
            plan = plan_chunks([s.numel() for s in srcs], self.chunk_bytes)
            names = [named[i][0] for i in staged]
            self._staged(plan, srcs, [_bytes(d).numpy() for d in dsts], names, devices.pop(), timeout)
        staged_bytes = sum(p.nbytes for c in plan for p in c)
        self.last = {"bytes": sum(t.nbytes for _, t in named), "staged_bytes": staged_bytes, "chunks": len(plan),
                     "seconds": time.perf_counter() - t0}
        return cast("list[torch.Tensor]", out)   # every entry set above

    def _staged(self, plan: list[list[Piece]], srcs: list[torch.Tensor], dsts: list[np.ndarray], names: list[str],
                device: torch.device, timeout: float) -> None:
        if not plan:
            return
        staging, pool = self._ready()
        mover = self._movers.get(device)
        if mover is None:
            mover = self._movers[device] = self._mover_of(device)
        deadline = time.monotonic() + timeout
        inflight: list[tuple[list[cf.Future], list[Piece]] | None] = [None] * len(staging)
        try:
            mover.begin()
            for k, pieces in enumerate(plan):
                slot = k % len(staging)
                self._drained(inflight[slot], deadline, names)   # its last chunk copied out before it is overwritten
                stage = staging[slot]
                p = None
                try:
                    for p in pieces:
                        mover.copy(stage[p.at: p.at + p.nbytes], srcs[p.tensor][p.start: p.start + p.nbytes])
                    p = None
                    done = mover.record()
                except Exception as exc:
                    what = _what(pieces, names) if p is None else f"tensor {names[p.tensor]!r}"
                    raise TransportError(f"host copy: the device-to-host copy of {what} failed: "
                                         f"{type(exc).__name__}: {exc}") from exc
                host = stage.numpy()
                inflight[slot] = ([pool.submit(_drain, done, host, share, dsts, deadline, pieces, names)
                                   for share in split_shares(pieces, self.threads, self.min_share)], pieces)
            for entry in inflight:
                self._drained(entry, deadline, names)
        except BaseException:
            self._abandon(inflight)
            raise

    def _drained(self, entry, deadline: float, names: list[str]) -> None:
        if entry is None:
            return
        futures, pieces = entry
        _, late = cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        if late:
            raise UpdateTimeoutError(f"host copy: the copy of {_what(pieces, names)} from the staging did not "
                                     "finish in time")
        for f in futures:
            exc = f.exception()
            if isinstance(exc, CkptError):
                raise exc
            if exc is not None:
                raise TransportError(f"host copy: the copy of {_what(pieces, names)} from the staging failed: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def _ready(self) -> tuple[list[torch.Tensor], cf.ThreadPoolExecutor]:
        if self._staging is None:
            buf, release = self._alloc(self.chunk_bytes * self.chunks)
            # a copier dropped unclosed still unregisters its staging before the memory goes (not at exit)
            self._release = weakref.finalize(self, _unpin, release, buf)
            self._release.atexit = False
            if buf.dtype != torch.uint8 or buf.device.type != "cpu" or buf.numel() < self.chunk_bytes * self.chunks:
                raise ConfigError(f"the staging allocator gave {buf.numel()} {buf.dtype} on {buf.device}, not "
                                  f"{self.chunk_bytes * self.chunks} host bytes")
            self._staging = [buf[k * self.chunk_bytes: (k + 1) * self.chunk_bytes] for k in range(self.chunks)]
            self.allocations += 1
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-host-copy")
        return self._staging, self._pool

    def _abandon(self, inflight) -> None:
        """After a failed call: stop the copies not started; a device copy or a thread may still write
        into this staging (a wait that ran out), so it is never reused nor released (the next call
        allocates another)."""
        for entry in inflight:
            for f in entry[0] if entry is not None else ():
                f.cancel()
        if self._staging is not None:
            self._abandoned.append((self._staging, self._release))
        self._staging, self._release = None, None

    def close(self) -> None:
        """Release the staging and the threads (a failed call's staging: only once the copier is dropped)."""
        if self._closed:
            return
        self._closed = True
        release, self._release, self._staging = self._release, None, None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if release is not None:
            release()


def copier_from_settings() -> HostCopier:
    """A copier as CKPT_HOST_COPY_MIB (0: no staging) and CKPT_HOST_COPY_THREADS say."""
    chunk = (host_copy_mib() << 20) // STAGING_CHUNKS // ALIGN * ALIGN
    return HostCopier(chunk_bytes=chunk, chunks=STAGING_CHUNKS, threads=host_copy_threads())


def _unpin(release: Callable[[], None], buf: torch.Tensor) -> None:
    release()   # the driver lets go of the pages before ``buf`` (held until now) frees them


def _what(pieces: Sequence[Piece], names: list[str]) -> str:
    tensors = list(dict.fromkeys(names[p.tensor] for p in pieces))
    more = f" and {len(tensors) - 1} more tensor(s) of its chunk" if len(tensors) > 1 else ""
    return f"tensor {tensors[0]!r}{more}"


def _drain(done: Done, stage: np.ndarray, share: list[Piece], dsts: list[np.ndarray], deadline: float,
           pieces: list[Piece], names: list[str]) -> None:
    """One thread's share of a chunk: wait for the chunk's device copies, then copy its bytes out."""
    _wait(done, deadline, lambda: _what(pieces, names))
    for p in share:
        np.copyto(dsts[p.tensor][p.start: p.start + p.nbytes], stage[p.at: p.at + p.nbytes])
