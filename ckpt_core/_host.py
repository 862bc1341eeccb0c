"""Host memory that holds registered checkpoints: owned buffers, the shared pool, in-place maps.

Every region has one owner and an idempotent ``release()`` that unpins and
frees it. A checkpoint's copied content (file data areas and named tensors)
lives in one region, laid out in registration order with aligned starts, so
a bucket's host-to-device copy is a few large copies.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from ._planner import align_up
from .devices import DeviceBackend, HostPin
from .errors import CheckpointFormatError, ConfigError

COPY_CHUNK = 256 << 20
COPY_THREADS = max(1, min(8, (os.cpu_count() or 2)))


@dataclass
class HostRegion:
    id: int
    tensor: torch.Tensor                       # flat uint8
    pin: HostPin = field(default_factory=HostPin)
    closer: Callable[[], None] | None = None
    source_check: Callable[[], str | None] | None = None   # in-place regions: has the file shrunk?

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def release(self) -> None:
        self.pin.release()
        self.tensor = None  # type: ignore[assignment]
        fn, self.closer = self.closer, None
        if fn is not None:
            fn()


def _run_jobs(jobs: list, fn) -> None:
    """Run ``fn`` on every job, across threads when there is more than one (torch and I/O drop the GIL)."""
    if len(jobs) <= 1 or COPY_THREADS == 1:
        for job in jobs:
            fn(job)
        return
    with ThreadPoolExecutor(COPY_THREADS) as ex:
        list(ex.map(fn, jobs))


def parallel_copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy ``src -> dst`` pairs of flat uint8 tensors, large ones split across threads."""
    jobs = [(dst[a: a + COPY_CHUNK], src[a: a + COPY_CHUNK])
            for dst, src in pairs for a in range(0, dst.numel(), COPY_CHUNK)]
    _run_jobs(jobs, lambda job: job[0].copy_(job[1]))


def parallel_read(reads: list[tuple[str, int, torch.Tensor]]) -> None:
    """Fill flat uint8 tensors from ``(path, file_offset, dst)``; short reads are errors."""
    jobs = []
    for path, off, dst in reads:
        for a in range(0, dst.numel(), COPY_CHUNK):
            jobs.append((path, off + a, dst[a: a + COPY_CHUNK]))

    def one(job) -> None:
        path, off, dst = job
        view = memoryview(dst.numpy()).cast("B")
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = os.preadv(f.fileno(), [view[got:]], off + got)
                if n <= 0:
                    raise OSError(f"{path}: file ended at byte {off + got} while reading a registered checkpoint")
                got += n

    try:
        _run_jobs(jobs, one)
    except OSError as exc:   # the file changed or vanished between validation and the copy
        raise CheckpointFormatError(f"reading the checkpoint failed: {exc}") from exc


MADV_POPULATE_WRITE = 23     # Linux >= 5.14
POPULATE_CHUNK = 64 << 20
_libc = None


def populate(ptr: int, size: int) -> bool:
    """Build the page tables of a fresh shared mapping from several threads at once.

    Pinning (cudaHostRegister) a mapping whose page tables exist runs ~2x faster,
    and faulting pages in scales with threads where MAP_POPULATE is one thread
    (benchmarks/pin_probe.py). Returns False where the kernel lacks
    MADV_POPULATE_WRITE; the pages are then faulted in by whoever touches them first.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = ptr - ptr % mmap.PAGESIZE
    end = ptr + size
    step = max(POPULATE_CHUNK, align_up(-(-(end - start) // COPY_THREADS), 2 << 20))
    chunks = [(a, min(step, end - a)) for a in range(start, end, step)]
    failed: list[int] = []

    def one(chunk) -> None:
        if _libc.madvise(chunk[0], chunk[1], MADV_POPULATE_WRITE) != 0:
            failed.append(ctypes.get_errno())

    _run_jobs(chunks, one)
    if failed and any(e not in (errno.EINVAL, errno.ENOSYS) for e in failed):
        # EFAULT/ENOMEM/EHWPOISON: the file is shorter than its mapping or memory ran out.
        raise CheckpointFormatError(f"cannot fault in a mapped checkpoint file: {os.strerror(failed[0])}")
    return not failed


def new_region(backend: DeviceBackend, rid: int, nbytes: int) -> HostRegion:
    tensor = backend.empty_host(nbytes)
    return HostRegion(rid, tensor)


def pin_region(backend: DeviceBackend, region: HostRegion) -> None:
    if backend.pins_host_memory and region.nbytes:
        region.pin = backend.pin(region.tensor)


def map_file_region(backend: DeviceBackend, rid: int, path: str, *, unlink: bool,
                    lap: Callable[[str], None] = lambda phase: None) -> HostRegion:
    """Map a whole file (a /dev/shm checkpoint) in place and pin it; nothing is copied.
    ``lap(phase)`` is called as each phase ends (populate, pin)."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED) if size else None
        fd = os.dup(f.fileno())   # to see the file shrink even after it was unlinked
    tensor = torch.frombuffer(mm, dtype=torch.uint8) if mm is not None else torch.empty(0, dtype=torch.uint8)
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
        if size:
            populate(tensor.data_ptr(), size)
        lap("populate in place")
        pin_region(backend, region)
        lap("pin in place")
    except BaseException:
        region.release()
        raise
    if unlink:
        os.unlink(path)  # asked for by the caller: frees the memory when we release the map
    return region


class SharedPool:
    """One pinned host region reused by successive checkpoints of the same (or smaller) size.

    RL loops register a new checkpoint every step; re-using the pinned pool
    skips the slow allocation and pinning. One checkpoint holds it at a time.
    """

    def __init__(self, backend: DeviceBackend):
        self.backend = backend
        self.region: HostRegion | None = None
        self.holder: str | None = None

    def acquire(self, name: str, nbytes: int, rid: int) -> HostRegion:
        if self.holder is not None:
            raise ConfigError(f"the shared memory pool is held by checkpoint {self.holder!r}; "
                              f"unregister it before registering {name!r} into the pool")
        if self.region is None or self.region.nbytes < nbytes:
            if self.region is not None:
                self.region.release()
            self.region = new_region(self.backend, rid, align_up(nbytes, 1 << 20))
            self.region.tensor.fill_(0)  # fault the pages in once, before pinning
            pin_region(self.backend, self.region)
        self.region.id = rid
        self.holder = name
        return self.region

    def give_back(self, name: str) -> None:
        if self.holder == name:
            self.holder = None

    def close(self) -> None:
        if self.region is not None:
            self.region.release()
        self.region, self.holder = None, None
