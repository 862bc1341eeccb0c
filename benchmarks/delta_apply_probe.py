"""Probe: where a delta's apply and post-apply check spend their time on a device (issue 39).

Builds bf16 tensors on the device (``--mib`` in all, ``--tensors`` of them), changes ``--density`` of
their elements at random (one bit each), encodes each delta on the host (``encode_tensor``, the
registration's encoder) and puts the payloads on the device, as the engine worker receives them.
Then times, each phase synchronised on its own (best of ``--repeats``):

- ``decode``: ``decode_many`` (headers, the body checks, positions decoded and checked);
- ``apply``: ``apply_decoded`` of each (the old values gathered for the undo, the new scattered);
- ``apply_many``: the same as one launch for all (``scatter_swap_many``; with ``CKPT_DELTA_TRITON=1`` only);
- ``check``: ``lin64_many`` of every changed tensor (the post-apply digest);
- ``undo``: ``undo_decoded`` (a failed update's path; the tensors return to their base).

and, with ``--profile``, the top device kernels of one decode+apply+check (torch.profiler). The
figures scale with the bytes: an update of 16 GiB at the same density costs ~16384 / ``--mib`` times::

    python3 benchmarks/delta_apply_probe.py --mib 2048 --tensors 48 --density 0.02 --profile --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]


def _timed(fn, sync, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _with_torch(fn, *a):
    chosen = os.environ.get("CKPT_DELTA_TRITON")
    os.environ["CKPT_DELTA_TRITON"] = "0"
    try:
        return fn(*a)
    finally:
        os.environ.pop("CKPT_DELTA_TRITON")
        if chosen is not None:
            os.environ["CKPT_DELTA_TRITON"] = chosen


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=1024, help="bytes of all tensors, MiB")
    p.add_argument("--tensors", type=int, default=24)
    p.add_argument("--density", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--encodings", default="", help="force one encoding (idx, gap16, bitmap, runs); default: chosen")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from ckpt_core.delta.encode import apply_decoded, decode_many, encode_tensor, undo_decoded
    from ckpt_core.delta.lin64 import lin64_many

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    numel = args.mib * 2**20 // 2 // args.tensors
    gen = torch.Generator().manual_seed(0)
    bases, news, payloads, counts = [], [], [], 0
    t0 = time.perf_counter()
    for i in range(args.tensors):
        base = torch.randint(-2**15, 2**15, (numel,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
        new = base.clone()
        k = max(1, int(numel * args.density))
        pos = torch.randperm(numel, generator=gen)[:k]
        new.view(torch.int16)[pos] ^= 1
        payload, info = encode_tensor(new, base, force=args.encodings or None)
        counts += info["count"]
        bases.append(base.to(dev))
        news.append(new)
        payloads.append((f"t{i}", payload.to(dev)))
    sync()
    encode_s = time.perf_counter() - t0
    live = [b.clone() for b in bases]
    figures = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "mib": args.mib,
               "tensors": args.tensors, "density": args.density, "changed": counts,
               "payload_bytes": sum(t.numel() for _, t in payloads), "host_encode_s": encode_s}

    decoded = decode_many(payloads)

    def apply():
        return [apply_decoded(t, d) for t, d in zip(live, decoded)]

    def undo(olds):
        for t, d, old in zip(live, decoded, olds):
            undo_decoded(t, d, old)

    figures["decode_s"] = _timed(lambda: decode_many(payloads), sync, args.repeats)
    best_apply = float("inf")
    for _ in range(args.repeats):
        sync()
        t1 = time.perf_counter()
        olds = apply()
        sync()
        best_apply = min(best_apply, time.perf_counter() - t1)
        t2 = time.perf_counter()
        undo(olds)
        sync()
        figures["undo_s"] = min(figures.get("undo_s", float("inf")), time.perf_counter() - t2)
    figures["apply_s"] = best_apply
    # the same scatters as one launch for the lot (what a receiver's bucket does with the Triton kernels)
    from ckpt_core.delta._kernels import scatter_swap_many
    from ckpt_core.delta.encode import as_words

    def apply_many():
        return scatter_swap_many([as_words(t) for t in live], [d.positions for d in decoded],
                                 [d.values for d in decoded])
    best_many = None
    for _ in range(args.repeats):
        sync()
        t1 = time.perf_counter()
        olds = apply_many()
        sync()
        if olds is None:
            break
        best_many = min(best_many or float("inf"), time.perf_counter() - t1)
        undo(olds)
    figures["apply_many_s"] = best_many
    figures["check_s"] = _timed(lambda: lin64_many(live), sync, args.repeats)
    chosen = os.environ.get("CKPT_DELTA_TRITON")
    os.environ["CKPT_DELTA_TRITON"] = "0"   # the same check with torch ops only
    figures["check_torch_s"] = _timed(lambda: lin64_many(live), sync, args.repeats)
    os.environ.pop("CKPT_DELTA_TRITON")
    if chosen is not None:
        os.environ["CKPT_DELTA_TRITON"] = chosen
    figures["torch_digests_equal"] = lin64_many(live) == _with_torch(lin64_many, live)
    olds = apply()
    got = lin64_many(live)
    figures["bit_exact"] = all(g == d.digest for g, d in zip(got, decoded))
    undo(olds)
    figures["undone_exact"] = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(live, bases))
    gb = args.mib * 2**20 / 1e9
    figures["check_gbps"] = gb / figures["check_s"]
    scale = 16384 / args.mib
    figures["at_16gib_ms"] = {k: 1e3 * figures[f"{k}_s"] * scale for k in ("decode", "apply", "apply_many", "check",
                                                                            "check_torch", "undo")
                              if figures[f"{k}_s"] is not None}
    if args.profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ds = decode_many(payloads)
            olds = [apply_decoded(t, d) for t, d in zip(live, ds)]
            lin64_many(live)
            sync()
        undo(olds)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        figures["profile"] = table
        print(table)
        os.environ["CKPT_DELTA_TRITON"] = "0"   # the post-apply check alone, torch ops only
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            lin64_many(live)
            sync()
        os.environ.pop("CKPT_DELTA_TRITON")
        if chosen is not None:
            os.environ["CKPT_DELTA_TRITON"] = chosen
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
        figures["profile_check_torch"] = table
        print(table)
    text = json.dumps({k: v for k, v in figures.items() if not k.startswith("profile")}, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0 if figures["bit_exact"] and figures["undone_exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
