"""Probe: what does host memory cost the first time a process (or the machine) touches it?

Registration of named tensors allocates fresh host memory, faults it in and pins it. On a
virtual machine the hypervisor may back guest memory lazily, so the first touch of a page
that no process has used since boot can cost far more than touching a recycled page. This
probe separates that from our code: each round maps fresh anonymous memory and either only
faults it in (``madvise(MADV_POPULATE_WRITE)`` from the registration's threads) or runs the
registration's own fault-in-and-pin (``ckpt_core.checkpoint.host.fill_and_pin``), then frees it.

    python3 benchmarks/first_touch_probe.py --gib 8 --procs 2 [--threads 8,16] [--kind cuda] [--out probe.json]

Rounds, per process, all processes at once (like the PS ranks of one host), for each thread
count T of --threads (the registration's PS_FAULT_THREADS):
  cold-populate+pin/T   fresh region, fault in and pin (kept, so later rounds get unused pages)
  cold-populate/T       fresh region, fault in only (kept); then every region is freed and
  warm-populate/T       fresh region, fault in only: the pages come from what was freed
  warm-populate+pin/T   fresh region, fault in and pin
"Cold" means first use only when this probe is the first big user of the host's memory.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_core.checkpoint.host import fill_and_pin, new_region, populate_jobs, run_jobs  # noqa: E402
from ckpt_core._settings import fault_threads  # noqa: E402
from ckpt_core.devices import get_backend  # noqa: E402

GiB = 1 << 30


def _round(backend, nbytes: int, pin: bool, threads: int):
    region = new_region(backend, 0, nbytes)
    t0 = time.perf_counter()
    if pin:
        fill_and_pin(backend, region, populate_jobs(region), threads)
    else:
        run_jobs(populate_jobs(region), threads)
    return region, time.perf_counter() - t0


def _proc(kind: str, nbytes: int, threads: list[int], start, queue) -> None:
    backend = get_backend(kind)
    if kind == "cuda":
        import torch
        torch.cuda.init()
    start.wait()
    out, held = {}, []
    pin = backend.pins_host_memory
    for t in threads:
        for label, p in (("cold-populate+pin", pin), ("cold-populate", False)):
            region, out[f"{label}/{t}"] = _round(backend, nbytes, p, t)
            held.append(region)
    for region in held:
        region.release()
    for t in threads:
        for label, p in (("warm-populate", False), ("warm-populate+pin", pin)):
            region, out[f"{label}/{t}"] = _round(backend, nbytes, p, t)
            region.release()
    queue.put(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB per process and round")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--threads", default=str(fault_threads()), help="comma-separated thread counts to compare")
    ap.add_argument("--kind", default="cuda", help="device backend that pins (cuda) or not (cpu)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    nbytes = int(args.gib * GiB)
    threads = [int(t) for t in args.threads.split(",") if t]
    ctx = mp.get_context("spawn")
    start, queue = ctx.Barrier(args.procs), ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(args.kind, nbytes, threads, start, queue)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    report = {"gib_per_proc": args.gib, "procs": args.procs, "kind": args.kind, "threads": threads,
              "per_proc": results}
    print(f"first-touch probe: {args.procs} process(es) at once, {args.gib:g} GiB each, kind {args.kind}")
    for key in results[0]:
        worst = max(r[key] for r in results)
        print(f"  {key:24s} {worst:7.3f} s  ({args.gib / worst:6.2f} GiB/s per process, slowest process)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
