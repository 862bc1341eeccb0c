"""What a slice costs a P2P read in descriptors and time (docs/p2p.md, "Slices").

A sliced P2P update reads each slice as the contiguous runs of its box (``p2p/slices.box_runs``):
a slice of rows is one run, a slice of columns one run per row. This probe reads, over Mooncake's
real transport between two stores of this process (owner on ``--owner-host``, reader on
``--reader-host``; TCP on loopback unless the host has RDMA), the whole tensor, half its rows and
half its columns, for tensors of a few row lengths, and prints descriptors, seconds (best of
``--repeats``) and GB/s; every read is checked bit-exact against the owner's bytes.

    python benchmarks/p2p_slice_probe.py --mib 64 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time


def _read(reader, peer, descs, repeats):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        reader.read(peer, 0, descs, what="probe", deadline=time.monotonic() + 600, should_stop=lambda: None)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of each tensor (bf16)")
    ap.add_argument("--cols", default="8192,2048,512", help="row lengths (elements) to try")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--owner-host", default="127.0.0.2")
    ap.add_argument("--reader-host", default="127.0.0.3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from ckpt_core.p2p.slices import box_runs
    from ckpt_core.p2p.store import P2PStore
    from ckpt_core.planning.slices import BoxCopy

    log = logging.getLogger("p2p_slice_probe")
    owner = P2PStore(args.owner_host, local_rank=0, ps_devices="", nccl_ib_hca="", log=log, serving=True)
    reader = P2PStore(args.reader_host, local_rank=0, ps_devices="", nccl_ib_hca="", log=log)
    nbytes = args.mib << 20
    src = torch.randint(-(1 << 15), 1 << 15, (nbytes // 2,), dtype=torch.int16).view(torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    rows = []
    try:
        owner.register(src.data_ptr(), nbytes)
        reader.register(dst.data_ptr(), nbytes)
        peer = owner.describe({0: (src.data_ptr(), nbytes)}, owner.stamp()[1])
        for cols in (int(c) for c in args.cols.split(",")):
            n_rows = nbytes // 2 // cols
            shape = (n_rows, cols)
            for what, box in (("whole", None), ("rows/2", ((0, n_rows // 2, n_rows // 2),)),
                              ("cols/2", ((1, cols // 2, cols // 2),))):
                runs = box_runs(BoxCopy(0, 0, shape, box, 2, 0))
                descs = [(dst.data_ptr() + r.offset, src.data_ptr() + r.base_offset, r.nbytes) for r in runs]
                dst.zero_()
                secs = _read(reader, peer, descs, args.repeats)
                n = sum(r.nbytes for r in runs)
                want = src.view(torch.int16).view(shape)
                if box:
                    want = want.narrow(*box[0])
                assert torch.equal(dst[:n].view(torch.int16), want.contiguous().view(-1)), (shape, what)
                rows.append({"shape": list(shape), "read": what, "descriptors": len(runs), "bytes": n,
                             "run_bytes": runs[0].nbytes, "seconds": secs, "gbps": n / secs / 1e9})
                print(f"{str(list(shape)):>16} {what:>7}: {len(runs):6d} descriptor(s) of {runs[0].nbytes:>9} B, "
                      f"{n / 2**20:6.1f} MiB in {secs * 1e3:8.1f} ms ({n / secs / 1e9:5.2f} GB/s), bit-exact",
                      flush=True)
    finally:
        owner.close(0)
        reader.close(0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"transport": reader.transport, "mib": args.mib, "repeats": args.repeats, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
