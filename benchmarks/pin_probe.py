"""Probe: how fast can a /dev/shm checkpoint file be mapped and pinned in place?

Times the ways to pin a file-backed mapping with cudaHostRegister (whole, pre-populated,
split across threads), so the in-place registration path can use the fastest.
    python3 benchmarks/pin_probe.py [--gib 4] [--out probe.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def register(cudart, ptr: int, size: int, threads: int) -> list:
    if threads <= 1:
        assert int(cudart.cudaHostRegister(ptr, size, 0)) == 0
        return [(ptr, size)]
    step = (size // threads + 4095) // 4096 * 4096
    parts = [(ptr + a, min(step, size - a)) for a in range(0, size, step)]
    with ThreadPoolExecutor(threads) as ex:
        errs = list(ex.map(lambda p: int(cudart.cudaHostRegister(p[0], p[1], 0)), parts))
    assert not any(errs), errs
    return parts


MADV_POPULATE_WRITE = 23   # Linux >= 5.14


def populate_in_threads(ptr: int, size: int, threads: int) -> None:
    """Fault the mapping in from several threads at once (madvise(MADV_POPULATE_WRITE) per chunk)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    step = max(2 << 20, (size // threads + (2 << 20) - 1) // (2 << 20) * (2 << 20))

    def one(a: int) -> int:
        return libc.madvise(ptr + a, min(step, size - a), MADV_POPULATE_WRITE)

    with ThreadPoolExecutor(threads) as ex:
        errs = list(ex.map(one, range(0, size, step)))
    assert not any(errs), f"madvise failed: errno {ctypes.get_errno()}"


def one(path: str, size: int, *, populate: str, threads: int, flags: int = 0) -> dict:
    """populate: "none", "map" (MAP_POPULATE) or "threads" (madvise from ``threads`` threads, one register)."""
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDWR)
    mflags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate == "map" else 0)
    mm = mmap.mmap(fd, size, flags=mflags)
    os.close(fd)
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    if populate == "threads":
        populate_in_threads(buf.data_ptr(), size, threads)
    t_map = time.perf_counter() - t0
    if populate == "threads":
        assert int(cudart.cudaHostRegister(buf.data_ptr(), size, flags)) == 0
        parts = [(buf.data_ptr(), size)]
    else:
        parts = register(cudart, buf.data_ptr(), size, threads)
    t_total = time.perf_counter() - t0
    # One copy may not span two registrations (cudaErrorInvalidValue): copy part by part.
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for p, n in parts:
        a = p - buf.data_ptr()
        dev[a: a + n].copy_(buf[a: a + n], non_blocking=True)
    torch.cuda.synchronize()
    h2d = size / (time.perf_counter() - t1) / 1e9
    for p, _ in parts:
        cudart.cudaHostUnregister(p)
    del buf, dev
    mm.close()
    return {"populate": populate, "threads": threads, "flags": flags, "map_s": t_map, "total_s": t_total,
            "gbps": size / t_total / 1e9, "h2d_gbps_after": h2d}


def alloc_fill_pin(src: torch.Tensor, method: str, threads: int = 8) -> dict:
    """Named-tensor registration's path: allocate a host buffer, copy into it, pin it.
    method: "torch" (torch.empty), "anon" (mmap + threaded populate), "anon-huge" (+ MADV_HUGEPAGE)."""
    cudart = torch.cuda.cudart()
    size = src.numel()
    t0 = time.perf_counter()
    mm = None
    if method == "torch":
        buf = torch.empty(size, dtype=torch.uint8)
    else:
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if method == "anon-huge":
            mm.madvise(mmap.MADV_HUGEPAGE)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        populate_in_threads(buf.data_ptr(), size, threads)
    t1 = time.perf_counter()
    step = (size + threads - 1) // threads
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda a: buf[a: a + step].copy_(src[a: a + step]), range(0, size, step)))
    t2 = time.perf_counter()
    assert int(cudart.cudaHostRegister(buf.data_ptr(), size, 0)) == 0
    t3 = time.perf_counter()
    cudart.cudaHostUnregister(buf.data_ptr())
    del buf
    if mm is not None:
        mm.close()
    return {"method": method, "alloc_s": t1 - t0, "fill_s": t2 - t1, "pin_s": t3 - t2, "total_s": t3 - t0,
            "gbps": size / (t3 - t0) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    size = int(args.gib * (1 << 30))
    path = f"/dev/shm/ckpt-pin-probe-{os.getpid()}"
    with open(path, "wb") as f:
        chunk = os.urandom(64 << 20)
        for a in range(0, size, len(chunk)):
            f.write(chunk[: min(len(chunk), size - a)])
    try:
        rows = [one(path, size, populate=p, threads=t) for p in ("none", "map") for t in (1, 8)]
        rows += [one(path, size, populate="threads", threads=t) for t in (2, 4, 8, 16)]
        rows += [one(path, size, populate="threads", threads=8, flags=8)]   # cudaHostRegisterReadOnly
    finally:
        os.unlink(path)
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    alloc_rows = [alloc_fill_pin(src, m) for m in ("torch", "anon", "anon-huge", "torch", "anon", "anon-huge")]
    for r in alloc_rows:
        print(f"alloc {r['method']:9}  alloc {r['alloc_s']:.3f} s  fill {r['fill_s']:.3f} s  pin {r['pin_s']:.3f} s"
              f"  = {r['gbps']:.1f} GB/s")
    for r in rows:
        print(f"populate={r['populate']:7} threads={r['threads']:2} flags={r['flags']}  map {r['map_s']:.3f} s  "
              f"map+pin {r['total_s']:.3f} s = {r['gbps']:.1f} GB/s  (H2D after: {r['h2d_gbps_after']:.1f} GB/s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gib": args.gib, "rows": rows, "alloc_rows": alloc_rows}, f, indent=1)


if __name__ == "__main__":
    main()
