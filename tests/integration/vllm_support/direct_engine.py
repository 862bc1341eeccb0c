"""Direct full updates (``update_weights_from_ipc(..., direct=True)``) into a real vLLM-CPU engine.

Runs under the vLLM venv's python, this repo on PYTHONPATH:

    python direct_engine.py --model DIR --cold FILE [FILE ...] --steps JSON [--unpacked]

An offline engine (``vllm.LLM``, uniprocess executor, its worker in this process; the flags of the
test servers) starts with dummy weights; a one-rank CPU ``ParameterServer`` in this process (64 KiB
buckets: a layer's tensors straddle buckets) pushes each step's file: ``{"file", "direct": bool}``
through the worker extension's RPC (``"fail_on": name``: the reload rejects that tensor), or
``{"file", "stage": version}`` staged and committed.
``--unpacked``: vLLM-CPU's linear layers keep their weight and run ``F.linear``, as on a GPU
(``prepared_engine.keep_weights_unpacked``), in the cold loads too; without it the engine repacks
them as vLLM-CPU does. Prints one JSON line: ``{"cold": {file: digests}, "steps": [{"result": the
worker's reply or {"error_type", "error"}, "digests"}]}``; the ckpt_vllm log goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cold_load import ENV, EXTENSION, checkpoint_dir  # noqa: E402
from prepared_engine import KWARGS, _port, digests, keep_weights_unpacked, stage  # noqa: E402


@contextlib.contextmanager
def rejecting(name: str | None):
    """While this step runs, the reload of the engine's layers rejects checkpoint tensor ``name`` (as vLLM's
    loader rejects a tensor it cannot load), in this process's worker; None: nothing rejected."""
    from ckpt_core.errors import CheckpointFormatError
    from ckpt_vllm._reload import ReloadSession

    original = ReloadSession.load

    def load(self, weights):
        if any(n == name for n, _ in weights):
            raise CheckpointFormatError("rejected by the test (direct_engine.py --steps fail_on)", tensor=name)
        return original(self, weights)

    if name is not None:
        ReloadSession.load = load   # type: ignore[method-assign]
    try:
        yield
    finally:
        ReloadSession.load = original   # type: ignore[method-assign]


def push(llm, ps, index: int, step: dict) -> dict:
    """One step: a full update (``direct`` or not; ``fail_on``: a tensor the reload rejects), or a stage
    and its commit; the worker's reply, or the error."""
    with rejecting(step.get("fail_on")):
        return _push(llm, ps, index, step)


def _push(llm, ps, index: int, step: dict) -> dict:
    from ckpt_core.errors import CkptError

    name = f"step-{index}"
    try:
        if "stage" in step:
            stage(llm, ps, name, step["file"], step["stage"])
            return llm.collective_rpc("commit_staged_weights", args=(step["stage"],))[0]
        ps.register_checkpoint(name, files=[step["file"]])
        try:
            ps.gather_metas(name)
            replies: list = []
            ps.update(name, lambda handles: replies.extend(llm.collective_rpc(
                "update_weights_from_ipc", args=(dict(handles),), kwargs={"timeout": 120, "direct": step["direct"]})))
        finally:
            ps.unregister_checkpoint(name)
        return replies[0]
    except CkptError as exc:
        return {"error_type": type(exc).__name__, "error": str(exc)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--cold", type=Path, nargs="*", default=[])
    ap.add_argument("--steps", type=json.loads, required=True)
    ap.add_argument("--unpacked", action="store_true")
    args = ap.parse_args(argv)
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("ckpt_vllm").setLevel(logging.INFO)
    if args.unpacked:
        keep_weights_unpacked()
    from vllm import LLM

    from ckpt_core import ParameterServer

    out: dict = {"cold": {}, "steps": []}
    with tempfile.TemporaryDirectory() as tmp:
        for w in args.cold:
            llm = LLM(model=str(checkpoint_dir(args.model, w, Path(tmp) / "cold")), load_format="auto", **KWARGS)
            out["cold"][str(w)] = digests(llm)
            del llm
            gc.collect()
        start = checkpoint_dir(args.model, Path(args.steps[0]["file"]), Path(tmp) / "start")
        llm = LLM(model=str(start), load_format="dummy", **dict(KWARGS, worker_extension_cls=EXTENSION))
        with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=_port(),
                             max_bucket_gb=2 ** 16 / 2 ** 30) as ps:
            for i, step in enumerate(args.steps):
                out["steps"].append({"result": push(llm, ps, i, step), "digests": digests(llm)})
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)   # skip vLLM's atexit teardown


if __name__ == "__main__":
    main()
