"""Registering straight from (CUDA) DTensor shards: GB/s of the device-to-host path, against the
named-tensor path from host memory and the machine's D2H ceiling; then updates, verified bit-exact.

Run one rank per device (the project root needs no install; it is put on sys.path)::

    torchrun --nproc-per-node 2 benchmarks/shard_bench.py --case dense16 --out results.json
    torchrun --nproc-per-node 1 benchmarks/shard_bench.py --case dense16
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/shard_bench.py --device cpu --scale 0.005

Every rank builds each tensor of the case from one seed on its device, keeps its FSDP2-style row
shard (``torch.chunk`` sizes: ceil rows per rank, the last ones short) as a ``DTensor``
(``Shard(0)`` on a 1-D mesh of the world) and drops the rest. Measured, per rank (the slowest is
reported): the D2H ceiling (one copy of the rank's share into pinned memory); registration from
the DTensor shards (copied device-to-host straight into the PS's pinned memory); registration of
the same shards from host memory (``TensorShard`` of CPU tensors: the named-tensor path) and the
``.cpu()`` a trainer would run first; then a warm-up update and ``--repeats`` timed ones into
simulated engine workers, each verified by checksums of every full tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _bench_cases import CASES, GiB, build_case, checksums  # noqa: E402
from _bench_worker import EngineFront, EngineWorker  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="dense16", help=f"one of {', '.join(CASES)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the case's size")
    p.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON results file (written by rank 0)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


class Bench:
    def __init__(self, args):
        self.args, self.kind = args, args.device
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        if self.kind == "cuda":
            torch.cuda.set_device(self.local)
        self.device = torch.device(self.kind, self.local) if self.kind == "cuda" else torch.device("cpu")
        self.worker = EngineWorker(self.kind, self.local)
        dist.init_process_group("nccl" if self.kind == "cuda" else "gloo")
        self.ctrl = dist.new_group(backend="gloo") if self.kind == "cuda" else None
        addresses = self.gather(self.worker.address)
        self.front = EngineFront(addresses) if self.rank == 0 else None
        dist.barrier(group=self.ctrl)
        self.worker.wait_connected()

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[shard-bench] {msg}", flush=True)

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def sync(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.local)

    def timed(self, fn) -> float:
        """The slowest rank's seconds for ``fn`` (started together)."""
        dist.barrier(group=self.ctrl)
        t0 = time.perf_counter()
        fn()
        self.sync()
        return max(self.gather(time.perf_counter() - t0))

    def shards(self, specs):
        """This rank's DTensor row shards, and the checksums of every full tensor (on the device)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        mesh = init_device_mesh(self.kind, (self.world,))
        named, sums = {}, {}
        for i, s in enumerate(specs):
            gen = torch.Generator(self.device).manual_seed(self.args.seed + i)
            full = torch.randn(s.shape, generator=gen, device=self.device, dtype=torch.float32).to(s.dtype)
            sums[s.name] = checksums({s.name: full})[s.name]
            rows = -(-full.shape[0] // self.world)
            local = full[self.rank * rows: (self.rank + 1) * rows].clone()
            named[s.name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                               stride=full.stride())
            del full
        self.sync()
        return named, sums

    def d2h_ceiling(self, nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.kind == "cuda")
        dst.fill_(1)   # fault the pages in: the ceiling is the copy, not first touch
        best = min(self.timed(lambda: dst.copy_(src)) for _ in range(2))
        return nbytes / best / 1e9

    def run(self) -> dict:
        from ckpt_core import ParameterServer, TensorShard
        args = self.args
        specs = build_case(args.case, args.scale)
        named, sums = self.shards(specs)
        share = sum(t.to_local().numel() * t.element_size() for t in named.values())
        total = sum(s.nbytes for s in specs)
        self.say(f"{args.case}: {len(specs)} tensors, {total / GiB:.3f} GiB, {self.world} rank(s)")
        ceiling = self.gather(self.d2h_ceiling(share))
        ps = ParameterServer(device=self.kind)
        out = {"case": args.case, "tensors": len(specs), "bytes": total, "world": self.world,
               "share_bytes": self.gather(share), "d2h_ceiling_gbps": ceiling}

        s = self.timed(lambda: ps.register_checkpoint("dtensor", named_tensors=named))
        out["register_dtensor"] = {"s": s, "gbps": max(out["share_bytes"]) / s / 1e9,
                                   "phases": self.gather(ps.last_register["seconds"]),
                                   "registered_bytes": self.gather(ps.last_register["bytes"])}
        self.say(f"register from {self.kind} DTensor shards: {s:.3f} s ({out['register_dtensor']['gbps']:.1f} GB/s "
                 f"per rank; D2H ceiling {min(ceiling):.1f} GB/s)")
        out["updates"] = self.updates(ps, "dtensor", specs, sums)

        host: dict = {}
        s_cpu = self.timed(lambda: host.update({n: TensorShard(t.to_local().cpu(), tuple(t.shape),
                                                               (self.rank * -(-t.shape[0] // self.world),)
                                                               + (0,) * (t.dim() - 1))
                                                for n, t in named.items()}))
        ps.unregister_checkpoint("dtensor")
        s = self.timed(lambda: ps.register_checkpoint("host", named_tensors=host))
        out["register_host_tensors"] = {"s": s, "gbps": max(out["share_bytes"]) / s / 1e9, "cpu_copy_s": s_cpu,
                                        "phases": self.gather(ps.last_register["seconds"])}
        self.say(f"register the same shards from host memory: {s:.3f} s (+ {s_cpu:.3f} s of .cpu() first)")
        ps.close()
        return out

    def updates(self, ps, name: str, specs, sums) -> list:
        self.worker.call("alloc", [(s.name, s.shape, s.dtype) for s in specs])
        ps.gather_metas(name)
        out = []
        for k in range(self.args.repeats + 1):
            self.worker.call("zero")   # a missed tensor cannot pass for a received one
            s = self.timed(lambda: ps.update(name, self.front.req_func if self.front else (lambda h: None)))
            got = self.worker.call("checksum")
            bad = self.gather(sorted(n for n in sums if tuple(got.get(n, ())) != tuple(sums[n]))[:5])
            if any(bad):
                raise RuntimeError(f"update {k} is not bit-exact: {bad}")
            out.append({"s": s, "warmup": k == 0, "gbps": sum(s.nbytes for s in specs) / s / 1e9})
            self.say(f"update {k}{' (warm-up)' if k == 0 else ''}: {s:.3f} s, bit-exact on every engine worker")
        self.worker.call("free")
        return out

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        self.worker.close()
        dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    bench = Bench(args)
    try:
        out = bench.run()
        out["device_name"] = torch.cuda.get_device_name(bench.local) if bench.kind == "cuda" else "cpu"
        if bench.rank == 0:
            text = json.dumps(out, indent=1)
            print(text)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
