"""GPU benchmark of ckpt-engine's weight update: register, gather_metas, update into simulated engines.

Run one rank per device (the project root needs no install; it is put on sys.path)::

    torchrun --nproc-per-node 2 benchmarks/update_bench.py --out results.json
    torchrun --nproc-per-node 2 benchmarks/update_bench.py --cases dense16 --free-mem-gib 2
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/update_bench.py --device cpu --scale 0.01
    python benchmarks/update_bench.py --engine vllm --shape 7b --verify     # a real vLLM engine instead
    python benchmarks/update_bench.py --tp 8 --cases dense16                 # one device, 8 simulated TP ranks

``--engine vllm`` hands every other argument to ``benchmarks/vllm_bench.py`` (a real vLLM engine
in-process, ckpt-engine against checkpoint-engine, each compared with a cold load; its
``--help`` lists them): the simulated engine copies each tensor into a preallocated parameter and
does not see the engine's own reload, which is the slow stage on a real GPU vLLM.

Each rank measures the machine's ceilings (pinned H2D with every rank copying, device
broadcast), starts one simulated engine worker on its device, and for each case builds
a checkpoint of fresh random data split across ranks, registers it, gathers metas, runs
a warm-up update and ``--repeats`` timed ones (every one verified bit-exact by checksums
the engine worker reports), re-registers it into the shared pool and registers it from
/dev/shm safetensors in place. Rank 0 prints the tables and writes ``--out`` (JSON).

``--tp T`` adds a sliced section per case: a simulated tensor-parallel engine of T ranks, each
holding only its part of every tensor (column-parallel weights split by rows, row-parallel ones by
columns, experts like an MLP, the vocabulary by rows; norms, biases of row-parallel layers and
routers whole; the plan is ``ckpt_core.planning.slices.split_plan`` of the case's layout), updated
with ``ParameterServer.update(..., slices=plan)`` so that each engine rank receives only its slices,
verified bit-exact against the source's slices, and timed against the case's whole-tensor update.
With one PS rank per device and T equal to the world size the T engine ranks receive at once;
with one PS rank (one device) the T engine ranks are served one after another by the same PS rank
and engine worker (each update then carries rank t's slices only), and ``sliced_s`` is the slowest
rank's time, what each rank of a T-device engine would wait for.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import sys
import time
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _bench_cases import CASES, GiB, build_case, free_weight_cache, materialize, split  # noqa: E402
from _bench_ceilings import measure  # noqa: E402
from _bench_report import (check_targets, floor_seconds, format_report, per_tensor_costs, per_tensor_line,  # noqa: E402
                           summarize_updates)
from _bench_profile import profiled  # noqa: E402
from _bench_tp import tp_section  # noqa: E402
from _bench_delta import check_host_memory, delta_section, format_delta, parse_density  # noqa: E402
from _bench_worker import EngineFront, EngineWorker  # noqa: E402

SHM = "/dev/shm"
T0 = time.perf_counter()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("simulated", "vllm"), default="simulated",
                   help="vllm: a real vLLM engine; every other argument goes to benchmarks/vllm_bench.py")
    p.add_argument("--cases", default="dense16,dense40,moe8,tiny", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every case's size (tensor count stays)")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per case after one warm-up")
    p.add_argument("--out", default=None, help="JSON results file (written by rank 0)")
    p.add_argument("--free-mem-gib", type=float, default=None,
                   help="before the updates, fill device memory so only this many GiB stay free (cuda only)")
    p.add_argument("--h2d-mib", type=int, default=None, help="H2D ceiling copy size (default 4096 cuda, 64 cpu)")
    p.add_argument("--bcast-mib", type=int, default=None, help="broadcast ceiling size (default 1024 cuda, 64 cpu)")
    p.add_argument("--host-touch-gib", type=float, default=None,
                   help="fresh host memory each rank faults in (twice) as a ceiling before the cases; "
                        "default: twice the largest share (a case's source data and its registered copy); 0: skip")
    p.add_argument("--keep-device-buffers", action="store_true", help="ParameterServer(keep_device_buffers=True)")
    p.add_argument("--skip-pool", action="store_true", help="skip the shared-pool re-registration")
    p.add_argument("--stage", action="store_true",
                   help="also stage each case into device memory beside the parameters and time the commit "
                        "(staged -> live copy)")
    p.add_argument("--skip-shm", action="store_true", help="skip the /dev/shm in-place registration")
    p.add_argument("--tp", type=int, default=None,
                   help="also update a simulated engine of this many tensor-parallel ranks, each receiving only "
                        "its slices (the world size, or any T with one rank)")
    p.add_argument("--engine-copy", choices=("tensor", "foreach"), default="tensor",
                   help="how the simulated engine copies a bucket into its parameters: one copy_ per tensor "
                        "(as engines' loaders do; default) or one torch._foreach_copy_ per dtype (an engine that "
                        "batches: what is left per tensor is ours)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="cProfile one more update of each case after the timed ones (and of engine rank 0's sliced "
                        "ones with --tp) on every PS rank and in every engine worker, into DIR (.prof and "
                        "top-entries .txt); the timed updates run unprofiled")
    p.add_argument("--delta-density", default=None, metavar="D|measured",
                   help="after each case's full updates, --repeats delta updates of next versions in which a "
                        "fraction D of every tensor's elements changed (measured: the density study's, "
                        "benchmarks/results/*delta-density*), registered with their base, applied and checked by "
                        "the engine worker's DeltaReceiver; full and delta side by side, the last one bit-exact")
    p.add_argument("--log-level", default="WARNING", help="level of ckpt_core's logs (INFO: one line per phase)")
    args = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.tp is not None and (args.tp < 1 or (world != 1 and args.tp != world)):
        p.error(f"--tp must be the world size ({world}) or, with one rank, any T >= 1; got {args.tp}")
    args.cases = [c for c in args.cases.split(",") if c]
    for c in args.cases:
        if c not in CASES:
            p.error(f"unknown case {c!r}; known: {', '.join(CASES)}")
    if args.repeats < 1 or args.scale <= 0:
        p.error("--repeats must be >= 1 and --scale > 0")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.delta_density is not None:
        try:
            args.delta_density = parse_density(args.delta_density)
        except ValueError as e:
            p.error(str(e))
    return args


class Bench:
    """One rank's benchmark: process groups, its engine worker, its ParameterServer."""

    def __init__(self, args: argparse.Namespace):
        from ckpt_core import ParameterServer
        self.args = args
        self.kind = args.device
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", self.rank))
        if self.kind == "cuda":
            torch.cuda.set_device(self.local)
            self.device = torch.device("cuda", self.local)
        else:
            self.device = torch.device("cpu")
        self.worker = EngineWorker(self.kind, self.local)   # starts now; its address is awaited below
        dist.init_process_group("nccl" if self.kind == "cuda" else "gloo")
        self.ctrl = dist.new_group(backend="gloo") if self.kind == "cuda" else None
        h2d = (args.h2d_mib or (4096 if self.kind == "cuda" else 64)) << 20
        bcast = (args.bcast_mib or (1024 if self.kind == "cuda" else 64)) << 20
        if self.kind == "cuda":
            _ = self.worker.address   # its CUDA context exists before we time the device
        if args.delta_density is not None:
            largest = max(max(sum(s.nbytes for s in sh) for sh in split(build_case(c, args.scale), self.world))
                          for c in args.cases)
            check_host_memory(largest, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)), self.kind, self.say_any)
        host = self._host_touch_bytes()
        mine = measure(self.kind, self.device, self.ctrl, h2d_bytes=h2d, bcast_bytes=bcast, host_bytes=host)
        views = self.gather(mine)
        self.ceilings = {"h2d_gbps": [v["h2d_gbps"] for v in views], "broadcast_gbps": views[0]["broadcast_gbps"],
                         "h2d_bytes": h2d, "broadcast_bytes": bcast}
        if host:
            self.ceilings.update({k: [v[k] for v in views] for k in
                                  ("host_fault_in_first_gbps", "host_fault_in_recycled_gbps")},
                                 host_fault_in_bytes=host)
        addresses = self.gather(self.worker.address)
        self.front = EngineFront(addresses) if self.rank == 0 else None
        self.barrier()
        self.worker.wait_connected()
        self.worker.call("copy_mode", args.engine_copy)
        # The benchmark owns the default group; the ParameterServer borrows it (as under an RL trainer).
        self.ps = ParameterServer(device=self.kind, keep_device_buffers=args.keep_device_buffers)
        self.sums: dict = {}
        self.say(f"ceilings: H2D {self.ceilings['h2d_gbps']} GB/s, broadcast {self.ceilings['broadcast_gbps']} GB/s")

    # -- helpers ---------------------------------------------------------------
    def _host_touch_bytes(self) -> int:
        if self.args.host_touch_gib is not None:
            return int(self.args.host_touch_gib * GiB)
        largest = max(max(sum(s.nbytes for s in sh) for sh in split(build_case(c, self.args.scale), self.world))
                      for c in self.args.cases)
        return 2 * largest

    def say_any(self, msg: str) -> None:
        """``say`` before the process group exists (rank 0 by the environment)."""
        if self.rank == 0:
            print(f"[bench {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[bench {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)

    def gather(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    def timed(self, fn) -> dict:
        """Barrier, run ``fn`` on every rank, return the slowest rank's seconds and everyone's."""
        self.barrier()
        t0 = time.perf_counter()
        fn()
        per_rank = self.gather(time.perf_counter() - t0)
        return {"s": max(per_rank), "per_rank": per_rank}

    @contextmanager
    def profiling(self, label: str | None):
        """With ``--profile``: cProfile what runs inside on this rank (``<label>-ps-r<rank>``) and
        the update it starts in every engine worker (``<label>-w<i>``)."""
        if label is None or self.args.profile is None:
            yield
            return
        prefix = os.path.join(self.args.profile, label)
        if self.front is not None:
            self.front.profile = prefix
        try:
            with profiled(f"{prefix}-ps-r{self.rank}"):
                yield
        finally:
            if self.front is not None:
                self.front.profile = None

    def req_func(self, handles) -> None:
        if self.front is not None:
            self.front.req_func(handles)

    def _mem_mark(self) -> int:
        if self.kind != "cuda":
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def _mem_peak(self, base: int) -> int:
        return torch.cuda.max_memory_allocated() - base if self.kind == "cuda" else 0

    def _squeeze_device(self):
        """Allocate device memory so only --free-mem-gib stays free; returns the filler (or None)."""
        x = self.args.free_mem_gib
        if x is None or self.kind != "cuda":
            return None   # on cpu the option is dropped in main()
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.local)[0]
        n = free - int(x * GiB)
        return torch.empty(n, dtype=torch.uint8, device=self.device) if n > 0 else None

    # -- one update, verified ----------------------------------------------------
    def update_once(self, name: str, profile: str | None = None) -> dict:
        self.worker.call("zero")   # so that a missed tensor cannot pass for a received one
        if self.front is not None:
            self.front.version = name   # what the workers' delta receivers hold after it
        self.barrier()
        base = self._mem_mark()
        with self.profiling(profile):
            t0, c0 = time.perf_counter(), time.thread_time()
            info = self.ps.update(name, self.req_func)
            seconds, cpu = time.perf_counter() - t0, time.thread_time() - c0
        peak = self._mem_peak(base)
        got = self.worker.call("checksum")
        bad = [n for n, s in self.sums.items() if tuple(got.get(n, ())) != tuple(s)]
        bad += sorted(set(got) - set(self.sums))
        engine = self.front.last if self.front is not None else None
        views = self.gather({"seconds": seconds, "peak": peak, "bad": bad[:5], "nbad": len(bad), "ps": info,
                             "cpu": cpu})
        failed = [(r, v) for r, v in enumerate(views) if v["nbad"]]
        if failed:
            detail = "; ".join(f"rank {r}'s engine: {v['nbad']} tensors differ, e.g. {v['bad']}" for r, v in failed)
            self.say("!" * 30 + f" CHECKSUM MISMATCH after updating {name!r}: {detail}")
            raise RuntimeError(f"update of {name!r} is not bit-exact: {detail}")
        return {"seconds": max(v["seconds"] for v in views), "per_rank_s": [v["seconds"] for v in views],
                "peak_extra_device_bytes": [v["peak"] for v in views], "ps": [v["ps"] for v in views],
                "ps_cpu_s": [v["cpu"] for v in views], "engine": engine}

    # -- a case ----------------------------------------------------------------------
    def run_case(self, case: str) -> dict:
        specs = build_case(case, self.args.scale)
        shares = split(specs, self.world)
        share_bytes = [sum(s.nbytes for s in sh) for sh in shares]
        total = sum(share_bytes)
        self.say(f"{case}: {len(specs)} tensors, {total / GiB:.3f} GiB; generating data")
        t0 = time.perf_counter()
        share = materialize(shares[self.rank], self.device, seed=secrets.randbits(62))
        self.sums = {k: v for part in self.gather(share.sums) for k, v in part.items()}
        self.worker.call("alloc", [(s.name, s.shape, s.dtype) for s in specs])
        if self.kind == "cuda":
            free_weight_cache()
            torch.cuda.empty_cache()
        gen_s = time.perf_counter() - t0
        reg = self.timed(lambda: self.ps.register_checkpoint(case, named_tensors=share.named))
        reg_phases = self.ps.last_register["seconds"]
        gat = self.timed(lambda: self.ps.gather_metas(case))
        self.say(f"{case}: registered in {reg['s']:.3f} s ({phases(reg_phases)}), metas gathered in "
                 f"{gat['s']:.3f} s; updating")
        filler = self._squeeze_device()
        try:
            updates = [self.update_once(case) for _ in range(1 + self.args.repeats)]
            if self.args.profile:   # one more, not timed: cProfile slows what it watches
                self.update_once(case, profile=f"{case}-whole")
        finally:
            del filler
            if self.kind == "cuda":
                torch.cuda.empty_cache()
        stage = (self.stage_section(case, total, min(u["seconds"] for u in updates[1:] or updates))
                 if self.args.stage else None)
        timed = updates[1:]
        summary = summarize_updates(timed)
        delta = None
        if self.args.delta_density is not None:
            self.update_once(case)   # the engine holds the case again (a staged update is not tracked)
            delta = delta_section(self, case, share, summary["best_s"])
        self.ps.unregister_checkpoint(case)
        best = timed[summary["best_index"]]
        record = {
            "case": case, "bytes": total, "tensors": len(specs), "share_bytes": share_bytes, "generate_s": gen_s,
            "register_s": reg["s"], "register_per_rank_s": reg["per_rank"], "register_phases_rank0": reg_phases,
            "gather_metas_s": gat["s"],
            "gather_metas_per_rank_s": gat["per_rank"], "warmup_update_s": updates[0]["seconds"],
            "update": summary, "update_breakdown": best["ps"][0]["seconds"],
            "buckets": best["ps"][0]["buckets"], "bucket_bytes": best["ps"][0]["bucket_bytes"],
            "peak_extra_device_bytes": max(max(u["peak_extra_device_bytes"]) for u in updates),
            "peak_extra_device_bytes_per_rank": [max(u["peak_extra_device_bytes"][r] for u in updates)
                                                 for r in range(self.world)],
            # what the PS computed it may use on the device: its IPC buffer, slots x slot bytes
            "device_buffer_bytes_per_rank": [max(u["ps"][r]["device_buffer_bytes"] for u in updates)
                                             for r in range(self.world)],
            "floor": floor_seconds(share_bytes, self.ceilings["h2d_gbps"], self.ceilings["broadcast_gbps"]),
            "updates": updates,
        }
        record["per_tensor"] = per_tensor_costs(best, len(specs), record["floor"]["seconds"])
        self.say(f"{case}: update best {summary['best_s']:.3f} s, median {summary['median_s']:.3f} s "
                 f"({total / summary['best_s'] / 1e9:.1f} GB/s), floor {record['floor']['seconds']:.3f} s; "
                 f"per tensor {per_tensor_line(record['per_tensor'])}")
        record["stage"] = stage
        record["delta"] = delta
        record["pool"] = None if self.args.skip_pool else self.pool_section(case, share)
        record["shm"] = None if self.args.skip_shm else self.shm_section(case, share, total)
        record["tp"] = None if self.args.tp is None else tp_section(self, case, specs, share, summary["best_s"],
                                                                      record["floor"]["seconds"])
        self.worker.call("free")
        del share
        gc.collect()
        if self.kind == "cuda":
            torch.cuda.empty_cache()
        self.barrier()
        return record

    def stage_section(self, case: str, total: int, update_s: float) -> dict:
        """Stage (the whole transfer, the parameters untouched), then commit: staged -> live on the device.
        The commit is the pause a staged update costs; it is checked bit-exact like an update."""
        rounds = []
        for _ in range(1 + self.args.repeats):
            self.worker.call("zero")
            self.barrier()
            if self.front is not None:
                self.front.stage = True
            try:
                t0 = time.perf_counter()
                self.ps.update(case, self.req_func)
                stage_s = time.perf_counter() - t0
            finally:
                if self.front is not None:
                    self.front.stage = False
            unchanged = self.worker.call("checksum")
            touched = sum(1 for n, s in self.sums.items() if tuple(unchanged.get(n, ())) == tuple(s))
            self.barrier()
            commit = self.worker.call("commit")
            got = self.worker.call("checksum")
            bad = [n for n, s in self.sums.items() if tuple(got.get(n, ())) != tuple(s)]
            views = self.gather({"stage_s": stage_s, "commit_s": commit["seconds"], "nbad": len(bad),
                                 "bad": bad[:3], "touched": touched})
            if any(v["nbad"] or v["touched"] for v in views):
                raise RuntimeError(f"staged update of {case!r} is wrong: {views}")
            rounds.append({"stage_s": max(v["stage_s"] for v in views),
                           "commit_s": max(v["commit_s"] for v in views),
                           "commit_per_rank_s": [v["commit_s"] for v in views]})
        timed = rounds[1:] or rounds
        best = min(timed, key=lambda r: r["commit_s"])
        out = {"stage_best_s": min(r["stage_s"] for r in timed), "commit_best_s": best["commit_s"],
               "commit_median_s": sorted(r["commit_s"] for r in timed)[len(timed) // 2],
               "commit_gbps": total / max(best["commit_s"], 1e-12) / 1e9, "update_best_s": update_s,
               "rounds": rounds}
        self.say(f"{case}: stage best {out['stage_best_s']:.3f} s, commit best {best['commit_s'] * 1e3:.1f} ms "
                 f"(median {out['commit_median_s'] * 1e3:.1f} ms, {out['commit_gbps']:.0f} GB/s of model bytes) "
                 f"against a full update of {update_s:.3f} s")
        return out

    def pool_section(self, case: str, share) -> dict:
        """RL steady state: the pool is allocated and pinned once, then re-filled by the next step."""
        first_name, next_name = f"{case}-pool-a", f"{case}-pool-b"
        first = self.timed(lambda: self.ps.register_checkpoint(first_name, named_tensors=share.named,
                                                               use_shared_memory_pool=True))
        self.ps.unregister_checkpoint(first_name)
        again = self.timed(lambda: self.ps.register_checkpoint(next_name, named_tensors=share.named,
                                                               use_shared_memory_pool=True))
        again["phases"] = self.ps.last_register["seconds"]
        self.ps.gather_metas(next_name)
        upd = self.first_and_best(next_name)
        self.ps.unregister_checkpoint(next_name, force=True)
        self.say(f"{case}: pool first {first['s']:.3f} s, re-register {again['s']:.3f} s ({phases(again['phases'])}), update first "
                 f"{upd['first_update_s']:.3f} s, best {upd['update_s']:.3f} s")
        return {"first_s": first["s"], "reregister_s": again["s"], "reregister_per_rank_s": again["per_rank"],
                "reregister_phases_rank0": again["phases"], **upd}

    def first_and_best(self, name: str) -> dict:
        """The first update of a newly registered checkpoint (plans it), then the best of the repeats."""
        ups = [self.update_once(name) for _ in range(1 + self.args.repeats)]
        best = min(ups[1:] or ups, key=lambda u: u["seconds"])
        return {"first_update_s": ups[0]["seconds"], "update_s": best["seconds"],
                "first_update_breakdown": ups[0]["ps"][0]["seconds"], "update_breakdown": best["ps"][0]["seconds"]}

    def shm_section(self, case: str, share, total: int) -> dict:
        """Register this rank's share from a /dev/shm safetensors file in place (mapped and pinned, not copied)."""
        from ckpt_core.checkpoint.safetensors import write_file
        st = os.statvfs(SHM) if os.path.isdir(SHM) else None
        room = st.f_bavail * st.f_frsize if st else 0
        fits = self.gather(room >= total * 1.05 + (64 << 20))   # every local rank writes its share at once
        if not all(fits):
            self.say(f"{case}: /dev/shm has too little room ({room / GiB:.1f} GiB) for {total / GiB:.1f} GiB: skipped")
            return {"skipped": f"/dev/shm too small ({room / GiB:.1f} GiB free)"}
        name = f"{case}-shm"
        path = os.path.join(SHM, f"ckptbench-{os.getpid()}-{case}-r{self.rank}.safetensors")
        try:
            write = self.timed(lambda: write_file(path, share.named))
            reg = self.timed(lambda: self.ps.register_checkpoint(name, files=[path]))
            reg["phases"] = self.ps.last_register["seconds"]
            self.ps.gather_metas(name)
            upd = self.first_and_best(name)
            self.ps.unregister_checkpoint(name)
        finally:
            if os.path.exists(path):
                os.remove(path)
        self.say(f"{case}: /dev/shm write {write['s']:.3f} s, in-place register {reg['s']:.3f} s ({phases(reg['phases'])}), "
                 f"update first {upd['first_update_s']:.3f} s, best {upd['update_s']:.3f} s")
        return {"write_s": write["s"], "register_s": reg["s"], "register_per_rank_s": reg["per_rank"],
                "register_phases_rank0": reg["phases"], **upd}

    # -- run -------------------------------------------------------------------------
    def meta(self) -> dict:
        m = {"world_size": self.world, "device": self.kind, "torch": torch.__version__, "python": sys.version.split()[0],
             "scale": self.args.scale, "repeats": self.args.repeats, "free_mem_gib": self.args.free_mem_gib,
             "keep_device_buffers": self.args.keep_device_buffers, "cases": self.args.cases,
             "engine_copy": self.args.engine_copy, "delta_density": self.args.delta_density,
             "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("PS_", "NCCL_"))}}
        if self.kind == "cuda":
            m["device_name"] = torch.cuda.get_device_name(self.local)
            m["device_memory_bytes"] = torch.cuda.get_device_properties(self.local).total_memory
            m["cuda"] = torch.version.cuda
            m["nccl"] = str(torch.cuda.nccl.version())
        return m

    def run(self) -> dict:
        cases = [self.run_case(c) for c in self.args.cases]
        result = {"meta": self.meta(), "ceilings": self.ceilings, "cases": cases}
        result["targets"] = check_targets(result)
        return result

    def close(self) -> None:
        self.ps.close()
        if self.front is not None:
            self.front.close()
        self.worker.close()
        dist.destroy_process_group()


def phases(seconds: dict) -> str:
    """Rank 0's registration phases, e.g. 'allocate 0.1 / fill 0.5 / pin 0.4'."""
    return " / ".join(f"{k} {v:.3f}" for k, v in seconds.items() if k != "total" and v >= 0.0005)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.free_mem_gib is not None and args.device != "cuda":
        print("[bench] --free-mem-gib applies to cuda only; ignored", flush=True)
        args.free_mem_gib = None
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import logging
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    bench = Bench(args)
    try:
        result = bench.run()
        if bench.rank == 0:
            print("\n" + format_report(result), flush=True)
            if args.delta_density is not None:
                print("\n" + format_delta(result["cases"]), flush=True)
            if args.out:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1, default=str)
                print(f"[bench] results written to {args.out}", flush=True)
    finally:
        bench.close()
    return 0


def _engine(argv: list[str]) -> tuple[str, list[str]]:
    """(``--engine`` value, the other arguments): ``simulated`` (default) or ``vllm``."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", choices=("simulated", "vllm"), default="simulated")
    known, rest = pre.parse_known_args(argv)
    return known.engine, rest


if __name__ == "__main__":
    engine, rest = _engine(sys.argv[1:])
    if engine == "vllm":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import vllm_bench
        sys.exit(vllm_bench.main(rest))
    sys.exit(main(rest))
