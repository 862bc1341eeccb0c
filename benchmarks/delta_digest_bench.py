"""The delta's post-apply digest: ``lin64`` (``ckpt_core/delta/lin64.py``) against the SHA-256 it
replaced (issue 39), and what it costs the PS's encode.

Prints, for a bf16 tensor of ``--gib`` GiB of fresh random bytes:

- ``lin64`` on the host (numpy on a thread pool) and, where CUDA is present, on the GPU (torch ops
  on the tensor's device, no host copy), in GB/s of the tensor's bytes, best of ``--repeat``;
- SHA-256 of the same bytes as the old check took it (``p2p.digests.digest_of``: pieces hashed on a
  thread pool; from a GPU tensor, each piece copied to the host first);
- the PS's ``encode_tensor`` of a pair (``--density`` of the elements changed): with its lin64, and
  without any digest (the digest given), so that the old encode is about the latter plus SHA-256.

    python benchmarks/delta_digest_bench.py --gib 1
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing

from ckpt_core.delta.encode import bytes_of, encode_tensor  # noqa: E402
from ckpt_core.delta.lin64 import lin64  # noqa: E402
from ckpt_core.p2p.digests import digest_of  # noqa: E402

GB = 1e9


def best(fn, repeat: int, sync=None) -> float:
    """The fastest of ``repeat`` runs of ``fn`` in seconds (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeat):
        if sync:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def random_bf16(numel: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(numel, generator=gen).to(torch.bfloat16).to(device)


def rate_line(what: str, nbytes: int, seconds: float) -> str:
    return f"{what:<44} {nbytes / seconds / GB:8.2f} GB/s  ({seconds:.3f} s)"


def digests(t: torch.Tensor, repeat: int) -> list[str]:
    sync = torch.cuda.synchronize if t.device.type == "cuda" else None
    nbytes = t.numel() * t.element_size()
    where = t.device.type
    out = [rate_line(f"lin64 ({where})", nbytes, best(lambda: lin64(t), repeat, sync)),
           rate_line(f"SHA-256 of the host bytes (from {where})", nbytes,
                     best(lambda: digest_of(bytes_of(t)), repeat, sync))]
    return out


def encodes(numel: int, density: float, repeat: int) -> list[str]:
    old = random_bf16(numel)
    new = old.clone()
    gen = torch.Generator().manual_seed(2)
    changed = torch.randperm(numel, generator=gen)[: int(numel * density)]
    new.view(torch.int16)[changed] ^= 1
    digest = lin64(new)
    nbytes = numel * 2
    with_digest = best(lambda: encode_tensor(new, old), repeat)
    without = best(lambda: encode_tensor(new, old, digest=digest), repeat)
    return [f"encode_tensor, {density:.1%} changed, with lin64 {with_digest:.3f} s, without a digest "
            f"{without:.3f} s ({nbytes / 2**30:.2f} GiB bf16 pair)"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="tensor size in GiB (bf16)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.02, help="changed elements in the encode pair")
    ap.add_argument("--no-encode", action="store_true", help="skip the encode measurement")
    args = ap.parse_args()
    numel = int(args.gib * 2**30) // 2
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}, bf16 tensor of {numel * 2 / 2**30:.2f} GiB")
    t = random_bf16(numel)
    for line in digests(t, args.repeat):
        print(line, flush=True)
    if torch.cuda.is_available():
        print(f"# {torch.cuda.get_device_name()}")
        dev = t.to("cuda")
        del t
        for line in digests(dev, args.repeat):
            print(line, flush=True)
        assert lin64(dev) == lin64(dev.cpu()), "lin64 differs between the GPU and the host"   # noqa: S101
        del dev
    else:
        del t
    if not args.no_encode:
        for line in encodes(numel, args.density, args.repeat):
            print(line, flush=True)


if __name__ == "__main__":
    main()
