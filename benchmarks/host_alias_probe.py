"""Two versions compared word by word (the registration's compiled compare, ``delta/_scan.scan``) with
their buffers exactly 1 GiB apart in the address space, then one page or more off that distance: on the
2-core CPU machine the first was 1.8x slower (297-306 against 167-209 ms for 800 MiB of bf16 at 2 %),
which is why host buffers start at one of ``devices._base.HOST_COLORS`` page offsets into their mappings.

    PYTHONPATH=$PWD python benchmarks/host_alias_probe.py
"""

from __future__ import annotations

import mmap
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from ckpt_core.delta._scan import kernel, scan  # noqa: E402
from ckpt_core.delta.lin64 import _host_ab  # noqa: E402


def main() -> None:
    lib = kernel()
    if lib is None:
        sys.exit("no compiled compare here (no C compiler, or PS_DELTA_KERNEL=numpy)")
    n = 800 << 20
    rng = np.random.default_rng(0)
    old = rng.integers(0, 255, n, dtype=np.uint8)
    new = old.copy()
    items = new.view(np.uint16)
    items[rng.choice(items.size, int(0.02 * items.size), replace=False)] ^= 1
    mm = mmap.mmap(-1, (2 << 30) + (8 << 20))
    big = np.frombuffer(mm, dtype=np.uint8)
    big[:] = 1                       # every page touched first
    a = big[:n]
    a[:] = old
    step = 4 << 20                   # 4 MiB tensors, as the registration's large ones
    for shift in (0, 4096, 3 * 4096, 64 << 10, 1 << 20, 0, 4096):
        b = big[(1 << 30) + shift: (1 << 30) + shift + n]
        b[:] = new
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            for lo in range(0, n, step):
                scan(lib, b[lo: lo + step], a[lo: lo + step], 2, *_host_ab(step // 8), derive=True)
            best = min(best, time.perf_counter() - t0)
        print(f"new version 1 GiB + {shift:8d} bytes after its base: compare {best * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
