"""Does the registration's compare scale with threads on this host? (issue 39, docs/deltas.md)

The compiled pass of a registration's compare (``ckpt_core/delta/_scan.py``: ``scan``) over ``--tensors``
bf16 tensors of ``--mib`` MiB each, 2 % of their elements changed, on 1, 2, 4, 8 and 16 threads, with
blocks of 32K words (the old ``BLOCK_WORDS``) and of 4M words; numpy's plain word compare beside it as
the host's reading rate. Read rates count both versions' bytes.

    PYTHONPATH=$PWD python benchmarks/scan_threads_probe.py --tensors 8 --mib 256
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from ckpt_core.delta import _scan  # noqa: E402
from ckpt_core.delta.lin64 import _host_ab  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--mib", type=int, default=256, help="MiB per tensor")
    ap.add_argument("--threads", default="1,2,4,8,16")
    args = ap.parse_args()
    lib = _scan.kernel()
    if lib is None:
        sys.exit("the compiled pass is not available here (no C compiler, or PS_DELTA_KERNEL=numpy)")
    rng = np.random.default_rng(0)
    n = args.mib << 19   # bf16 elements
    base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    pairs = []
    for i in range(args.tensors):
        old = np.roll(base, i * 977)
        new = old.copy()
        new[rng.integers(0, n, n // 50)] ^= 1
        pairs.append((new.view(np.uint8), old.view(np.uint8)))
    a, b = _host_ab(n * 2 // 8)
    read = sum(p[0].size * 2 for p in pairs)
    kept = _scan.BLOCK_WORDS

    def line(threads: int, what: str, seconds: float) -> None:
        print(f"threads {threads:2d} {what} {seconds * 1e3:7.1f} ms {read / seconds / 1e9:6.1f} GB/s read", flush=True)

    def compare(p):
        np.not_equal(p[0].view(np.uint64), p[1].view(np.uint64), out=np.empty(p[0].size // 8, dtype=bool))

    try:
        for t in (int(x) for x in args.threads.split(",")):
            with ThreadPoolExecutor(t) as pool:
                for block in (1 << 15, 1 << 22):
                    _scan.BLOCK_WORDS = block
                    t0 = time.perf_counter()
                    list(pool.map(lambda p: _scan.scan(lib, p[0], p[1], 2, a, b), pairs))
                    s = time.perf_counter() - t0
                    line(t, f"block {block:8d} words: scan", s)
                t0 = time.perf_counter()
                list(pool.map(compare, pairs))
                s = time.perf_counter() - t0
                line(t, "numpy not_equal words ", s)
    finally:
        _scan.BLOCK_WORDS = kept


if __name__ == "__main__":
    main()
