"""What a slice costs a P2P read in descriptors and time (docs/p2p.md, "Slices").

A sliced P2P update reads each slice as the contiguous runs of its box (``p2p/slices.box_runs``):
a slice of rows is one run, a slice of columns one run per row. This probe reads, over Mooncake's
real transport between two stores of this process (owner on ``--owner-host``, reader on
``--reader-host``; TCP on loopback unless the host has RDMA), the whole tensor, half its rows and
half its columns (one descriptor per row, and as a sliced update reads it: the rows with the holes
between them in spans, ``p2p/slices.slice_reads``, gathered), for tensors of a few row lengths, and
prints descriptors, seconds (best of ``--repeats``) and GB/s; every read is checked bit-exact
against the owner's bytes.

    python benchmarks/p2p_slice_probe.py --mib 64 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time


def _read(reader, peer, descs, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        reader.read(peer, 0, descs, what="probe", deadline=time.monotonic() + 600, should_stop=lambda: None)
        best = min(best, time.perf_counter() - t0)
    return best


def _read_gathered(reader, peer, dst, src, reads, n: int, repeats: int) -> float:
    """A sliced target's read (``P2PPipeline._read_slices``): spans into the landing zone at ``n``, gathered."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for spans, gathers in reads.rounds:
            _read(reader, peer, [(dst.data_ptr() + n + s.offset, src.data_ptr() + s.base_offset, s.nbytes)
                                 for s in spans], 1)
            for g in gathers:
                dst[g.dst: g.dst + g.count * g.nbytes].view(g.count, g.nbytes).copy_(
                    dst.as_strided((g.count, g.nbytes), (g.stride, 1), n + g.src))
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of each tensor (bf16)")
    ap.add_argument("--cols", default="8192,2048,512", help="row lengths (elements) to try")
    ap.add_argument("--parts", type=int, default=2, help="read 1/parts of the rows or columns (a TP size)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--owner-host", default="127.0.0.2")
    ap.add_argument("--reader-host", default="127.0.0.3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from ckpt_core.p2p.slices import box_runs, slice_reads
    from ckpt_core.p2p.store import P2PStore
    from ckpt_core.planning.slices import box_extent
    from ckpt_core.planning.slice_routes import BoxCopy, SlicedBucket

    log = logging.getLogger("p2p_slice_probe")
    owner = P2PStore(args.owner_host, local_rank=0, ps_devices="", nccl_ib_hca="", log=log, serving=True)
    reader = P2PStore(args.reader_host, local_rank=0, ps_devices="", nccl_ib_hca="", log=log)
    nbytes = args.mib << 20
    src = torch.randint(-(1 << 15), 1 << 15, (nbytes // 2,), dtype=torch.int16).view(torch.uint8)
    dst = torch.zeros(2 * nbytes, dtype=torch.uint8)   # room for a landing zone after the slice
    rows = []
    try:
        owner.register(src.data_ptr(), nbytes)
        reader.register(dst.data_ptr(), 2 * nbytes)
        peer = owner.describe({0: (src.data_ptr(), nbytes)}, owner.stamp()[1])
        for cols in (int(c) for c in args.cols.split(",")):
            n_rows = nbytes // 2 // cols
            shape = (n_rows, cols)
            k, c = n_rows // args.parts, cols // args.parts
            for what, box in (("whole", None), (f"rows/{args.parts}", ((0, k, k),)), (f"cols/{args.parts}", ((1, c, c),)),
                              ("spans", ((1, c, c),))):
                bc = BoxCopy(0, 0, shape, box, 2, 0)
                n = math.prod(box_extent(shape, box)) * 2
                dst.zero_()
                if what == "spans":   # into a landing zone after the slice, then gathered, as a target does
                    reads = slice_reads(SlicedBucket(0, nbytes=n, dest=0, boxes=(bc,)))
                    runs = [s for spans, _ in reads.rounds for s in spans] + list(reads.direct)
                    secs = _read_gathered(reader, peer, dst, src, reads, n, args.repeats)
                else:
                    runs = box_runs(bc)
                    descs = [(dst.data_ptr() + r.offset, src.data_ptr() + r.base_offset, r.nbytes) for r in runs]
                    secs = _read(reader, peer, descs, args.repeats)
                want = src.view(torch.int16).view(shape)
                if box:
                    want = want.narrow(*box[0])
                assert torch.equal(dst[:n].view(torch.int16), want.contiguous().view(-1)), (shape, what)
                wire = sum(r.nbytes for r in runs)
                rows.append({"shape": list(shape), "read": what, "descriptors": len(runs), "bytes": n,
                             "wire_bytes": wire, "run_bytes": runs[0].nbytes, "seconds": secs, "gbps": n / secs / 1e9})
                print(f"{str(list(shape)):>16} {what:>7}: {len(runs):6d} descriptor(s) of {runs[0].nbytes:>9} B, "
                      f"{wire / 2**20:6.1f} MiB read for {n / 2**20:6.1f} MiB in {secs * 1e3:8.1f} ms "
                      f"({n / secs / 1e9:5.2f} GB/s of the slice), bit-exact", flush=True)
    finally:
        owner.close(0)
        reader.close(0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"transport": reader.transport, "mib": args.mib, "parts": args.parts, "repeats": args.repeats,
                       "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
