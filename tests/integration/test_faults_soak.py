"""200 back-to-back updates in one world (plus 20 failed-and-retried ones): host memory,
descriptors, threads and /dev/shm of the PS and engine-worker processes stay flat.

The figures are printed (``pytest -s``) and appended to $CKPT_FAULT_TABLE for the issue note.
"""

from __future__ import annotations

import math
import os
import time

from support.asserts import report_case
from support.engine import EngineFront
from support.procs import process_footprint, shm_footprint
from support.world import FreshCheckpoints, PsWorld

MiB = 1 << 20
UPDATES = 200
FAILED = 20
RSS_SLACK = 24 * MiB        # allocator noise of a Python process over hundreds of updates
FD_SLACK = 4


def ours(prefixes: list[str]) -> list[str]:
    """This world's IPC buffers in /dev/shm (other sessions may use /dev/shm at the same time)."""
    return [n for n in os.listdir("/dev/shm") if any(n.startswith(p) for p in prefixes)]


def snapshot(pids: dict[str, int], prefixes: list[str]) -> dict:
    return {"proc": {who: process_footprint(pid) for who, pid in pids.items()}, "shm": shm_footprint(),
            "ours": sum(os.path.getsize(f"/dev/shm/{n}") for n in ours(prefixes))}


def test_two_hundred_updates_leave_memory_descriptors_and_shm_flat():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init={"max_bucket_gb": (256 << 10) / (1 << 30)})
    try:
        ckpts = FreshCheckpoints(ps, seed=200, per_rank=8, numel=64 << 10)   # 8 tensors of up to 256 KiB per rank
        a, _ = ckpts.new("A")
        b, want_b = ckpts.new("B")
        prefixes = [o.value for o in ps.all("ipc_prefix").values()]
        pids = {f"ps{r}": pid for r, pid in enumerate(ps.pids)}
        pids.update({f"worker{i}": p.pid for i, p in enumerate(front.procs)})
        warm = ps.all("updates", ([a, b] * 10, front.address, 30.0), timeout=120)   # warm-up: caches, allocator
        assert all(all(k == "ok" for k, _ in o.value) for o in warm.values()), warm
        before = snapshot(pids, prefixes)

        t0 = time.monotonic()
        got = ps.all("updates", ([a, b] * (UPDATES // 2), front.address, 30.0), timeout=600)
        wall = time.monotonic() - t0
        for r, o in got.items():
            assert o.ok and len(o.value) == UPDATES and all(k == "ok" for k, _ in o.value), (r, o)
        mid = snapshot(pids, prefixes)
        assert all(front.digests(i) == want_b for i in range(2)), "B was pushed last"

        # failures must not leak either: every other update fails on one engine, then is retried
        faults = {k: {k % 2: {"fail_bucket": k % 3}} for k in range(0, 2 * FAILED, 2)}
        got = ps.all("updates", ([a, a] * FAILED, front.address, 30.0, faults), timeout=300)
        for r, o in got.items():
            kinds = [k for k, _ in o.value]
            assert kinds == ["RemoteWorkerError", "ok"] * FAILED, (r, kinds)
        after = snapshot(pids, prefixes)
        assert ours(prefixes) == [], "IPC buffers left in /dev/shm"
    finally:
        ps.close()
        front.close()

    per_update = wall / UPDATES
    for who in pids:
        b0, b1, b2 = before["proc"][who], mid["proc"][who], after["proc"][who]
        report_case(f"soak {who}: RSS MiB before / after {UPDATES} / after {FAILED} failed+retried",
                    f"{b0['rss'] / MiB:.1f} / {b1['rss'] / MiB:.1f} / {b2['rss'] / MiB:.1f}; "
                    f"fds {b0['fds']}/{b1['fds']}/{b2['fds']}; threads {b0['threads']}/{b1['threads']}/{b2['threads']}",
                    None)
    report_case("soak /dev/shm: this world's IPC bytes before / after / after failures; "
                "whole tmpfs used MiB (shared with other sessions)",
                f"{before['ours']} / {mid['ours']} / {after['ours']} B; "
                f"{before['shm']['used'] / MiB:.1f} / {mid['shm']['used'] / MiB:.1f} / {after['shm']['used'] / MiB:.1f}",
                None)
    report_case(f"soak: {UPDATES} updates of {ckpts_bytes(ckpts) / MiB:.1f} MiB", f"{per_update * 1000:.0f} ms per update",
                wall)
    for who in pids:
        b0, b2 = before["proc"][who], after["proc"][who]
        assert b2["rss"] - b0["rss"] < RSS_SLACK, f"{who}: RSS grew {(b2['rss'] - b0['rss']) / MiB:.1f} MiB"
        assert b2["fds"] - b0["fds"] <= FD_SLACK, f"{who}: descriptors {b0['fds']} -> {b2['fds']}"
        assert b2["threads"] <= b0["threads"] + 2, f"{who}: threads {b0['threads']} -> {b2['threads']}"
    assert before["ours"] == mid["ours"] == after["ours"] == 0, "IPC buffers outlived their update"


def ckpts_bytes(ckpts: FreshCheckpoints) -> int:
    return sum(math.prod(shape) * dtype.itemsize for layout in ckpts.layout.values() for shape, dtype in layout.values())
