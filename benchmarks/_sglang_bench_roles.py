"""The child processes of benchmarks/sglang_bench.py: one parameter server each, talking to the
SGLang server itself (HTTP), and the H2D floor.

- ``ours``: ``ckpt_core.ParameterServer(wire="stock")`` with ``SglangClient.req_func(via="ipc")``
  (SGLang's ``/update_weights_from_ipc``), a first update and ``--repeats`` more;
- ``ours-loader``: the same PS and updates through our loader (``via="loader"``: the ``load`` op of
  ``ckpt_sglang.staging.load``, the stock worker loop straight into SGLang's ``load_weights``);
- ``reference``: checkpoint-engine 0.4.2's ``ParameterServer`` with the ``req_func`` of SGLang's
  own launcher (``sglang.srt.checkpoint_engine.update.req_inference``: ``/update_weights_from_ipc``,
  ``flush_cache``), the same updates;
- ``stage``: ours, staged into the server's device memory while it serves, then committed
  (``SglangClient.commit``: the pause, and SGLang's ``load_weights`` of the staged tensors).

Each prints ``RESULT {json}`` as its last line. Progress lines carry the seconds since start.
"""

from __future__ import annotations

import json
import os
import time

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[sglang-bench child +{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def _files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def run_ours(url: str, directory: str, repeats: int, via: str = "ipc") -> dict:
    from ckpt_core import ParameterServer
    from ckpt_sglang import SglangClient

    impl = "ours" if via == "ipc" else f"ours, {via}"

    files = _files(directory)
    with ParameterServer(rank=0, world_size=1, device="cuda", wire="stock") as ps, \
            SglangClient(url, timeout=900) as client:
        t0 = time.perf_counter()
        ps.register_checkpoint("bench", files=files)
        t1 = time.perf_counter()
        ps.gather_metas("bench")
        t2 = time.perf_counter()
        say(f"{impl}: registered {len(files)} files in {t1 - t0:.2f} s, metas {t2 - t1:.2f} s")
        updates, phases, engine = [], [], []
        for i in range(1 + repeats):
            s = time.perf_counter()
            result = ps.update("bench", client.req_func(weight_version=f"ours-{via}-{i}", via=via), timeout=900)
            updates.append(time.perf_counter() - s)
            phases.append(result["seconds"])
            engine.append(client.last_report.seconds)
            if client.last_report.path != via:
                raise RuntimeError(f"{impl}: the update went through {client.last_report.path!r}")
            say(f"{impl}: update {i}: {updates[-1]:.3f} s (PS {result['seconds']}, engine's HTTP call "
                f"{client.last_report.seconds.get('update', 0):.3f} s)")
        return {"impl": impl, "register_s": t1 - t0, "gather_s": t2 - t1, "update_s": updates,
                "ps_seconds": phases, "engine_seconds": engine, "buckets": result["buckets"],
                "bucket_bytes": result["bucket_bytes"], "sessions": client.server.sessions}


def run_reference(url: str, directory: str, repeats: int) -> dict:
    from checkpoint_engine.ps import ParameterServer
    from sglang.srt.checkpoint_engine.update import req_inference

    files = _files(directory)
    ps = ParameterServer(rank=0, world_size=1, auto_pg=True)
    ps._p2p_store = None   # as SGLang's launcher does
    t0 = time.perf_counter()
    # not in place: in place, checkpoint-engine deletes /dev/shm files after pinning them
    ps.register_checkpoint("bench", files=files, use_inplace_pin_memory=False)
    t1 = time.perf_counter()
    ps.gather_metas("bench")
    t2 = time.perf_counter()
    say(f"reference: registered {len(files)} files in {t1 - t0:.2f} s, metas {t2 - t1:.2f} s")
    updates = []
    for i in range(1 + repeats):
        s = time.perf_counter()
        ps.update("bench", req_inference(url, 1, timeout=900.0, weight_version=f"reference-{i}"))
        updates.append(time.perf_counter() - s)
        say(f"reference: update {i}: {updates[-1]:.3f} s")
    return {"impl": "reference", "register_s": t1 - t0, "gather_s": t2 - t1, "update_s": updates}


def run_stage(url: str, directory: str) -> dict:
    from ckpt_core import ParameterServer
    from ckpt_sglang import SglangClient

    with ParameterServer(rank=0, world_size=1, device="cuda", wire="stock") as ps, \
            SglangClient(url, timeout=900) as client:
        ps.register_checkpoint("bench", files=_files(directory))
        ps.gather_metas("bench")
        s = time.perf_counter()
        staged = ps.update("bench", client.req_func(stage="staged", stage_device_bytes=1 << 40), timeout=900)
        stage_s = time.perf_counter() - s
        opened = dict(client.last_report.seconds)
        say(f"stage: {stage_s:.3f} s while the server served (its pause to open it: {opened.get('paused', 0):.3f} s)")
        report = client.commit("staged", timeout=900)
        say(f"commit: paused {report.seconds['paused']:.3f} s; {report.seconds}")
        return {"impl": "ours-staged", "stage_s": stage_s, "stage_ps": staged["seconds"], "stage_open": opened,
                "commit": report.seconds, "workers": report.workers}


def h2d_floor(nbytes: int, chunk: int = 1 << 30, rounds: int = 2) -> dict:
    """Seconds a pinned host-to-device copy of ``nbytes`` takes on this GPU (one pinned chunk copied
    again and again; the best of ``rounds``): what no update of those bytes can beat."""
    import torch

    chunk = min(chunk, nbytes)
    host = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            dev[:n].copy_(host[:n], non_blocking=True)
            left -= n
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del host, dev
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "seconds": best, "gbps": nbytes / best / 1e9}


def child_main(role: str, url: str, directory: str, repeats: int, nbytes: int) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s %(levelname)s %(message)s")
    if role == "ours":
        out = run_ours(url, directory, repeats)
    elif role == "ours-loader":
        out = run_ours(url, directory, repeats, via="loader")
    elif role == "reference":
        out = run_reference(url, directory, repeats)
    elif role == "stage":
        out = run_stage(url, directory)
    elif role == "floor":
        out = h2d_floor(nbytes)
    else:
        raise ValueError(f"unknown role {role!r}")
    print("RESULT " + json.dumps(out, default=str), flush=True)
