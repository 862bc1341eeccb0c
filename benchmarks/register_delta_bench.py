"""Registering a version with a base against registering it whole (issue 39), in one process.

A world of one PS rank on the CPU (no launcher). Per case (``benchmarks/_bench_cases.py`` shapes at
``--scale``): version A is registered, then its next version B (``--density`` of every tensor's
elements changed, as ``update_bench.py --delta-density``: ``_bench_delta.perturb_``) is registered
``--repeats`` times each way, alternating, and unregistered after each:

- ``whole``: ``register_checkpoint("B", named_tensors=B)``;
- ``base``: ``register_checkpoint("B", named_tensors=B, base="A")`` with A's digests known (what every
  registration of a chain A -> B -> C ... after the first finds: a version registered with a base
  knows its own digests, ``delta/batch.py``);
- ``base_cold``: the same with A's digests forgotten first (the first version registered with a base
  against a version registered whole: A's digests are computed then, once).

With ``--pool`` every registration goes into the shared pool (``use_shared_memory_pool``): A holds one
region and B, whole or with its base, the second (an RL loop's chain alternates between the two), so
neither pays the first touch of fresh memory.

Best of each is reported (wall time, and the process's CPU time: less sensitive to a shared
machine's other work) with its phases (the registration's ``validate``/``allocate``/``fill``
laps, the delta's ``encode_s`` and its own phases), the ratio to ``whole``, and the load average
(the machine may be shared). ``--profile`` adds a breakdown of the work per pass over the same
tensors (copy into fresh and into touched memory, compare, positions, a full digest, a plain
``encode_tensor`` per tensor).

    PYTHONPATH=$PWD python benchmarks/register_delta_bench.py --cases dense16,moe8 --scale 0.005 --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_cases import build_case, materialize  # noqa: E402
from _bench_delta import perturb_  # noqa: E402

from ckpt_core import ParameterServer  # noqa: E402
from ckpt_core.delta.encode import as_words, encode_tensor  # noqa: E402
from ckpt_core.delta.lin64 import lin64  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forget_digests(ps: ParameterServer, name: str) -> None:
    ckpt = ps._catalog.checkpoints[name]
    digests = getattr(ckpt, "digests", None)
    if digests is not None:
        digests.clear()


def _one(ps: ParameterServer, named: dict, mode: str, pool: bool = False) -> dict:
    if mode == "base_cold":
        _forget_digests(ps, "A")
    t0, c0 = time.perf_counter(), time.process_time()
    ps.register_checkpoint("B", named_tensors=named, base=None if mode == "whole" else "A",
                           use_shared_memory_pool=pool)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {"total_s": total, "cpu_s": cpu, "phases": dict(ps.last_register["seconds"])}
    if mode != "whole":
        fig = ps._flows.versions.figures["B"]
        out["encode_s"] = fig["encode_s"]
        out["encode_phases"] = fig.get("phases", {})
        out["counts"] = {k: fig[k] for k in ("tensors", "changed_tensors", "changed_elements", "payload_bytes",
                                             "full_bytes")}
        out["encodings"] = fig["encodings"]
    ps.unregister_checkpoint("B")
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def profile(named_a: dict, named_b: dict) -> dict:
    """Seconds of each kind of work over every tensor of the case, one thread, one pass each."""
    pairs = [(named_b[n], named_a[n]) for n in named_b]
    nbytes = sum(b.numel() * b.element_size() for b, _ in pairs)
    fresh = torch.empty(nbytes, dtype=torch.uint8)

    def copy_into(buf):
        at = 0
        for b, _ in pairs:
            n = b.numel() * b.element_size()
            buf[at: at + n].copy_(b.reshape(-1).view(torch.uint8))
            at += n
    out = {"bytes": nbytes, "tensors": len(pairs)}
    out["copy_fresh_s"] = _timed(lambda: copy_into(fresh))          # first touch: page faults
    out["copy_touched_s"] = _timed(lambda: copy_into(fresh))
    words = [(as_words(b).numpy(), as_words(a).numpy()) for b, a in pairs]
    out["compare_elements_s"] = _timed(lambda: [np.not_equal(x, y) for x, y in words])
    w64 = [(b.reshape(-1).view(torch.uint8).numpy(), a.reshape(-1).view(torch.uint8).numpy()) for b, a in pairs]
    w64 = [(x[: x.size // 8 * 8].view(np.uint64), y[: y.size // 8 * 8].view(np.uint64)) for x, y in w64]
    out["compare_words_s"] = _timed(lambda: [np.not_equal(x, y) for x, y in w64])
    masks = [np.not_equal(x, y) for x, y in words]
    out["positions_s"] = _timed(lambda: [np.flatnonzero(m) for m in masks])
    out["digest_full_s"] = _timed(lambda: [lin64(b) for b, _ in pairs])
    out["encode_tensor_s"] = _timed(lambda: [encode_tensor(b, a) for b, a in pairs])
    out["python_per_tensor_s"] = _timed(lambda: [encode_tensor(b[:0], a[:0]) for b, a in pairs if b.dim()])
    return out


def run_case(ps: ParameterServer, case: str, args) -> dict:
    specs = build_case(case, args.scale)
    share = materialize(specs, torch.device("cpu"), seed=7)
    named_a = share.named
    named_b = {n: t.clone() for n, t in named_a.items()}
    gen = torch.Generator().manual_seed(11)
    changed = sum(perturb_(t, args.density, gen) for t in named_b.values())
    ps.register_checkpoint("A", named_tensors=named_a, use_shared_memory_pool=args.pool)
    runs: dict[str, list[dict]] = {"whole": [], "base": [], "base_cold": []}
    try:
        _one(ps, named_b, "base", args.pool)   # warm-up (A's digests computed once; the pool's second region)
        for _ in range(args.repeats):
            for mode in runs:
                runs[mode].append(_one(ps, named_b, mode, args.pool))
    finally:
        ps.unregister_checkpoint("A", True)
    best = {m: min(r, key=lambda x: x["total_s"]) for m, r in runs.items()}
    cpu = {m: min(x["cpu_s"] for x in r) for m, r in runs.items()}
    out = {"case": case, "scale": args.scale, "pool": args.pool, "tensors": len(specs), "bytes": share.buffer.numel(),
           "changed_elements": changed, "density": args.density, "best": best,
           "all_s": {m: [x["total_s"] for x in r] for m, r in runs.items()},
           "ratio_base": best["base"]["total_s"] / best["whole"]["total_s"],
           "ratio_base_cold": best["base_cold"]["total_s"] / best["whole"]["total_s"],
           "best_cpu_s": cpu, "ratio_base_cpu": cpu["base"] / cpu["whole"]}
    if args.profile:
        out["profile"] = profile(named_a, named_b)
    return out


def _line(r: dict) -> str:
    b = r["best"]
    enc = b["base"]
    phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in enc.get("encode_phases", {}).items())
    return (f"{r['case']:<8} x{r['scale']:<6}{' pool' if r.get('pool') else ''} {r['tensors']:>5} tensors {r['bytes'] / 1e6:8.1f} MB | whole "
            f"{b['whole']['total_s'] * 1e3:8.1f} ms | base {enc['total_s'] * 1e3:8.1f} ms "
            f"({r['ratio_base']:.2f}x; encode {enc['encode_s'] * 1e3:.1f} ms: {phases}) | base, A's digests "
            f"computed {b['base_cold']['total_s'] * 1e3:8.1f} ms ({r['ratio_base_cold']:.2f}x) | CPU time whole "
            f"{r['best_cpu_s']['whole'] * 1e3:.1f} ms, base {r['best_cpu_s']['base'] * 1e3:.1f} ms "
            f"({r['ratio_base_cpu']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="dense16,moe8")
    ap.add_argument("--scale", type=float, default=0.005)
    ap.add_argument("--density", type=float, default=0.02)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also time each kind of work on its own")
    ap.add_argument("--pool", action="store_true",
                    help="register every version into the shared pool (use_shared_memory_pool: A holds one region, "
                         "B takes the second; whole and base both into touched, pinned memory, as an RL loop's)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results = []
    load0 = os.getloadavg()
    with ParameterServer(0, 1, device="cpu", master_addr="127.0.0.1", master_port=_port()) as ps:
        for case in args.cases.split(","):
            r = run_case(ps, case, args)
            results.append(r)
            print(_line(r), flush=True)
            if "profile" in r:
                print("  profile (one thread, ms): " + ", ".join(
                    f"{k[:-2]} {v * 1e3:.1f}" for k, v in r["profile"].items() if k.endswith("_s")), flush=True)
    doc = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "argv": sys.argv[1:],
           "loadavg_before": load0, "loadavg_after": os.getloadavg(), "results": results}
    print(f"load average before {load0[0]:.2f}, after {doc['loadavg_after'][0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
