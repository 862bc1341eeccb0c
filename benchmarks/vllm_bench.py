"""Weight updates into a real vLLM engine on one GPU: ckpt-engine against checkpoint-engine, equal to a cold load.

    python benchmarks/vllm_bench.py --shape 7b --ps ours,reference --repeats 3 --out vllm-7b.json
    python benchmarks/vllm_bench.py --shape tiny --quantization fp8 --verify
    python benchmarks/vllm_bench.py --shape 7b --format fp8-block --ps ours --verify
    python benchmarks/vllm_bench.py --shape 7b --ps ours --verify --delta-density 0.02
    python benchmarks/vllm_bench.py --shape moe4k --ps ours,reference --verify --direct

For each parameter-server implementation (``ours``: ckpt_core with ckpt_vllm's worker extension;
``reference``: checkpoint-engine with its own extension, when importable) this starts a vLLM
engine in this process with dummy weights (``vllm.LLM``, in-process engine core) and a PS rank in
a child process (CUDA IPC needs two processes), registers a checkpoint of fresh random data from
/dev/shm, and times a first update and ``--repeats`` more. The engine's side of each update
(``collective_rpc``) is timed too, and ckpt_vllm reports its own phases. With ``--verify`` every
parameter and buffer of the updated engine is compared, by a checksum computed on the device,
with a cold load of the same checkpoint in a fresh engine (another process), and greedy tokens too.
``--delta-density D`` (ours, bf16): after the full updates, ``--repeats`` delta versions are pushed
into the engine (``_vllm_bench_delta.py``); with ``--verify`` the engine is then compared with a cold
load of the last delta version (and, before the deltas, with the cold load of the checkpoint).
``--direct`` (ours): every timed update passes ``direct=True``: the first one goes through vLLM's
layerwise reload and records where each tensor lands (its time includes that recording), the next
ones copy the tensors of verbatim layers straight into the live model and reload only the other
layers; the report says which way each went and how many tensors were copied (docs/vllm.md,
"Direct full updates"). Without it every update is the usual reload.

Needs vLLM (the GPU build), transformers, safetensors. The benchmark controls the children through
a Unix socket carrying JSON, never pickle.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _vllm_bench_model import FORMATS, SHAPES, checksums, make_checkpoint  # noqa: E402

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_DEEP_GEMM": "0",
       "NCCL_NVLS_ENABLE": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
EXTENSIONS = {"ours": "ckpt_vllm.worker.VllmColocateWorkerExtension",
              "reference": "checkpoint_engine.worker.VllmColocateWorkerExtension"}
PROMPT = [[11, 42, 7, 99, 3, 250, 17, 5], [1, 2, 3, 4, 5, 6, 7, 8]]
GiB = float(1 << 30)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--ps", default="ours,reference", help="comma-separated: ours, reference")
    p.add_argument("--format", choices=FORMATS, default="bf16",
                   help="checkpoint format: bf16, or fp8-block (FP8 weights, a scale per 128x128 block)")
    p.add_argument("--quantization", default=None, help="vLLM --quantization (e.g. fp8: online FP8 of a bf16 checkpoint)")
    p.add_argument("--repeats", type=int, default=3, help="timed updates after the first")
    p.add_argument("--verify", action="store_true", help="compare with a cold load (names, bytes, tokens)")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--dir", default="/dev/shm/ckpt-vllm-bench", help="where the checkpoint is written")
    p.add_argument("--profile", default=None, help="write a cProfile of the engine's last update (text) here")
    p.add_argument("--stage", action="store_true",
                   help="ours: after the timed updates, stage once into device memory and time the commit")
    p.add_argument("--delta-density", default=None, metavar="D|measured",
                   help="ours, bf16: after the full updates, --repeats delta versions with a fraction D of every "
                        "tensor's elements changed (measured: the density study's), pushed as deltas and timed")
    p.add_argument("--direct", action="store_true",
                   help="ours: full updates with direct=True (the first records where each tensor lands, the next "
                        "copy verbatim layers' tensors straight into the live model)")
    p.add_argument("--gpu-mem", type=float, default=0.45, help="vLLM gpu_memory_utilization")
    p.add_argument("--role", choices=("main", "engine", "ps", "cold"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="ours", help=argparse.SUPPRESS)
    p.add_argument("--sock", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.delta_density is not None:
        from _bench_delta import parse_density
        if args.format != "bf16":
            p.error("--delta-density needs --format bf16 (a flipped bit of an fp8 weight may make a NaN)")
        try:
            args.delta_density = parse_density(str(args.delta_density))
        except ValueError as e:
            p.error(str(e))
    return args


# ---------------------------------------------------------------- JSON over a Unix socket
class Channel:
    def __init__(self, sock: socket.socket):
        self.sock, self.file = sock, sock.makefile("rwb")

    def send(self, obj) -> None:
        self.file.write(json.dumps(obj).encode() + b"\n")
        self.file.flush()

    def recv(self):
        line = self.file.readline()
        if not line:
            raise EOFError("the peer process closed its channel")
        return json.loads(line)


def new_llm(args, model_dir: str, load_format: str, impl: str):
    import torch
    from vllm import LLM
    extra = {"gpu_memory_utilization": args.gpu_mem}
    if not torch.cuda.is_available():  # vLLM-CPU: a smoke run of this harness (float32, a small KV cache)
        extra = {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni"}
    return LLM(model=model_dir, load_format=load_format, enforce_eager=True, skip_tokenizer_init=True,
               worker_extension_cls=EXTENSIONS[impl], max_model_len=256, quantization=args.quantization, seed=0,
               **extra)


def greedy_tokens(llm) -> list[list[int]]:
    from vllm import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPT],
                        SamplingParams(max_tokens=12, temperature=0.0, detokenize=False), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def engine_checksums(llm) -> dict:
    return llm.collective_rpc(_worker_checksums)[0]


def _worker_checksums(worker) -> dict:
    return checksums(worker.model_runner.model)


def _profiler():
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
    return prof


def _write_profile(prof, path: str) -> None:
    import io
    import pstats
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    with open(path, "w") as f:
        f.write(buf.getvalue())


# ---------------------------------------------------------------- roles
def run_engine(args) -> None:
    """One implementation: the engine here, its PS rank in a child; reports timings on stdout (last line)."""
    llm = new_llm(args, args.dir, "dummy", args.impl)
    path = tempfile.mktemp(prefix="ckpt-vbench-", suffix=".sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    child = subprocess.Popen([sys.executable, __file__, "--role", "ps", "--impl", args.impl, "--sock", path,
                              "--dir", args.dir, "--repeats", str(args.repeats)] + (["--stage"] if args.stage else [])
                             + (["--delta-density", str(args.delta_density)] if args.delta_density else [])
                             + (["--verify"] if args.verify else []),
                             env=child_env())
    server.settimeout(600)
    conn, _ = server.accept()
    ch = Channel(conn)
    engine_s, results, stage_report, snapshot = [], [], None, None
    while True:
        msg = ch.recv()
        if "snapshot" in msg:   # before the deltas: the full version's state, for --verify
            snapshot = {"tokens": greedy_tokens(llm), "checksums": engine_checksums(llm)}
            ch.send({"ok": True})
        elif "kwargs" in msg:   # a full update with deltas=True, or a delta (not among the timed full updates)
            t0 = time.perf_counter()
            res = llm.collective_rpc("update_weights_from_ipc", args=(msg["handles"],), kwargs=msg["kwargs"])
            call_s = time.perf_counter() - t0
            reply = res[0] if isinstance(res[0], dict) else {}
            # the worker's figures (of a full update with deltas=True: its map's) and the engine call's time
            ch.send(json.loads(json.dumps({"ok": True, "engine_s": call_s, "delta": reply.get("delta")}, default=str)))
        elif "stage" in msg:
            stage_report = stage_into(llm, msg["handles"], msg["stage"])
            ch.send({"ok": True})
        elif "handles" in msg:
            last = len(engine_s) == args.repeats
            prof = _profiler() if (args.profile and last) else None
            t0 = time.perf_counter()
            res = llm.collective_rpc("update_weights_from_ipc", args=(msg["handles"],),
                                     kwargs={"direct": True} if args.direct and args.impl == "ours" else {})
            engine_s.append(time.perf_counter() - t0)
            if prof is not None:
                _write_profile(prof, f"{args.profile}.{args.impl}.txt")
            results.append(res[0] if isinstance(res[0], dict) else None)
            ch.send({"ok": True})
        elif "done" in msg:
            break
    report = {"impl": args.impl, "register_s": msg["register_s"], "gather_s": msg["gather_s"],
              "update_s": msg["update_s"], "engine_s": engine_s, "bytes": msg["bytes"],
              "ckpt_vllm_phases": results[-1]["seconds"] if results and results[-1] else None,
              "delta": msg.get("delta"),
              "direct": [r.get("direct") for r in results if r] if args.direct and args.impl == "ours" else None}
    if snapshot is not None:
        report["full_tokens"], report["full_checksums"] = snapshot["tokens"], snapshot["checksums"]
    if stage_report is not None:
        t0 = time.perf_counter()
        res = llm.collective_rpc("commit_staged_weights", args=(stage_report["version"],))
        stage_report["commit_s"] = time.perf_counter() - t0
        stage_report["commit_phases"] = res[0]["seconds"]
        report["stage"] = {**stage_report, "ps_stage_s": msg.get("stage_s")}
    if args.verify:
        report["kv_cache_dtype"] = str(llm.llm_engine.vllm_config.cache_config.cache_dtype)
        report["tokens"] = greedy_tokens(llm)
        report["checksums"] = engine_checksums(llm)
    ch.send({"bye": True})
    child.wait(timeout=120)
    print("RESULT " + json.dumps(report), flush=True)


def stage_into(llm, handles: dict, version: str, timeout: float = 600.0) -> dict:
    """Stage one update into device memory (the worker receives on its own thread; poll until done),
    then prepare it in kernel format, about 512 MiB of layers per call (the calls a serving engine
    runs between steps)."""
    from ckpt_vllm._stage_polls import llm_rpc, prepare_staged, wait_staged

    rpc = llm_rpc(llm)
    t0 = time.perf_counter()
    rpc("update_weights_from_ipc", [handles], {"stage": version, "stage_device_bytes": 1 << 40})
    state = wait_staged(rpc, version, timeout, where="the benchmark's engine", poll_s=0.005)[0]
    out = {"version": version, "stage_engine_s": time.perf_counter() - t0, "worker": state}
    t1 = time.perf_counter()
    prepared, calls = prepare_staged(rpc, version, 512 << 20, timeout, where="the benchmark's engine")
    out["prepare"] = {**prepared[0], "calls": calls, "wall_s": time.perf_counter() - t1}
    return out


def run_ps(args) -> None:
    import logging

    import torch
    logging.basicConfig(level=logging.INFO, format="[ps %(asctime)s] %(name)s %(levelname)s %(message)s")
    from _vllm_bench_model import checkpoint_files
    files = checkpoint_files(args.dir)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.sock)
    ch = Channel(sock)
    if args.impl == "ours":
        from ckpt_core import ParameterServer
        ps = ParameterServer(rank=0, world_size=1, device="cuda" if torch.cuda.is_available() else "cpu")
        reg = {"files": files}
    else:
        from checkpoint_engine.ps import ParameterServer
        ps = ParameterServer(rank=0, world_size=1, auto_pg=True)
        reg = {"files": files, "use_inplace_pin_memory": False}  # in place, the reference deletes the files
    t0 = time.perf_counter()
    ps.register_checkpoint("bench", **reg)
    t1 = time.perf_counter()
    ps.gather_metas("bench")
    t2 = time.perf_counter()

    def req_func(handles):
        ch.send({"handles": dict(handles)})
        ch.recv()

    update_s = []
    for _ in range(1 + args.repeats):
        s = time.perf_counter()
        ps.update("bench", req_func)
        update_s.append(time.perf_counter() - s)
    stage_s = None
    if args.stage and args.impl == "ours":
        def stage_req(handles):
            ch.send({"handles": dict(handles), "stage": "staged"})
            ch.recv()
        s = time.perf_counter()
        ps.update("bench", stage_req)
        stage_s = time.perf_counter() - s
    nbytes = sum(os.path.getsize(f) for f in files)
    delta = None
    if args.delta_density and args.impl == "ours":
        from _vllm_bench_delta import run_deltas, summarize

        def send_update(handles, version, deltas):
            ch.send({"handles": dict(handles), "kwargs": {"deltas": deltas, "version": version}})
            return ch.recv()
        delta = run_deltas(ps, files, args.delta_density, args.repeats, send_update, args.dir,
                           snapshot=(lambda: (ch.send({"snapshot": True}), ch.recv())) if args.verify else None)
        delta["summary"] = summarize(delta, min(update_s[1:] or update_s), nbytes)
    ch.send({"done": True, "register_s": t1 - t0, "gather_s": t2 - t1, "update_s": update_s, "bytes": nbytes,
             "stage_s": stage_s, "delta": delta})
    ch.recv()


def run_cold(args) -> None:
    llm = new_llm(args, args.dir, "auto", "ours")
    print("RESULT " + json.dumps({"tokens": greedy_tokens(llm), "checksums": engine_checksums(llm)}), flush=True)


def child_env() -> dict:
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    if not _cuda():
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"})
    env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port())})
    return env


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_child(args, role: str, impl: str, timeout: float = 1800, directory: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--impl", impl, "--dir", directory or args.dir,
           "--shape", args.shape,
           "--repeats", str(args.repeats), "--gpu-mem", str(args.gpu_mem)]
    cmd += ["--verify"] if args.verify else []
    cmd += ["--profile", args.profile] if args.profile else []
    cmd += ["--stage"] if args.stage else []
    cmd += ["--direct"] if args.direct else []
    cmd += ["--delta-density", str(args.delta_density)] if args.delta_density else []
    cmd += ["--quantization", args.quantization] if args.quantization else []
    out = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=timeout)
    sys.stdout.write("\n".join(line for line in out.stdout.splitlines() if not line.startswith("RESULT ")) + "\n")
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return {"impl": impl, "error": f"{role} exited {out.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


# With an unquantized KV cache the attention layers never read these; vLLM 0.26 leaves their
# dummy-start values in place on a reload (a cold load sets 1.0). Named, counted, not hidden.
KV_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")


def compare(cold: dict, got: dict, kv_cache_dtype: str = "auto") -> dict:
    names = sorted(set(cold) | set(got))
    differ = [n for n in names if cold.get(n) != got.get(n)]
    unused = [n for n in differ if n.endswith(KV_SCALES)] if "fp8" not in str(kv_cache_dtype) else []
    other = [n for n in differ if n not in unused]
    return {"tensors": len(names), "differ": other, "unused_kv_scales_differ": unused, "equal": not other}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.role == "engine":
        run_engine(args)
        return 0
    if args.role == "ps":
        run_ps(args)
        return 0
    if args.role == "cold":
        run_cold(args)
        return 0
    info = make_checkpoint(args.shape, args.dir, fmt=args.format)
    print(f"checkpoint {args.shape} ({args.format}): {info['tensors']} tensors, {info['bytes'] / GiB:.2f} GiB in "
          f"{args.dir}", flush=True)
    report = {"shape": args.shape, "format": args.format, "quantization": args.quantization, "checkpoint": info,
              "runs": []}
    cold = run_child(args, "cold", "ours") if args.verify else None
    for impl in [s for s in args.ps.split(",") if s]:
        run = run_child(args, "engine", impl)
        if run.get("delta"):   # the engine ends on the last delta version; its full state was taken before
            from _vllm_bench_delta import delta_dir
            if cold is not None and "checksums" in run:
                cold_delta = run_child(args, "cold", "ours", directory=delta_dir(args.dir))
                kv = run.get("kv_cache_dtype", "auto")
                run["delta"]["vs_cold_load"] = compare(cold_delta.get("checksums", {}), run.pop("checksums"), kv)
                run["delta"]["tokens_equal_cold_load"] = run.pop("tokens") == cold_delta.get("tokens")
                run["checksums"], run["tokens"] = run.pop("full_checksums"), run.pop("full_tokens")
        if cold is not None and "checksums" in run:
            run["vs_cold_load"] = compare(cold["checksums"], run.pop("checksums"), run.get("kv_cache_dtype", "auto"))
            run["tokens_equal_cold_load"] = run.get("tokens") == cold["tokens"]
        report["runs"].append(run)
    print(format_report(report), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    ok = all("error" not in r for r in report["runs"])
    ok = ok and all((r.get("delta") or {}).get("vs_cold_load", {"equal": True})["equal"] for r in report["runs"])
    return 0 if ok else 1


def format_report(report: dict) -> str:
    size = report["checkpoint"]["bytes"]
    floor = size / 55.4e9
    lines = [f"{report['shape']} ({report.get('format', 'bf16')}, {size / GiB:.2f} GiB, "
             f"quantization {report['quantization']}); "
             f"H2D floor at 55.4 GB/s: {floor:.3f} s",
             "| PS | first update | best update | GB/s | x floor | engine's call (best) | equal to a cold load |",
             "|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} | | | | | |")
            continue
        best = min(r["update_s"][1:] or r["update_s"])
        eq = r.get("vs_cold_load")
        eq_s = "not checked" if eq is None else (f"yes ({eq['tensors']} tensors)" if eq["equal"]
                                                 else f"NO: {len(eq['differ'])} of {eq['tensors']} differ")
        if eq and eq.get("unused_kv_scales_differ"):
            eq_s += f"; {len(eq['unused_kv_scales_differ'])} KV scales (unused with this KV cache) differ"
        lines.append(f"| {r['impl']} | {r['update_s'][0]:.3f} s | {best:.3f} s | {size / best / 1e9:.1f} | "
                     f"{best / floor:.2f} | {min(r['engine_s'][1:] or r['engine_s']):.3f} s | {eq_s} |")
        if r.get("direct"):
            lines.append(format_direct(r["direct"]))
        if r.get("ckpt_vllm_phases"):
            lines.append("  ckpt_vllm phases of the last update: " + json.dumps(
                {k: round(v, 4) for k, v in r["ckpt_vllm_phases"].items()}))
        if r.get("delta"):
            from _vllm_bench_delta import format_delta
            d = r["delta"]
            lines.append(format_delta(d["summary"]))
            eq = d.get("vs_cold_load")
            if eq is not None:
                lines.append(f"  last delta version {d['version']} equal to its cold load: "
                             f"{'yes' if eq['equal'] else 'NO'} ({eq['tensors']} tensors, "
                             f"{len(eq['differ'])} differ), tokens equal: {d.get('tokens_equal_cold_load')}")
        st = r.get("stage")
        if st:
            pr = st.get("prepare") or {}
            lines.append(f"  prepared: {pr.get('state')} in {pr.get('calls')} calls, {pr.get('wall_s', 0):.3f} s"
                         + (f" ({pr['reason']})" if pr.get("reason") else ""))
            lines.append(f"  staged: PS {st['ps_stage_s']:.3f} s while the engine could serve, then commit "
                         f"{st['commit_s'] * 1e3:.1f} ms (worker phases {json.dumps({k: round(v, 4) for k, v in st['commit_phases'].items()})})")
    return "\n".join(lines)


def format_direct(paths: list[dict]) -> str:
    """Which way the updates of ``--direct`` went: the first (recording) and the last."""
    first, last = paths[0], paths[-1]
    fm = first.get("map") or {}
    out = [f"  direct: {len(paths)} updates, {sum(p['path'] == 'direct' for p in paths)} went direct; the first went "
           f"{first['path']} ({first.get('why')}; recording the map {fm.get('map_s', 0):.3f} s, its loading "
           f"{fm.get('record_s') or 0:.3f} s and checks {fm.get('decide_s') or 0:.3f} s: "
           f"{fm.get('direct_tensors', 0)} tensors direct, {fm.get('reloaded_groups', 0)} groups reloaded"
           f"{', unusable: ' + str(fm['whole']) if fm.get('whole') else ''})"]
    if last["path"] == "direct":
        out.append(f"  last update: direct {last['direct_tensors']} tensors ({last['direct_bytes'] / 1e6:.1f} MB, copy "
                   f"{last['copy_s']:.4f} s), reloaded {last['reloaded_layers']} layers ({last['reload_tensors']} "
                   f"tensors)")
    else:
        out.append(f"  last update: not direct ({last.get('why')})")
    if fm.get("why_reloaded"):
        out.append(f"  why groups are reloaded: {'; '.join(fm['why_reloaded'][:3])}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
