"""Weight syncs from a trainer process on the GPU into a real vLLM engine: ckpt-engine's trainer path
against vLLM's own ``ipc`` backend, each checked equal to a cold load.

On one H200 with vLLM 0.26 (../shared/gpu_vllm: ``PYTHONPATH=/tmp/vsite:$PWD``)::

    python benchmarks/trainer_bench.py --tiny --out /tmp/tb-tiny          # a first check, ~3 min
    python benchmarks/trainer_bench.py --shape 7b --out /tmp/tb-7b        # 7B-shaped bf16, ~8 min

This process is the trainer: it holds a model's parameters on the GPU (``--shape``'s HF names and
shapes, bf16; each round rewrites them in place from a seed, as an optimizer step would) and syncs
them ``1 + --repeats`` times into a fresh engine per backend (``--backends``):

- ``ckpt``: vLLM's trainer API with our backend, ``CkptTrainerWeightTransferEngine`` built through
  vLLM 0.26's factory form (``WeightTransferTrainerFactory.trainer_init("ckpt", None, info, ...)``):
  the PS rank in this process copies the weights device -> pinned host (``register``), then
  host -> the engine's device buffers, and the engine reloads them; ``send_weights()`` is the sync
  (``on_device=False``: the host path);
- ``ckpt-device``: the same trainer path with ``on_device=True``: the PS registers the trainer's GPU
  tensors where they lie (no copy to host) and the update copies them device -> the engine's buffers;
- ``ipc`` / ``ipc-packed``: vLLM's own backend, the trainer side 0.26 documents:
  ``start_weight_update``, ``IPCWeightTransferEngine.trainer_send_weights(params,
  IPCTrainerSendWeightsArgs(send_mode=..., packed=...))``, ``finish_weight_update``; the engine maps
  the trainer's memory (one handle per tensor, or one reused packed buffer) and loads from it.

The engine (``_trainer_bench_engine.py``) is an offline ``vllm.LLM`` in a child process with dummy
weights, driven over a Unix socket (JSON); it times its side of every call. Per round: the trainer
blocked (the whole sync call), the engine's ``update_weights`` (transfer into and reload of the
model), and for ``ckpt``/``ckpt-device`` the PS's register (for ``ckpt`` the copy to host, after which the
trainer's tensors are free; for ``ckpt-device`` only a check, the tensors are read in place) and update.
After the last round each engine's device checksums of every parameter and buffer and its greedy
tokens are compared with a cold load of the same weights (written to ``--dir``, loaded by a fresh
engine). Every wait is bounded (``--timeout``); progress lines go to stdout and ``OUT/bench.log``,
the results to ``OUT/results.json``, each engine's output to ``OUT/engine-<backend>.log``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _trainer_bench_engine import ENV, Channel, encode, run_cold, run_engine, stub_missing  # noqa: E402
from _vllm_bench_model import SHAPES  # noqa: E402

GiB = float(1 << 30)
BACKENDS = ("ckpt", "ckpt-device", "ipc", "ipc-packed")
CKPT_BACKENDS = ("ckpt", "ckpt-device")   # our trainer path: host pool, or the trainer's tensors on the device
_LOG = None


def say(msg: str) -> None:
    line = f"[trainer_bench {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if _LOG is not None:
        _LOG.write(line + "\n")
        _LOG.flush()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    p.add_argument("--tiny", action="store_true", help="shape tiny, 2 repeats: a fast first check")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma-separated: " + ", ".join(BACKENDS))
    p.add_argument("--repeats", type=int, default=3, help="timed syncs after the first")
    p.add_argument("--out", default=None, help="(required) results.json, bench.log and the engines' logs go here")
    p.add_argument("--dir", default="/dev/shm/ckpt-trainer-bench", help="the cold load's checkpoint is written here")
    p.add_argument("--gpu-mem", type=float, default=0.35, help="each engine's gpu_memory_utilization")
    p.add_argument("--timeout", type=float, default=600.0, help="bound of every wait (engine start, each call)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="no GPU: the ckpt backends only, weights on the CPU, into vLLM-CPU (checks this harness)")
    p.add_argument("--role", choices=("main", "engine", "cold"), default="main", help=argparse.SUPPRESS)
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sock", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.repeats = "tiny", min(args.repeats, 2)
    return args


# -- the trainer's weights ----------------------------------------------------------------------------
def write_config(shape: str, model_dir: str) -> None:
    import transformers

    cls_name, kwargs = SHAPES[shape]
    os.makedirs(model_dir, exist_ok=True)
    getattr(transformers, cls_name)(**kwargs, torch_dtype="bfloat16").save_pretrained(model_dir)


def build_params(model_dir: str, device: str) -> dict:
    """Every parameter of the model as a bf16 CUDA tensor under its HF name (what a trainer holds)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n: torch.empty(p.shape, dtype=torch.bfloat16, device=device) for n, p in model.named_parameters()}


def fill(params: dict, seed: int, round_: int) -> None:
    """Round ``round_``'s weights, in place (the same values whatever the backend)."""
    import torch

    device = next(iter(params.values())).device
    gen = torch.Generator(device=device).manual_seed(seed * 1000 + round_)
    for name, t in params.items():
        t.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.05 if name.endswith("norm.weight") else 0.02,
                  generator=gen)
    _sync_device(device)


def _sync_device(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def save_checkpoint(params: dict, model_dir: str, directory: str) -> str:
    """``params`` as a model directory (config + shards) for the cold load."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(directory):
        os.unlink(os.path.join(directory, f))
    shutil.copyfile(os.path.join(model_dir, "config.json"), os.path.join(directory, "config.json"))
    shard, size, n = {}, 0, 0
    for name, t in params.items():
        shard[name], size = t.cpu(), size + t.nbytes
        if size >= 2 << 30 or name == list(params)[-1]:
            n += 1
            save_file(shard, os.path.join(directory, f"model-{n:05d}.safetensors"))
            shard, size = {}, 0
    return directory


# -- the engines --------------------------------------------------------------------------------------
class Engine:
    """One backend's engine process and its channel; also vLLM's ``VLLMWeightSyncClient`` protocol."""

    def __init__(self, args, backend: str, model_dir: str):
        self.backend, self.timeout, self.engine_s = backend, args.timeout, {}
        path = tempfile.mktemp(prefix="ckpt-tbench-", suffix=".sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        server.settimeout(2.0)
        self.log = open(os.path.join(args.out, f"engine-{backend}.log"), "w")
        vllm_backend = "ckpt" if backend in CKPT_BACKENDS else "ipc"
        self.proc = subprocess.Popen([sys.executable, __file__, "--role", "engine", "--backend", vllm_backend,
                                      "--sock", path, "--model-dir", model_dir, "--gpu-mem", str(args.gpu_mem),
                                      "--timeout", str(args.timeout)],
                                     env=child_env(), stdout=self.log, stderr=subprocess.STDOUT)
        try:
            conn = self._accept(server, args.timeout)
        finally:
            server.close()
            os.unlink(path)
        self.ch = Channel(conn, args.timeout)
        self.start_s = self.ch.recv()["start_s"]

    def _accept(self, server: socket.socket, timeout: float) -> socket.socket:
        """The engine's connection, once its LLM is up; fails early if the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
                return conn
            except socket.timeout:
                if self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"the {self.backend} engine exited ({self.proc.returncode}) before it "
                                       f"served; see {self.log.name}") from None
        self.close()
        raise TimeoutError(f"the {self.backend} engine did not start within {timeout:.0f} s; see {self.log.name}")

    def _call(self, call: str, info=None) -> None:
        self.engine_s[call] = self.engine_s.get(call, 0.0) + self.ch.call({"call": call, "info": info})["s"]

    # vLLM's client protocol (the ckpt trainer engine drives these)
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call("init", init_info)

    def start_weight_update(self) -> None:
        self._call("start")

    def update_weights(self, update_info) -> None:
        self._call("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish")

    def state(self) -> dict:
        return self.ch.call({"call": "state"})

    def close(self) -> None:
        try:
            if getattr(self, "ch", None) is not None and self.proc.poll() is None:
                self.ch.call({"call": "bye"})
            self.proc.wait(60)
        except Exception:   # noqa: BLE001 - stopped below
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def child_env() -> dict:
    import torch

    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")])}
    if not torch.cuda.is_available():   # --cpu-smoke: vLLM-CPU
        env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1"})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ckpt_sync(engine: Engine, params: dict, timeout: float, device: str, on_device: bool = False):
    """The ``ckpt`` backend's trainer engine (vLLM 0.26's factory form where it exists) and its sync;
    ``on_device``: the trainer's tensors registered where they lie (``ckpt-device``), else copied to host."""
    from ckpt_vllm.trainer import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine

    info = CkptTrainerInitInfo(rank=0, world_size=1, device=device, timeout_s=timeout, master_addr="127.0.0.1",
                               master_port=_free_port(), reset_prefix_cache=False, on_device=on_device)
    from ckpt_vllm.plugin import register_trainer

    if register_trainer():   # vLLM's factory: 0.26's form takes the backend's name and config first
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory as factory
        if "backend" in inspect.signature(factory.trainer_init).parameters:
            trainer = factory.trainer_init("ckpt", None, info, client=engine, source=params)
        else:
            trainer = factory.trainer_init(info, client=engine, source=params)
    else:
        trainer = CkptTrainerWeightTransferEngine.trainer_init(info, client=engine, source=params)
    say(f"ckpt: trainer engine {type(trainer).__name__} (bases: {[c.__module__ for c in type(trainer).__mro__[1:3]]})")

    def sync() -> dict:
        result = trainer.send_weights()
        reg = trainer.ps.last_register
        return {"register_s": reg["seconds"]["total"], "ps_update_s": result["seconds"]["total"],
                "ps_seconds": result["seconds"], "bytes": result["bytes"], "on_device": reg.get("on_device", False)}
    return sync, trainer.shutdown


def ipc_sync(engine: Engine, params: dict, packed: bool):
    """vLLM 0.26's ``ipc`` trainer side: start, ``trainer_send_weights`` (a callable send mode that
    hands each payload to the engine), finish."""
    stub_missing()
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

    engine.init_weight_transfer_engine({})
    # vLLM's default packed buffer (1 GiB) is smaller than a 7B's embedding (1.09 GB): it would refuse it
    buffer = max(1 << 30, max(t.nbytes for t in params.values()))

    def send(update_info) -> None:
        fields = {"names": update_info.names, "dtype_names": update_info.dtype_names, "shapes": update_info.shapes,
                  "packed": update_info.packed, "ipc_handles": encode(update_info.ipc_handles)}
        if update_info.tensor_sizes is not None:
            fields["tensor_sizes"] = update_info.tensor_sizes
        engine.update_weights(fields)

    def sync() -> dict:
        engine.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(params.items()),
                                                     IPCTrainerSendWeightsArgs(send_mode=send, packed=packed,
                                                                               packed_buffer_size_bytes=buffer))
        engine.finish_weight_update()
        return {"packed_buffer_bytes": buffer} if packed else {}
    return sync, lambda: None


def run_backend(args, backend: str, params: dict, model_dir: str) -> dict:
    say(f"{backend}: starting its engine (bounded by {args.timeout:.0f} s)")
    engine, shutdown = None, None
    try:
        engine = Engine(args, backend, model_dir)
        say(f"{backend}: engine up in {engine.start_s:.1f} s")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
        sync, shutdown = ckpt_sync(engine, params, args.timeout, args.device, on_device=backend == "ckpt-device") \
            if backend in CKPT_BACKENDS else ipc_sync(engine, params, packed=backend == "ipc-packed")
        rounds = []
        for r in range(1 + args.repeats):
            fill(params, args.seed, r)
            engine.engine_s = {}
            t0 = time.perf_counter()
            extra = sync()
            _sync_device(args.device)
            blocked = time.perf_counter() - t0
            rounds.append({"round": r, "blocked_s": blocked, "engine_s": dict(engine.engine_s), **extra})
            say(f"{backend}: round {r}: trainer blocked {blocked:.3f} s, engine's update "
                f"{engine.engine_s.get('update', 0.0):.3f} s" +
                (f", register {extra['register_s']:.3f} s" if extra.get("register_s") is not None else ""))
        state = engine.state()
        return {"backend": backend, "engine_start_s": engine.start_s, "rounds": rounds, "state": state}
    except Exception as exc:   # noqa: BLE001 - one backend's failure is reported, the others still run
        say(f"{backend}: FAILED: {type(exc).__name__}: {exc}")
        return {"backend": backend, "error": f"{type(exc).__name__}: {exc}"[:4000]}
    finally:
        if shutdown is not None:
            shutdown()
        if engine is not None:
            engine.close()


def cold_state(args, directory: str) -> dict:
    say(f"cold load of the last round from {directory}")
    cmd = [sys.executable, __file__, "--role", "cold", "--model-dir", directory, "--gpu-mem", str(args.gpu_mem)]
    with open(os.path.join(args.out, "engine-cold.log"), "w") as log:
        out = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=log, text=True,
                             timeout=args.timeout)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"the cold load exited {out.returncode} (see engine-cold.log)")
    return json.loads(lines[-1][len("RESULT "):])


def compare(run: dict, cold: dict) -> None:
    """vllm_bench's comparison: every parameter and buffer; the attention layers' KV scales, unused
    with a bf16 KV cache and left at their dummy values by 0.26's reload, are counted apart."""
    from vllm_bench import compare as bench_compare

    state = run.pop("state")
    run["vs_cold_load"] = {**bench_compare(cold["checksums"], state["checksums"]),
                           "tokens_equal": state["tokens"] == cold["tokens"]}


def summary(report: dict) -> str:
    size = report["bytes"]
    lines = [f"{report['shape']}: {report['tensors']} tensors, {size / GiB:.2f} GiB bf16",
             "| backend | first sync | best sync (trainer blocked) | GB/s | engine's update (best) | register (best) "
             "| equal to a cold load |", "|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        if "error" in run:
            lines.append(f"| {run['backend']} | {run['error'][:80]} | | | | | |")
            continue
        timed = run["rounds"][1:] or run["rounds"]
        best = min(r["blocked_s"] for r in timed)
        upd = min(r["engine_s"].get("update", 0.0) for r in timed)
        reg = [r["register_s"] for r in timed if r.get("register_s") is not None]
        eq = run.get("vs_cold_load") or {}
        eq_s = "not checked" if not eq else ("yes" if eq["equal"] and eq["tokens_equal"] else
                                             f"NO ({len(eq['differ'])} differ, tokens {eq['tokens_equal']})")
        if eq.get("unused_kv_scales_differ"):
            eq_s += f"; {len(eq['unused_kv_scales_differ'])} unused KV scales differ"
        lines.append(f"| {run['backend']} | {run['rounds'][0]['blocked_s']:.3f} s | {best:.3f} s | "
                     f"{size / best / 1e9:.1f} | {upd:.3f} s | {f'{min(reg):.3f} s' if reg else '-'} | {eq_s} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    global _LOG
    args = parse_args(argv)
    if args.role == "engine":
        return run_engine(args)
    if args.role == "cold":
        return run_cold(args)
    import torch

    if not args.out:
        raise SystemExit("--out DIR is required")
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu" and not args.cpu_smoke:
        raise SystemExit("trainer_bench needs a CUDA device (the trainer holds its weights there); "
                         "--cpu-smoke checks the harness on vLLM-CPU")
    if args.device == "cpu":   # vLLM's ipc backend is CUDA IPC; the cpu device stands in for ckpt-device's GPU
        args.backends = ",".join(b for b in args.backends.split(",") if b in CKPT_BACKENDS) or "ckpt"
    os.makedirs(args.out, exist_ok=True)
    _LOG = open(os.path.join(args.out, "bench.log"), "a")
    os.environ.update({k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
    model_dir = os.path.join(args.out, "model")
    write_config(args.shape, model_dir)
    params = build_params(model_dir, args.device)
    nbytes = sum(t.nbytes for t in params.values())
    where = torch.cuda.get_device_name() if args.device == "cuda" else "the CPU"
    say(f"trainer: {len(params)} tensors, {nbytes / GiB:.2f} GiB on {where}")
    report = {"shape": args.shape, "tensors": len(params), "bytes": nbytes, "repeats": args.repeats, "runs": []}
    for backend in [b for b in args.backends.split(",") if b]:
        report["runs"].append(run_backend(args, backend, params, model_dir))
    fill(params, args.seed, args.repeats)   # the last round's weights, which every engine should hold
    try:
        cold = cold_state(args, save_checkpoint(params, model_dir, args.dir))
        for run in report["runs"]:
            if "state" in run:
                compare(run, cold)
    except Exception as exc:   # noqa: BLE001 - reported; the timings stand
        say(f"cold load FAILED: {type(exc).__name__}: {exc}")
        report["cold_error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    say("\n" + summary(report))
    ok = all("error" not in r and r.get("vs_cold_load", {}).get("equal") and r["vs_cold_load"]["tokens_equal"]
             for r in report["runs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
