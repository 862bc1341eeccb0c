"""Weight updates into a real SGLang server on one GPU: ckpt-engine against checkpoint-engine,
each checked equal to a cold load.

    python benchmarks/sglang_bench.py --out DIR [--shape 7b] [--repeats 3] [--impls ours,ours-loader,reference]

A Qwen2-7B-shaped bf16 checkpoint of fresh random data is written to ``--dir`` (/dev/shm; reused
when present). One SGLang server (``benchmarks/_sglang_server.py``: the recipe's flags, dummy
weights, our two loaders) then takes, in turn:

1. the cold-load reference: SGLang's own file loader (``/update_weights_from_disk``), digests of
   every parameter and buffer computed on the device in the scheduler (``ckpt_sglang.probe``,
   mode ``sums``) and greedy tokens;
2. per implementation, after SGLang's weight checker scrambles every weight (so an update that
   does nothing cannot pass): a first update and ``--repeats`` more by a parameter server in a child
   process (``ours``: ckpt-engine, stock wire, SGLang's IPC route; ``ours-loader``: the same through
   our loader's direct ``load``, the row "ours, loader"; ``reference``: checkpoint-engine 0.4.2 with
   SGLang's launcher's ``req_func``), then digests and tokens against the reference;
3. ours staged into the server's device memory while it serves, then committed: the pause;
4. each launcher once, as users run it (``python -m sglang.srt.checkpoint_engine.update``, then
   ``python -m ckpt_sglang.update``): wall time, checked the same way.

The H2D floor is measured first (a pinned host-to-device copy of the same number of bytes).
Results: ``DIR/sglang-<shape>.json`` and a table on stdout; the server's log in ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from _sglang_server import SglangServer, differences, free_port, recipe_env, say  # noqa: E402

GiB = float(1 << 30)
PROMPTS = [[11, 42, 7, 99, 3, 250, 17, 5], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_NEW = 12


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON results and logs (created)")
    p.add_argument("--shape", default="7b", help="checkpoint shape of benchmarks/_vllm_bench_model.py (7b, tiny)")
    p.add_argument("--dir", default=None, help="where the checkpoint is written (default /dev/shm/ckpt-sglang-bench-SHAPE)")
    p.add_argument("--impls", default="ours,ours-loader,reference",
                   help="comma-separated: ours (SGLang's IPC route), ours-loader (our loader's direct load), reference")
    p.add_argument("--repeats", type=int, default=3, help="timed updates after the first, per implementation")
    p.add_argument("--no-stage", action="store_true", help="skip the staged update and its commit")
    p.add_argument("--no-launchers", action="store_true", help="skip the two launcher runs")
    p.add_argument("--prepare-only", action="store_true",
                   help="write the checkpoint (and measure the H2D floor) and stop: a first, shorter command")
    p.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang --mem-fraction-static")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for each child process")
    p.add_argument("--role", default="main", help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bytes", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child_env() -> dict:
    env = recipe_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(free_port())})
    env["PYTHONPATH"] = os.pathsep.join([HERE, env["PYTHONPATH"]])
    return env


def run_child(args, role: str, url: str | None = None, nbytes: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--out", args.out, "--dir", args.dir,
           "--repeats", str(args.repeats), "--bytes", str(nbytes)] + (["--url", url] if url else [])
    say(f"child {role}: {' '.join(cmd[1:])}")
    try:
        proc = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"impl": role, "error": f"{role} did not finish within {args.timeout:g} s"}
    lines = proc.stdout.splitlines()
    sys.stdout.write("\n".join(x for x in lines if not x.startswith("RESULT ")) + "\n")
    results = [x for x in lines if x.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        return {"impl": role, "error": f"{role} exited {proc.returncode}"}
    return json.loads(results[-1][len("RESULT "):])


def verify(server: SglangServer, cold: dict, what: str) -> dict:
    """The server against the cold-load reference: every digest, and greedy tokens."""
    differ = differences(server.digests("sums"), cold["digests"])
    tokens = server.generate(PROMPTS, MAX_NEW) == cold["tokens"]
    say(f"{what}: {'equal to' if not differ else f'{len(differ)} tensors differ from'} a cold load "
        f"({len(cold['digests'])} tensors); greedy tokens {'equal' if tokens else 'DIFFER'}")
    return {"tensors": len(cold["digests"]), "differ": differ[:20], "equal": not differ and tokens,
            "tokens_equal": tokens}


def scrambled(server: SglangServer, cold: dict) -> int:
    """SGLang's weight checker overwrites every weight with random values; returns how many tensors
    then differ from the reference (the update that follows must bring them all back)."""
    server.reset_tensors()
    return len(differences(server.digests("sums"), cold["digests"]))


def launcher_run(args, module: str, ckpt: str, url: str, version: str) -> dict:
    cmd = [sys.executable, "-m", module, "--checkpoint-path", ckpt, "--inference-parallel-size", "1",
           "--endpoint", url, "--update-method", "broadcast", "--weight-version", version]
    env = {k: v for k, v in recipe_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    say(f"launcher: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    out = {"module": module, "wall_s": time.perf_counter() - t0, "returncode": proc.returncode}
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if lines:
        out["figures"] = lines[-1]
    if proc.returncode != 0:
        out["stderr"] = proc.stderr[-3000:]
    with open(os.path.join(args.out, f"launcher-{module.split('.')[0]}.log"), "w") as f:
        f.write(proc.stdout + "\n---- stderr ----\n" + proc.stderr)
    say(f"launcher {module}: exit {proc.returncode} after {out['wall_s']:.1f} s")
    return out


def linked_copy(src: str, dst: str) -> str:
    """``src``'s files hard-linked into ``dst``: SGLang's launcher pins /dev/shm files in place and
    then deletes them; the links keep the checkpoint."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            os.link(path, os.path.join(dst, name))
    return dst


def run_main(args) -> int:
    from _vllm_bench_model import make_checkpoint

    os.makedirs(args.out, exist_ok=True)
    args.dir = args.dir or f"/dev/shm/ckpt-sglang-bench-{args.shape}"
    info = make_checkpoint(args.shape, args.dir)
    say(f"checkpoint {args.shape}: {info['tensors']} tensors, {info['bytes'] / GiB:.2f} GiB in {args.dir}"
        f"{' (reused)' if info.get('reused') else ''}")
    report = {"shape": args.shape, "checkpoint": info, "runs": [], "floor": run_child(args, "floor", nbytes=info["bytes"])}
    say(f"H2D floor: {report['floor']}")
    if args.prepare_only:
        return 0
    server = SglangServer(args.dir, os.path.join(args.out, f"sglang-server-{args.shape}.log"), load_format="dummy",
                          mem_fraction=args.mem_fraction, name=f"sglang {args.shape}")
    try:
        report["server_start_s"] = server.wait_up(900)
        report["disk_load_s"] = server.load_from_disk(args.dir)
        cold = {"digests": server.digests("sums"), "tokens": server.generate(PROMPTS, MAX_NEW)}
        say(f"reference: SGLang's file loader took {report['disk_load_s']:.2f} s; {len(cold['digests'])} tensors")
        for impl in [s for s in args.impls.split(",") if s]:
            changed = scrambled(server, cold)
            run = run_child(args, impl, server.url)
            run["scrambled_before"] = changed
            if "error" not in run:
                run["vs_cold_load"] = verify(server, cold, impl)
            report["runs"].append(run)
        if not args.no_stage:
            changed = scrambled(server, cold)
            stage = run_child(args, "stage", server.url)
            stage["scrambled_before"] = changed
            if "error" not in stage:
                stage["vs_cold_load"] = verify(server, cold, "staged and committed")
            report["stage"] = stage
        if not args.no_launchers:
            report["launchers"] = []
            for module, ckpt in (("sglang.srt.checkpoint_engine.update", linked_copy(args.dir, args.dir + "-ref")),
                                 ("ckpt_sglang.update", args.dir)):
                changed = scrambled(server, cold)
                run = launcher_run(args, module, ckpt, server.url, module.split(".")[0])
                run["scrambled_before"] = changed
                if run["returncode"] == 0:
                    run["vs_cold_load"] = verify(server, cold, module)
                report["launchers"].append(run)
            shutil.rmtree(args.dir + "-ref", ignore_errors=True)
    finally:
        server.close()
    text = format_report(report)
    print(text, flush=True)
    with open(os.path.join(args.out, f"sglang-{args.shape}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, f"sglang-{args.shape}.txt"), "w") as f:
        f.write(text + "\n")
    runs = report["runs"] + [report.get("stage") or {}] + report.get("launchers", [])
    ok = all("error" not in r and r.get("returncode", 0) == 0 and (r.get("vs_cold_load") or {}).get("equal", True)
             for r in runs if r)
    return 0 if ok else 1


def format_report(report: dict) -> str:
    size, floor = report["checkpoint"]["bytes"], report["floor"]
    floor_s = floor.get("seconds") or size / 55.4e9
    lines = [f"SGLang, {report['shape']} bf16 ({size / GiB:.2f} GiB); H2D floor {floor_s:.3f} s "
             f"({floor.get('gbps', 0):.1f} GB/s pinned); SGLang's own file loader {report.get('disk_load_s', 0):.2f} s",
             "| PS | first update | best update | GB/s | x floor | equal to a cold load |", "|---|---|---|---|---|---|"]
    best = {}
    for r in report["runs"]:
        if "error" in r:
            lines.append(f"| {r['impl']} | {r['error']} | | | | |")
            continue
        best[r["impl"]] = b = min(r["update_s"][1:] or r["update_s"])
        eq = r.get("vs_cold_load") or {}
        lines.append(f"| {r['impl']} | {r['update_s'][0]:.3f} s | {b:.3f} s | {size / b / 1e9:.1f} | "
                     f"{b / floor_s:.2f} | {'yes' if eq.get('equal') else 'NO'} ({eq.get('tensors')} tensors) |")
    for impl in ("ours", "ours, loader"):
        if impl in best and "reference" in best:
            lines.append(f"{impl} is {best['reference'] / best[impl]:.2f}x faster than the reference (best updates)")
    ours = next((r for r in report["runs"] if r.get("impl") == "ours" and "error" not in r), None)
    if ours:
        i = min(range(1, len(ours["update_s"])) or [0], key=lambda k: ours["update_s"][k])
        lines.append(f"  where ours' best update goes: PS {json.dumps({k: round(v, 4) for k, v in ours['ps_seconds'][i].items()})}; "
                     f"engine's HTTP call {json.dumps({k: round(v, 4) for k, v in ours['engine_seconds'][i].items()})}")
    st = report.get("stage")
    if st and "error" not in st:
        load = [w.get("seconds", {}).get("load") for w in st.get("workers") or [] if isinstance(w, dict)]
        lines.append(f"  staged in device memory while serving: {st['stage_s']:.3f} s; commit paused generation "
                     f"{st['commit']['paused']:.3f} s, of which SGLang's load_weights {load}; "
                     f"{'equal' if (st.get('vs_cold_load') or {}).get('equal') else 'NOT equal'} to a cold load")
    for run in report.get("launchers", []):
        eq = (run.get("vs_cold_load") or {}).get("equal")
        lines.append(f"  launcher {run['module']}: exit {run['returncode']}, {run['wall_s']:.1f} s wall; "
                     f"{'equal' if eq else 'NOT equal'} to a cold load")
    return "\n".join(lines)


IMPLS = ("ours", "ours-loader", "reference")


def main(argv=None) -> int:
    args = parse_args(argv)
    unknown = [s for s in args.impls.split(",") if s and s not in IMPLS]
    if unknown:
        print(f"sglang_bench.py: unknown --impls {unknown}; choose from {', '.join(IMPLS)}", file=sys.stderr)
        return 2
    if args.role == "main":
        return run_main(args)
    from _sglang_bench_roles import child_main
    child_main(args.role, args.url, args.dir, args.repeats, args.bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
