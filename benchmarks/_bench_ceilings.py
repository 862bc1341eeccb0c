"""The machine's ceilings, measured in the same run as the updates.

* H2D: every rank copies ``h2d_bytes`` from a pinned host buffer into its device at
  the same time (barrier first), timed with device events; best of ``repeats``.
* Broadcast: ``bcast_bytes`` on the data process group from each source rank in
  turn; the slowest source's best time gives the rate (bytes a receiver gets per second).
* Host fault-in: every rank maps ``host_bytes`` of fresh anonymous memory and faults it in
  with the registration's own threads, twice (freeing it in between). On a host whose
  memory no process has used yet (a freshly booted VM backs guest pages lazily) the first
  pass pays the first-use cost and the second shows the rate for recycled pages, which is
  what a long-running trainer host sees. The first pass also leaves the host warm for the
  registrations that follow; both rates are reported so that nothing is hidden.
On ``cpu`` the "H2D" is a host memcpy and the broadcast goes over gloo: numbers that
only make the floor defined, not a statement about hardware.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def _timer(kind: str):
    if kind == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin():
            start.record()

        def end() -> float:
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        return begin, end
    box = [0.0]

    def begin_cpu():
        box[0] = time.perf_counter()

    def end_cpu() -> float:
        return time.perf_counter() - box[0]
    return begin_cpu, end_cpu


def _sync(kind: str) -> None:
    if kind == "cuda":
        torch.cuda.synchronize()


def measure_h2d(kind: str, device: torch.device, nbytes: int, ctrl, repeats: int = 3) -> float:
    """GB/s of this rank's pinned host -> device copy while every rank copies."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(7)
    pin = None
    if kind == "cuda":
        from ckpt_core.devices import get_backend
        pin = get_backend("cuda").pin(host)   # cudaHostRegister: far faster than pin_memory=True
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    begin, end = _timer(kind)
    best = float("inf")
    try:
        for i in range(repeats + 1):     # the first pass warms up
            dist.barrier(group=ctrl)
            _sync(kind)
            begin()
            dst.copy_(host, non_blocking=True)
            dt = end()
            if i:
                best = min(best, dt)
    finally:
        del dst
        if pin is not None:
            pin.release()
    return nbytes / best / 1e9


def measure_broadcast(kind: str, device: torch.device, nbytes: int, ctrl, repeats: int = 3) -> float | None:
    """GB/s one receiver gets from a device broadcast (None on a single rank)."""
    world = dist.get_world_size()
    if world == 1:
        return None
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dist.broadcast(buf, 0)          # warm-up: communicator creation
    _sync(kind)
    worst = 0.0
    for src in range(world):
        best = float("inf")
        for _ in range(repeats):
            dist.barrier(group=ctrl)
            _sync(kind)
            t0 = time.perf_counter()
            dist.broadcast(buf, src)
            _sync(kind)
            best = min(best, time.perf_counter() - t0)
        worst = max(worst, best)
    del buf
    return nbytes / worst / 1e9


def measure_host_fault_in(nbytes: int, ctrl) -> dict:
    """GB/s of faulting in fresh host memory with the registration's threads: first use, then recycled."""
    from ckpt_core.checkpoint.host import new_region, populate_and_pin
    from ckpt_core.devices import get_backend
    rates = {}
    for label in ("first", "recycled"):
        cpu = get_backend("cpu")   # faults in without pinning
        region = new_region(cpu, 0, nbytes)
        try:
            dist.barrier(group=ctrl)
            t0 = time.perf_counter()
            populate_and_pin(cpu, region)
            rates[label] = nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            region.release()
    return {"host_fault_in_first_gbps": rates["first"], "host_fault_in_recycled_gbps": rates["recycled"],
            "host_fault_in_bytes": nbytes}


def measure(kind: str, device: torch.device, ctrl, *, h2d_bytes: int, bcast_bytes: int, host_bytes: int = 0) -> dict:
    """This rank's ceilings; call on every rank at the same time."""
    host = measure_host_fault_in(host_bytes, ctrl) if host_bytes > 0 else {}
    h2d = measure_h2d(kind, device, h2d_bytes, ctrl)
    bcast = measure_broadcast(kind, device, bcast_bytes, ctrl)
    if kind == "cuda":
        torch.cuda.empty_cache()
    return {"h2d_gbps": h2d, "broadcast_gbps": bcast, "h2d_bytes": h2d_bytes, "broadcast_bytes": bcast_bytes, **host}
