"""The engine side of benchmarks/trainer_bench.py: a vLLM engine in its own process, driven over JSON.

One process per backend (``--role engine``) holds an offline ``vllm.LLM`` (in-process engine core,
one worker) started with dummy weights and ``weight_transfer_config={"backend": ...}``, and answers
the trainer's calls over a Unix socket, one JSON line each way, never pickle:

    {"call": "init" | "start" | "update" | "finish", "info": {...}}  -> {"ok": true, "s": seconds}
    {"call": "state"}   -> {"ok": true, "checksums": {...}, "tokens": [[...]]}
    {"call": "bye"}     -> {"ok": true}, then the process exits
    any failure         -> {"ok": false, "error": "Type: message"}

``update`` is vLLM's own ``LLM.update_weights({"update_info": info})``; for the ``ipc`` backend the
trainer's CUDA IPC handles (the argument tuples of ``torch.multiprocessing.reductions.reduce_tensor``)
travel in the JSON form of :func:`encode` / :func:`decode` (bytes, dtypes, sizes and an allow-list of
torch classes), not in vLLM's pickled HTTP form. ``--role cold`` loads the checkpoint from disk and
prints its checksums and tokens (the reference every backend is compared with).
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import socket
import sys
import time
import types

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_DEEP_GEMM": "0",
       "NCCL_NVLS_ENABLE": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = [[11, 42, 7, 99, 3, 250, 17, 5], [1, 2, 3, 4, 5, 6, 7, 8]]


# -- the JSON form of CUDA IPC handles -------------------------------------------------------------------
def encode(v):
    """JSON for the values a CUDA ``reduce_tensor`` tuple holds (nested in vLLM's handle dicts)."""
    import torch

    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, bytes):
        return {"bytes": base64.b64encode(v).decode()}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.Size):
        return {"size": list(v)}
    if isinstance(v, type):
        return {"class": f"{v.__module__}:{v.__qualname__}"}
    if isinstance(v, (tuple, list)):
        return {"tuple" if isinstance(v, tuple) else "list": [encode(x) for x in v]}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"dict": {k: encode(x) for k, x in v.items()}}
    raise TypeError(f"no JSON form for a {type(v).__name__} in an IPC handle")


def decode(v):
    """The inverse of :func:`encode`; a class outside torch's tensor and storage classes is refused."""
    import torch

    if not isinstance(v, dict):
        if isinstance(v, list):
            raise ValueError("a bare JSON list in an encoded IPC handle")
        return v
    (kind, x), = v.items()
    if kind == "bytes":
        return base64.b64decode(x)
    if kind == "dtype":
        dtype = getattr(torch, x, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"not a torch dtype: {x!r}")
        return dtype
    if kind == "size":
        return torch.Size(x)
    if kind == "class":
        return _torch_class(x)
    if kind in ("tuple", "list"):
        items = [decode(i) for i in x]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: decode(i) for k, i in x.items()}
    raise ValueError(f"unknown encoded kind {kind!r}")


def _torch_class(name: str) -> type:
    import torch

    module, _, qualname = name.partition(":")
    if module != "torch" and not module.startswith("torch."):
        raise ValueError(f"class {name!r} is not torch's")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    allowed = (torch.Tensor, torch.storage.TypedStorage, torch.storage.UntypedStorage)
    if not (isinstance(obj, type) and issubclass(obj, allowed)):
        raise ValueError(f"class {name!r} is not a tensor or storage class")
    return obj


# -- one JSON line each way over a Unix socket ---------------------------------------------------------
class Channel:
    def __init__(self, sock: socket.socket, timeout: float):
        sock.settimeout(timeout)
        self.sock, self.file, self.timeout = sock, sock.makefile("rwb"), timeout

    def send(self, obj) -> None:
        self.file.write(json.dumps(obj).encode() + b"\n")
        self.file.flush()

    def recv(self):
        try:
            line = self.file.readline()
        except socket.timeout as exc:
            raise TimeoutError(f"no answer from the peer within {self.timeout:.0f} s") from exc
        if not line:
            raise EOFError("the peer process closed its channel")
        return json.loads(line)

    def call(self, msg: dict) -> dict:
        self.send(msg)
        reply = self.recv()
        if not reply.get("ok"):
            raise RuntimeError(f"the engine failed {msg.get('call')}: {reply.get('error')}")
        return reply


def stub_missing(names=("ray", "requests")) -> list[str]:
    """vLLM 0.26's ``ipc_engine`` imports ray and requests at the top, for its 'ray' and 'http' send
    modes only; the GPU machine's package set has neither. Empty stand-ins let it import."""
    stubbed = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            stubbed.append(name)
    return stubbed


# -- the engine process --------------------------------------------------------------------------------
def new_llm(model_dir: str, load_format: str, backend: str | None, gpu_mem: float):
    import torch
    from vllm import LLM

    extra = {"gpu_memory_utilization": gpu_mem} if torch.cuda.is_available() else \
        {"dtype": "float32", "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni"}
    if backend:
        extra["weight_transfer_config"] = {"backend": backend}
    return LLM(model=model_dir, load_format=load_format, enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=256, seed=0, **extra)


def engine_state(llm) -> dict:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(max_tokens=12, temperature=0.0, detokenize=False), use_tqdm=False)
    return {"checksums": llm.collective_rpc(_worker_checksums)[0],
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def _worker_checksums(worker) -> dict:
    from _vllm_bench_model import checksums

    return checksums(worker.model_runner.model)


def _handle(llm, msg: dict) -> dict:
    call, info = msg["call"], msg.get("info") or {}
    t0 = time.perf_counter()
    if call == "init":
        llm.init_weight_transfer_engine({"init_info": info})
    elif call == "start":
        llm.start_weight_update()
    elif call == "update":
        if "ipc_handles" in info:
            info = {**info, "ipc_handles": decode(info["ipc_handles"])}
        llm.update_weights({"update_info": info})
    elif call == "finish":
        llm.finish_weight_update()
    elif call == "state":
        return {"ok": True, **engine_state(llm)}
    else:
        raise ValueError(f"unknown call {call!r}")
    return {"ok": True, "s": time.perf_counter() - t0}


def run_engine(args) -> int:
    os.environ.update(ENV)
    print(f"engine ({args.backend}): stubbed {stub_missing() or 'nothing'}", flush=True)
    from ckpt_vllm.plugin import register

    register()   # the entry point is not installed on the GPU machine (PYTHONPATH only)
    t0 = time.perf_counter()
    llm = new_llm(args.model_dir, "dummy", args.backend, args.gpu_mem)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(args.sock)
    ch = Channel(sock, args.timeout)
    ch.send({"ready": True, "start_s": time.perf_counter() - t0})
    while True:
        msg = ch.recv()
        if msg.get("call") == "bye":
            ch.send({"ok": True})
            return 0
        try:
            reply = _handle(llm, msg)
        except Exception as exc:   # noqa: BLE001 - answered to the trainer, which stops the run
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        ch.send(reply)


def run_cold(args) -> int:
    os.environ.update(ENV)
    llm = new_llm(args.model_dir, "auto", None, args.gpu_mem)
    print("RESULT " + json.dumps(engine_state(llm)), flush=True)
    return 0
