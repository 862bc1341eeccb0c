"""Host regions are filled by several threads and pinned piece by piece as the pieces are complete."""

import threading
import time

import pytest
import torch

from ckpt_core.checkpoint import host as _host
from ckpt_core.checkpoint.host import HostRegion, copy_jobs, fill_and_pin, populate_jobs
from ckpt_core.devices import HostPin, get_backend


class RecordingBackend:
    """Stands in for the cuda kind's pin(): records what is pinned, and when."""
    pins_host_memory = True

    def __init__(self, fail_at: int | None = None):
        self.pinned: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def pin(self, t: torch.Tensor) -> HostPin:
        rng = (t.data_ptr(), t.numel())
        if self.fail_at is not None and len(self.pinned) == self.fail_at:
            raise RuntimeError("cudaHostRegister failed")
        with self.lock:
            self.pinned.append(rng)
        return HostPin(lambda: self.released.append(rng))

    def empty_host(self, nbytes: int) -> torch.Tensor:
        return get_backend("cpu").empty_host(nbytes)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(_host, "PIN_CHUNK", 1 << 20)
    monkeypatch.setattr(_host, "COPY_CHUNK", 1 << 18)
    return 1 << 20


def test_every_piece_is_pinned_once_after_its_copies_finished(small_chunks):
    backend = RecordingBackend()
    region = HostRegion(0, get_backend("cpu").empty_host(5 * small_chunks + 4096))
    src = torch.randint(0, 255, (region.nbytes,), dtype=torch.uint8)
    done: list[int] = []
    jobs = [(a, b, (lambda fn=fn, b=b: (fn(), done.append(b)))) for a, b, fn in copy_jobs(region, [(region.tensor, src)])]
    real_pin = backend.pin

    def pin(t):
        end = t.data_ptr() - region.tensor.data_ptr() + t.numel()
        assert all(b in done for _, b, _ in jobs if b <= end), "pinned before its copies finished"
        return real_pin(t)

    backend.pin = pin
    fill_and_pin(backend, region, jobs)
    assert torch.equal(region.tensor, src)
    base = region.tensor.data_ptr()
    assert [(p - base, n) for p, n in backend.pinned] == [(a, min(small_chunks, region.nbytes - a))
                                                         for a in range(0, region.nbytes, small_chunks)]
    region.release()
    assert sorted(backend.released) == sorted(backend.pinned)


def test_a_failing_pin_unpins_what_was_pinned_and_raises(small_chunks):
    backend = RecordingBackend(fail_at=2)
    region = HostRegion(0, get_backend("cpu").empty_host(4 * small_chunks))
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        fill_and_pin(backend, region, populate_jobs(region))
    assert len(backend.pinned) == 2 and sorted(backend.released) == sorted(backend.pinned)


def test_a_failing_copy_is_raised_and_nothing_stays_pinned(small_chunks):
    backend = RecordingBackend()
    region = HostRegion(0, get_backend("cpu").empty_host(3 * small_chunks))

    def boom():
        raise OSError("disk gone")

    jobs = populate_jobs(region)
    jobs[len(jobs) // 2] = (jobs[len(jobs) // 2][0], jobs[len(jobs) // 2][1], boom)
    with pytest.raises(OSError, match="disk gone"):
        fill_and_pin(backend, region, jobs)
    assert sorted(backend.released) == sorted(backend.pinned)


def test_populate_covers_the_whole_region_and_leaves_its_bytes_alone():
    region = HostRegion(0, get_backend("cpu").empty_host(3 * (1 << 20) + 123))
    region.tensor.fill_(7)
    jobs = populate_jobs(region)
    assert jobs[0][0] == 0 and jobs[-1][1] == region.nbytes
    assert all(a[1] == b[0] for a, b in zip(jobs, jobs[1:]))
    for _, _, fn in jobs:
        fn()
    assert int(region.tensor.min()) == 7 == int(region.tensor.max())


def test_populating_a_map_of_a_file_that_shrank_is_a_format_error_not_sigbus(tmp_path):
    """A /dev/shm file cut short after it was mapped: touching the lost pages would kill the PS
    with SIGBUS; populating them is refused (EFAULT) and reported as a CheckpointFormatError."""
    import mmap
    import os
    from ckpt_core.errors import CheckpointFormatError

    path = "/dev/shm/ckpt-test-shrunk-%d" % os.getpid()
    with open(path, "wb") as f:
        f.truncate(4 << 20)
    try:
        with open(path, "r+b") as f:
            mm = mmap.mmap(f.fileno(), 4 << 20, flags=mmap.MAP_SHARED)
        os.truncate(path, 4096)
        region = HostRegion(0, torch.frombuffer(mm, dtype=torch.uint8))
        with pytest.raises(CheckpointFormatError, match="cannot fault in"):
            for _, _, fn in populate_jobs(region):
                fn()
        del region
    finally:
        os.unlink(path)


@pytest.mark.parametrize("threads", [1, 3])
def test_faulting_in_runs_on_PS_FAULT_THREADS_threads(monkeypatch, small_chunks, threads):
    lock, running, most = threading.Lock(), [0], [0]
    real = _host.populate_jobs

    def slow(fn):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        fn()
        with lock:
            running[0] -= 1

    monkeypatch.setattr(_host, "populate_jobs", lambda region: [(a, b, lambda fn=fn: slow(fn)) for a, b, fn in real(region)])
    monkeypatch.setenv("PS_FAULT_THREADS", str(threads))
    backend = RecordingBackend()
    pool = _host.SharedPool(backend)
    region = pool.acquire("a", 6 * small_chunks, 0)
    assert most[0] == threads and len(backend.pinned) == region.nbytes // small_chunks
    pool.close()


@pytest.mark.parametrize("raw", ["0", "-3", "four"])
def test_a_bad_PS_FAULT_THREADS_is_a_config_error_and_nothing_stays_allocated(monkeypatch, raw):
    from ckpt_core.errors import ConfigError
    monkeypatch.setenv("PS_FAULT_THREADS", raw)
    backend = RecordingBackend()
    pool = _host.SharedPool(backend)
    with pytest.raises(ConfigError, match="PS_FAULT_THREADS"):
        pool.acquire("a", 1 << 20, 0)
    assert pool.regions == [] and backend.pinned == []


def test_copy_pieces_never_cross_a_pinned_range_of_the_region(monkeypatch):
    """A device-to-host copy into two separately pinned ranges is refused by CUDA: the copy jobs of a
    view that starts anywhere in the region are cut at the region's COPY_CHUNK multiples."""
    import torch

    from ckpt_core.checkpoint import host

    monkeypatch.setattr(host, "COPY_CHUNK", 64)
    region = host.HostRegion(0, torch.zeros(1000, dtype=torch.uint8))
    src = torch.arange(700, dtype=torch.int64).to(torch.uint8)
    dst = region.tensor[37:737]
    jobs = host.copy_jobs(region, [(dst, src)])
    spans = [(a, b) for a, b, _ in jobs]
    assert spans[0] == (37, 64) and spans[-1][1] == 737
    assert all(b - a <= 64 and a // 64 == (b - 1) // 64 for a, b in spans), spans
    assert [b for _, b in spans[:-1]] == [a for a, _ in spans[1:]], "the pieces tile the view"
    host.run_jobs(jobs, threads=2)
    assert torch.equal(dst, src)


def test_successive_host_buffers_start_at_different_page_offsets_into_their_mappings(monkeypatch):
    """Two versions compared word by word whose buffers lay a multiple of 1 GiB apart compared 1.8x
    slower on a CPU machine: each buffer starts HOST_COLOR_PAGES pages further into its mapping than
    the one before (HOST_COLORS offsets in turn), page-aligned, and its bytes are its own."""
    import mmap as _mmap

    import numpy as np

    from ckpt_core.devices import _base
    maps = []

    def fake_mmap(fd, size, **kw):   # an anonymous mapping whose start we can read
        buf = bytearray(size + _mmap.PAGESIZE)
        skip = -np.frombuffer(buf, dtype=np.uint8).ctypes.data % _mmap.PAGESIZE
        view = memoryview(buf)[skip: skip + size]
        maps.append((np.frombuffer(view, dtype=np.uint8).ctypes.data, size))
        return view
    monkeypatch.setattr(_base.mmap, "mmap", fake_mmap)
    backend = get_backend("cpu")
    step = _base.HOST_COLOR_PAGES * _mmap.PAGESIZE
    offsets = []
    for _ in range(_base.HOST_COLORS):
        t = backend.empty_host(3 * _mmap.PAGESIZE + 5)
        start, size = maps[-1]
        off = t.data_ptr() - start
        assert t.numel() == 3 * _mmap.PAGESIZE + 5 and off % _mmap.PAGESIZE == 0 and off + t.numel() <= size
        offsets.append(off)
    assert sorted(offsets) == [k * step for k in range(_base.HOST_COLORS)]


def test_small_jobs_are_grouped_in_order_and_large_ones_stay_alone():
    """Registering thousands of small tensors paid the thread pool's cost per copy job: consecutive
    jobs run together up to GROUP_BYTES, in order, each group spanning its first start to its last end."""
    done = []
    sizes = [10, 20, 30, 100, 5, 5, 200, 1, 1]
    jobs, at = [], 0
    for i, n in enumerate(sizes):
        jobs.append((at, at + n, lambda i=i: done.append(i)))
        at += n + 3   # room between tensors (their alignment)
    groups = _host.grouped(jobs, max_bytes=60)
    spans = [(a, b) for a, b, _ in groups]
    assert spans == [(0, 66), (69, 169), (172, 185), (188, 388), (391, 396)]
    for _, _, fn in groups:
        fn()
    assert done == list(range(len(sizes)))
    assert _host.grouped([]) == [] and _host.grouped(jobs[:1]) == jobs[:1]
