"""Probe: our own per-tensor CPU work of one update, in one process (issue 38).

Plans a case whole and for one engine rank of ``--tp`` (as ``update_bench --tp`` with one device
does), then times, as CPU time of this thread (best of ``--repeats``, so that a loaded machine
blurs it less than wall time), what every update repeats: the PS's staging of the buckets into a
slot (the owner's copies: runs, pitched slices) and the worker's views of every bucket's tensors;
and, once per plan, the planning and the worker's validation of the hello. No processes, sockets,
collectives or engine: those are update_bench's. Per tensor = (staging - bytes at this thread's
memcpy rate) / tensors, and views / tensors::

    python3 benchmarks/pertensor_probe.py --case moe8 --scale 0.01 --tp 8
    python3 benchmarks/pertensor_probe.py --root /path/to/another/checkout   # the same probe, its code
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="moe8")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--root", default=os.path.dirname(HERE), help="the checkout whose ckpt_core is probed")
    p.add_argument("--out", default=None, help="JSON of the figures")
    args = p.parse_args(argv)
    sys.path[:0] = [args.root, os.path.join(args.root, "benchmarks"), HERE]
    import torch
    from _bench_cases import build_case
    from _bench_tp import tp_dims

    from ckpt_core.checkpoint.safetensors import WIRE_CODES
    from ckpt_core.planning.buckets import TensorMeta, align_up
    from ckpt_core.planning.slices import SliceKey, SlicePlan, split_plan

    torch.set_num_threads(1)
    specs = build_case(args.case, args.scale)
    metas, off = [], 0
    for s in specs:   # one host buffer, tensors back to back (64-byte aligned), as a registration lays them out
        off = align_up(off, 64)
        metas.append(TensorMeta(s.name, WIRE_CODES[s.dtype], tuple(s.shape), s.nbytes, s.dtype.itemsize, 0, off))
        off += s.nbytes
    host = torch.empty(off, dtype=torch.uint8).random_(0, 255)
    tensors = {s.name: (WIRE_CODES[s.dtype], tuple(s.shape), s.dtype.itemsize) for s in specs}
    split = split_plan(SliceKey("probe", f"tp={args.tp}", "sim"), tensors, args.tp, tp_dims(specs))
    one = SlicePlan(SliceKey("probe", f"tp={args.tp},rank=0", "sim"), tensors, (replace(split.ranks[0], rank=0),))
    best = lambda fn: min(_cpu(fn) for _ in range(args.repeats))   # noqa: E731
    scratch = torch.empty(off, dtype=torch.uint8)
    rate = off / best(lambda: scratch.copy_(host))
    out = {"case": args.case, "scale": args.scale, "tp": args.tp, "root": args.root, "tensors": len(specs),
           "memcpy_gbps": rate / 1e9}
    for label, slices in (("whole", None), (f"sliced tp{args.tp}", one)):
        out[label] = probe(metas, host, slices, rate, best)
        print(f"{args.case} x{args.scale} {label}: " + line(out[label]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def _cpu(fn) -> float:
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def probe(metas, host, slices, rate: float, best) -> dict:
    """One layout's figures: planned as the PS plans it with all device memory free."""
    import torch

    from ckpt_core.devices import get_backend
    from ckpt_core.planning.buckets import align_up, choose_layout
    from ckpt_core.planning.slice_routes import SlicedBucket
    from ckpt_core.transfer.pipeline import pitched_copies
    from ckpt_core.transfer.plan_cache import PlanCache
    from ckpt_core.wire import protocol as proto

    cache = PlanCache()
    digest = cache.digest("probe", [metas])
    t0 = time.thread_time()
    try:
        sizes = cache.sizes([metas], digest, slices)
    except TypeError:   # a checkout from before sliced layouts (issue 38)
        sizes = cache.sizes([metas], digest)
    bucket, _ = choose_layout(1 << 40, mem_fraction=0.9, max_slots=4, max_bucket_bytes=1 << 40,
                              largest_tensor=sizes[0], largest_owner_total=sizes[1])
    plan, (text, plan_digest) = cache.get([metas], digest, bucket, slices=slices, rank=0)
    plan_s = time.thread_time() - t0
    slot = torch.empty(align_up(plan.largest_bucket), dtype=torch.uint8)
    head, frame = proto.encode_hello("probe-0", device_kind="cpu", buffer={"nbytes": slot.numel()},
                                     slot_bytes=slot.numel(), num_slots=1, plan_json=text, plan_digest=plan_digest)
    proto._plan_cache.clear()
    parse_s = _cpu(lambda: proto.parse_hello(json.loads(head), frame))
    hello = proto.parse_hello(json.loads(head), frame)
    backend = get_backend("cpu")
    copies = [(b, pitched_copies(b, 0)) if isinstance(b, SlicedBucket) else (b, None) for b in plan.buckets]

    def stage() -> None:
        for b, pitched in copies:
            if pitched is None:
                for r in b.copy_runs:
                    slot[r.offset: r.offset + r.nbytes].copy_(host[r.base_offset: r.base_offset + r.nbytes])
            else:
                for _, cs in pitched:
                    backend.copy_pitched(slot, host, cs)

    view_all = _viewer(slot, hello)
    stage_s, views_s = best(stage), best(view_all)
    n, nbytes = sum(len(b) for b in hello.buckets), plan.total_bytes
    return {"tensors": n, "bytes": nbytes, "buckets": len(plan.buckets), "bucket_bytes": bucket,
            "copies": sum(len(b.copy_runs) if p is None else sum(len(c) for _, c in p) for b, p in copies),
            "plan_once_s": plan_s, "hello_once_s": parse_s, "ps_stage_s": stage_s, "floor_s": nbytes / rate,
            "ps_us": (stage_s - nbytes / rate) / n * 1e6, "worker_views_s": views_s, "worker_us": views_s / n * 1e6}


def _viewer(slot, hello):
    """The worker's views of every bucket, with whichever route the probed checkout has."""
    try:
        from ckpt_core.wire.views import Views
        views = Views(slot)
        return lambda: [views.bucket(0, b, hello.views[i]) for i, b in enumerate(hello.buckets)]
    except ImportError:   # a checkout from before batched views (issue 38)
        from ckpt_core.wire.worker import _Views
        old = _Views(slot)
        return lambda: [old.bucket(0, b) for b in hello.buckets]


def line(o: dict) -> str:
    return (f"{o['tensors']} tensors, {o['bytes'] / 2**20:.1f} MiB in {o['buckets']} buckets of "
            f"{o['bucket_bytes'] / 2**20:.1f} MiB, {o['copies']} copies; once per plan: plan "
            f"{o['plan_once_s'] * 1e3:.1f} ms, "
            f"hello {o['hello_once_s'] * 1e3:.1f} ms; per update: PS staging {o['ps_stage_s'] * 1e3:.2f} ms (floor "
            f"{o['floor_s'] * 1e3:.2f} ms), {o['ps_us']:.2f} us/tensor above it; worker views "
            f"{o['worker_views_s'] * 1e3:.2f} ms, {o['worker_us']:.2f} us/tensor")


if __name__ == "__main__":
    sys.exit(main())
