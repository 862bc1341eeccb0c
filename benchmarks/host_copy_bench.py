"""Host copies of received tensors: one ``t.to("cpu", copy=True)`` per tensor (what a vLLM worker's full
update with ``deltas=True`` did) against ``ckpt_core.delta.host_copy.HostCopier`` (page-locked staging
chunks filled by device-to-host copies on a side stream, emptied by threads into pageable tensors).

Makes ``--tensors`` tensors of fresh random bytes, ``--gib`` GiB in all (sizes skewed like a model's: a
few large, many small; ``--even`` for equal ones), on the GPU when CUDA is present (else on the host,
where both ways are plain host copies: the old one a copy per tensor, the new one through a plain host
staging with the threads, which says what the chunking and the threads cost and gain without a device).
Each round copies every tensor into fresh host tensors (first-touch page faults included, as in the
worker) and frees them; prints GB/s of each way per round and the best and median, after checking the
first round's copies byte for byte.

    python benchmarks/host_copy_bench.py --gib 4 --tensors 339 --repeat 3
    python benchmarks/host_copy_bench.py --gib 4 --mib 256,512 --threads 4,8   # staging sizes x threads
    python benchmarks/host_copy_bench.py --gib 0.25 --device cpu               # no GPU

``--out FILE`` also writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from ckpt_core.delta.host_copy import ALIGN, STAGING_CHUNKS, HostCopier, HostMover  # noqa: E402

GiB = 1 << 30


def sizes_of(total: int, count: int, even: bool, seed: int = 0) -> list[int]:
    """``count`` byte sizes summing to about ``total``, multiples of 2 (bf16 elements)."""
    if even:
        return [max(2, total // count // 2 * 2)] * count
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(count, generator=gen, dtype=torch.float64) ** 4 + 1e-4
    return [max(2, int(x) // 2 * 2) for x in (w / w.sum() * total).tolist()]


def make_tensors(sizes: list[int], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(1234)
    return [(f"t{i}", torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
             .view(torch.bfloat16)) for i, n in enumerate(sizes)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def old_way(named, device):
    return [t.detach().to("cpu", copy=True) for _, t in named]


def new_way(copier: HostCopier):
    def run(named, device):
        return copier.copy(named, timeout=600)
    return run


def check(named, out) -> None:
    for (name, src), dst in zip(named, out):
        if dst.is_pinned() and dst.numel():
            raise SystemExit(f"copy of {name} is page-locked: copies must be pageable")
        if not torch.equal(src.view(torch.uint8).cpu(), dst.view(torch.uint8)):
            raise SystemExit(f"copy of {name} differs from its source")


def rounds(fn, named, device, repeat: int, nbytes: int) -> list[float]:
    rates = []
    for r in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        out = fn(named, device)
        sync(device)
        dt = time.perf_counter() - t0
        if r == 0:
            check(named, out)
        del out
        rates.append(nbytes / dt / 1e9)
    return rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="total size of the tensors, GiB")
    ap.add_argument("--tensors", type=int, default=339, help="number of tensors (339: a 7B's)")
    ap.add_argument("--even", action="store_true", help="equal sizes (else skewed like a model's)")
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when present)")
    ap.add_argument("--mib", default="256", help="staging sizes to try, MiB, comma-separated (CKPT_HOST_COPY_MIB)")
    ap.add_argument("--threads", default="4", help="thread counts to try, comma-separated (CKPT_HOST_COPY_THREADS)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    sizes = sizes_of(int(args.gib * GiB), args.tensors, args.even)
    nbytes = sum(sizes)
    named = make_tensors(sizes, device)
    sync(device)
    head = {"device": torch.cuda.get_device_name(device) if kind == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "bytes": nbytes, "tensors": len(sizes), "largest": max(sizes)}
    print(f"{head['device']}: {len(sizes)} tensors, {nbytes / GiB:.2f} GiB (largest {max(sizes) / (1 << 20):.1f} MiB)")
    results = {"old (.to('cpu') per tensor)": rounds(old_way, named, device, args.repeat, nbytes)}
    for mib in (int(x) for x in args.mib.split(",")):
        for threads in (int(x) for x in args.threads.split(",")):
            chunk = (mib << 20) // STAGING_CHUNKS // ALIGN * ALIGN
            if kind == "cuda":
                copier = HostCopier(chunk_bytes=chunk, chunks=STAGING_CHUNKS, threads=threads)
            else:   # plain host staging, the host mover: the chunking and the threads without a device
                copier = HostCopier(chunk_bytes=chunk, chunks=STAGING_CHUNKS, threads=threads,
                                    alloc=lambda n: (torch.empty(n, dtype=torch.uint8), lambda: None),
                                    mover=lambda d: HostMover(), stage_devices=("cpu",))
            try:
                results[f"new ({mib} MiB staging, {threads} threads)"] = rounds(
                    new_way(copier), named, device, args.repeat, nbytes)
            finally:
                copier.close()
    for label, rates in results.items():
        print(f"  {label:<40} best {max(rates):7.2f} GB/s, median {statistics.median(rates):7.2f} GB/s "
              f"({', '.join(f'{r:.2f}' for r in rates)})")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(head, gbps=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
