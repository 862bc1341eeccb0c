"""Host memory that holds registered checkpoints: owned buffers, the shared pool, in-place maps.

Every region has one owner and an idempotent ``release()`` that unpins and
frees it. A checkpoint's copied content (file data areas and named tensors)
lives in one region, laid out in registration order with aligned starts, so
a bucket's host-to-device copy is a few large copies.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ckpt_core._settings import fault_threads
from ckpt_core.devices import DeviceBackend, HostPin
from ckpt_core.errors import CheckpointFormatError, ConfigError
from ckpt_core.planning.buckets import PIN_CHUNK, align_up

COPY_CHUNK = 256 << 20
COPY_THREADS = max(1, min(8, (os.cpu_count() or 2)))


@dataclass
class HostRegion:
    id: int
    tensor: torch.Tensor                       # flat uint8
    pin: HostPin = field(default_factory=HostPin)
    closer: Callable[[], None] | None = None
    source_check: Callable[[], str | None] | None = None   # in-place regions: has the file shrunk?
    source_rewritten: Callable[[], str | None] | None = None   # in-place regions: written since mapped?

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def release(self) -> None:
        self.pin.release()
        self.tensor = None
        fn, self.closer = self.closer, None
        if fn is not None:
            fn()


# -- work on a region: (start, end, fn) jobs, run across threads (torch copies, I/O and madvise drop the GIL)
Job = tuple[int, int, Callable[[], None]]


def run_jobs(jobs: list[Job], threads: int | None = None) -> None:
    """Run every job's ``fn``, across ``threads`` (default COPY_THREADS) when there is more than one."""
    threads = threads or COPY_THREADS
    if len(jobs) <= 1 or threads == 1:
        for job in jobs:
            job[2]()
        return
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda job: job[2](), jobs))


GROUP_BYTES = 4 << 20   # small jobs run together up to this many bytes (see ``grouped``)


def grouped(jobs: list[Job], max_bytes: int = GROUP_BYTES) -> list[Job]:
    """The same work in fewer jobs: runs of consecutive jobs (in list order) of fewer than ``max_bytes``
    together become one job that runs them in turn, spanning the first one's start to the last one's end.
    A registration of many small tensors paid the thread pool's cost per job (moe8 x0.05, 5,210 tensors of
    ~83 KB on the 2-core machine: ~35 us each, most of its fill); a job of ``max_bytes`` or more stays
    alone."""
    out: list[Job] = []
    run: list[Job] = []
    size = 0

    def close() -> None:
        nonlocal run, size
        if len(run) == 1:
            out.append(run[0])
        elif run:
            fns = [fn for _, _, fn in run]
            out.append((run[0][0], run[-1][1], functools.partial(_in_turn, fns)))
        run, size = [], 0
    for job in jobs:
        n = job[1] - job[0]
        if run and size + n > max_bytes:
            close()
        run.append(job)
        size += n
    close()
    return out


def _in_turn(fns: list[Callable[[], None]]) -> None:
    for fn in fns:
        fn()


def counted(jobs: list[Job], on_bytes: Callable[[int], None] | None) -> list[Job]:
    """The same jobs; each, once done, calls ``on_bytes(bytes done so far by all of them)`` (progress).
    Jobs run on several threads: the total and the call are under one lock, so the reported
    counts only grow (the callback must be quick)."""
    if on_bytes is None:
        return jobs
    lock, done = threading.Lock(), [0]

    def wrap(start: int, end: int, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            fn()
            with lock:
                done[0] += end - start
                on_bytes(done[0])
        return run
    return [(a, b, wrap(a, b, fn)) for a, b, fn in jobs]


def _pieces(region: HostRegion, dst: torch.Tensor):
    """``(offset in dst, piece, start in the region)`` for each piece of a view of the region, cut at
    the region's multiples of COPY_CHUNK: no piece crosses one, so none spans two of the PIN_CHUNK
    ranges the region is pinned in (a device-to-host copy into two pinned ranges is refused by CUDA,
    "invalid argument", as seen registering 16 GiB of CUDA shards on one H200)."""
    base = region.tensor.data_ptr()
    first = dst.data_ptr() - base
    a = 0
    while a < dst.numel():
        n = min(dst.numel() - a, COPY_CHUNK - (first + a) % COPY_CHUNK)
        yield a, dst[a: a + n], first + a
        a += n


assert PIN_CHUNK % COPY_CHUNK == 0, "pieces cut at COPY_CHUNK multiples stay inside one pinned range"  # noqa: S101 - our own constants


def copy_jobs(region: HostRegion, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Job]:
    """Copy ``src -> dst`` pairs (``dst`` views of the region), in pieces that each stay inside one
    pinned range of the region (see :func:`_pieces`)."""
    return [(start, start + d.numel(), functools.partial(_copy, d, src[a: a + d.numel()]))
            for dst, src in pairs for a, d, start in _pieces(region, dst)]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (flat uint8); host to host by numpy: torch's copy of a tensor of more than its
    grain size runs on its intra-op threads, which the copy jobs' own threads oversubscribe (5,210 copies
    of 83 KB on the 2-core machine, two threads: torch 87 ms, numpy 35 ms)."""
    if src.device.type == "cpu" and not src.is_conj() and not src.is_neg():
        dst.numpy()[:] = src.numpy()
    else:
        dst.copy_(src)


def read_jobs(region: HostRegion, reads: list[tuple[str, int, torch.Tensor]]) -> list[Job]:
    """Fill views of the region from ``(path, file_offset, dst)``; short reads are errors."""
    return [(start, start + d.numel(), functools.partial(_read_into, path, off + a, d))
            for path, off, dst in reads for a, d, start in _pieces(region, dst)]


def _read_into(path: str, off: int, dst: torch.Tensor) -> None:
    view = memoryview(dst.numpy()).cast("B")
    try:
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = os.preadv(f.fileno(), [view[got:]], off + got)
                if n <= 0:
                    raise OSError(f"{path}: file ended at byte {off + got} while reading a registered checkpoint")
                got += n
    except OSError as exc:   # the file changed or vanished between validation and the copy
        raise CheckpointFormatError(f"reading the checkpoint failed: {exc}") from exc


MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23     # Linux >= 5.14
_libc = None


def populate_jobs(region: HostRegion, *, write: bool = True) -> list[Job]:
    """Build the page tables of a fresh mapping (file or anonymous) ahead of pinning, in pieces.

    Pinning (cudaHostRegister) runs ~2x faster over pages that are already mapped
    (benchmarks/pin_probe.py), and the pieces run in parallel with the pinning of
    earlier ones. Where the kernel lacks MADV_POPULATE_WRITE the pages are faulted
    in by the pinning itself. Run them on ``fault_threads()`` threads: faulting one
    address space from more threads contends in the kernel (benchmarks/first_touch_probe.py:
    8 GiB per rank, 2 ranks, populate+pin 0.94-1.57 s with 4 threads, 1.84-2.44 s with 8).
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ptr, size = region.tensor.data_ptr(), region.nbytes
    if size == 0 or ptr % mmap.PAGESIZE:
        return []
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ   # a read-only map cannot be written

    def one(a: int, n: int) -> None:
        if _libc.madvise(ptr + a, n, advice) != 0:
            err = ctypes.get_errno()
            if err not in (errno.EINVAL, errno.ENOSYS):   # EFAULT/ENOMEM: file shorter than its map, no memory
                raise CheckpointFormatError(f"cannot fault in {n} bytes of host memory: {os.strerror(err)}")

    step = COPY_CHUNK
    return [(a, min(a + step, size), functools.partial(one, a, min(step, size - a))) for a in range(0, size, step)]


def fill_and_pin(backend: DeviceBackend, region: HostRegion, jobs: list[Job], threads: int | None = None) -> None:
    """Run ``jobs`` (faulting in or filling the region) across ``threads``; meanwhile pin each PIN_CHUNK
    of the region as soon as every job touching it has finished, so pinning overlaps the jobs instead
    of following them. On failure nothing stays pinned by this call and the first error is raised."""
    if not (backend.pins_host_memory and region.nbytes > 0):
        run_jobs(jobs, threads)
        return
    jobs = sorted(jobs, key=lambda j: j[0])
    pins: list[HostPin] = []
    with ThreadPoolExecutor(threads or COPY_THREADS) as ex:
        futures = [(job[0], ex.submit(job[2])) for job in jobs]
        try:
            k = 0
            for start in range(0, region.nbytes, PIN_CHUNK):
                end = min(start + PIN_CHUNK, region.nbytes)
                while k < len(futures) and futures[k][0] < end:
                    futures[k][1].result()
                    k += 1
                pins.append(backend.pin(region.tensor[start:end]))
        except BaseException:
            for _, f in futures:
                f.cancel()
            for p in pins:
                p.release()
            raise
    def release_all() -> None:
        for p in pins:
            p.release()

    region.pin = HostPin(release_all)


def populate_and_pin(backend: DeviceBackend, region: HostRegion, *, write: bool = True,
                     on_bytes: Callable[[int], None] | None = None) -> None:
    """Fault a fresh mapping in on ``fault_threads()`` threads and pin it piece by piece (see above).
    ``on_bytes``: progress, bytes faulted in so far (see :func:`counted`)."""
    jobs = populate_jobs(region) if write else populate_jobs(region, write=False)
    fill_and_pin(backend, region, counted(jobs, on_bytes), fault_threads())


def new_region(backend: DeviceBackend, rid: int, nbytes: int) -> HostRegion:
    tensor = backend.empty_host(nbytes)
    return HostRegion(rid, tensor)


def file_writable(path: str) -> bool:
    """Whether this process may open ``path`` for writing (read-only files are mapped read-only)."""
    try:
        os.close(os.open(path, os.O_RDWR))
        return True
    except OSError:
        return False


def map_file_region(backend: DeviceBackend, rid: int, path: str, *, writable: bool = True,
                    lap: Callable[[str], None] = lambda phase: None,
                    on_bytes: Callable[[int], None] | None = None) -> HostRegion:
    """Map a whole file (a /dev/shm checkpoint) in place and pin it; nothing is copied.

    ``writable=False`` maps it read-only (nothing ever writes a checkpoint's host memory);
    only kinds that do not pin host memory are given such files. Never deletes the file.
    """
    try:
        with open(path, "r+b" if writable else "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=prot) if size else None
            fd = os.dup(f.fileno())   # to see the file shrink even after it was unlinked
    except OSError as exc:
        raise ConfigError(f"cannot map the in-place checkpoint file {path!r}: {exc}") from exc
    if mm is None:
        tensor = torch.empty(0, dtype=torch.uint8)
    else:
        with warnings.catch_warnings():   # torch warns that a read-only buffer is not writable: we only read it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
    region = HostRegion(rid, tensor)

    def source_check() -> str | None:
        # Touching a page past the end of a shrunk file is SIGBUS: the PS would die mid-update.
        now = os.fstat(fd).st_size
        return None if now >= size else (f"in-place file {path!r} shrank from {size} to {now} bytes since it "
                                         "was registered; register it again")

    def close() -> None:
        os.close(fd)
        try:
            if mm is not None:
                mm.close()
        except BufferError:
            pass  # a caller still holds a view; the map goes when it does

    region.closer = close
    region.source_check = source_check
    try:
        populate_and_pin(backend, region, write=writable, on_bytes=on_bytes)
        lap("populate and pin in place")
    except BaseException:
        region.release()
        raise
    mapped = os.fstat(fd)   # after the populate, whose write faults touch the file's times

    def source_rewritten() -> str | None:
        # a trainer that writes its next step into the same file (same inode) changes these bytes under the PS
        now = os.fstat(fd)
        if (now.st_mtime_ns, now.st_size) == (mapped.st_mtime_ns, mapped.st_size):
            return None
        return f"in-place file {path!r} was written since it was registered (its bytes are the file's, shared)"

    region.source_rewritten = source_rewritten
    return region


class SharedPool:
    """Pinned host regions reused by successive checkpoints of the same (or smaller) size.

    RL loops register a new checkpoint every step; re-using the pinned pool skips the slow allocation,
    first touch and pinning. One checkpoint holds a region at a time, and the pool has one region, but
    a version registered with a base that holds one (``register_checkpoint(..., base=)``: a delta chain,
    whose base stays registered until the engines left it) may take a second beside it: the versions
    of a chain then alternate between the two (C into A's region once A is unregistered). At most
    ``MAX_REGIONS``; any other registration into a pool whose regions are all held is refused.
    """

    MAX_REGIONS = 2

    def __init__(self, backend: DeviceBackend):
        self.backend = backend
        self.regions: list[HostRegion] = []
        self.holders: list[str | None] = []

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def free_bytes(self) -> int:
        """The largest region no checkpoint holds."""
        return max((r.nbytes for r, h in zip(self.regions, self.holders) if h is None), default=0)

    def owns(self, region: HostRegion) -> bool:
        return any(r is region for r in self.regions)

    def acquire(self, name: str, nbytes: int, rid: int, beside: str | None = None) -> HostRegion:
        """A free region of at least ``nbytes`` (one too small is grown), for checkpoint ``name``; with
        ``beside`` (the base it is registered with), a second region when the base holds the only one."""
        free = [i for i, h in enumerate(self.holders) if h is None]
        if free:
            fits = [i for i in free if self.regions[i].nbytes >= nbytes]
            i = min(fits, key=lambda k: self.regions[k].nbytes) if fits else free[0]
        elif not self.regions or (beside is not None and beside in self.holders
                                  and len(self.regions) < self.MAX_REGIONS):
            self.regions.append(None)   # type: ignore[arg-type]  # filled below
            self.holders.append(None)
            i = len(self.regions) - 1
        else:
            held = ", ".join(repr(h) for h in self.holders)
            raise ConfigError(f"the shared memory pool is held by checkpoint{'s' * (len(self.holders) > 1)} {held}; "
                              f"unregister one before "
                              f"registering {name!r} into the pool (a version registered with base= may take "
                              f"a second region beside its base's)")
        region = self.regions[i]
        if region is None or region.nbytes < nbytes:
            if region is not None:
                region.release()
            region = new_region(self.backend, rid, align_up(nbytes, 1 << 20))
            try:
                populate_and_pin(self.backend, region)
            except BaseException:
                region.release()
                del self.regions[i], self.holders[i]
                raise
            self.regions[i] = region
        region.id = rid
        self.holders[i] = name
        return region

    def give_back(self, name: str) -> None:
        self.holders = [None if h == name else h for h in self.holders]

    def release_free(self) -> None:
        """Release the memory of every region no checkpoint holds."""
        keep = [(r, h) for r, h in zip(self.regions, self.holders) if h is not None]
        for r, h in zip(self.regions, self.holders):
            if h is None:
                r.release()
        self.regions, self.holders = [r for r, _ in keep], [h for _, h in keep]

    def close(self) -> None:
        for r in self.regions:
            r.release()
        self.regions, self.holders = [], []
