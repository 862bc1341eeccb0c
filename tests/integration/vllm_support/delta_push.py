"""Push a chain of versions into one vLLM server as deltas, with one PS rank per engine worker.

Run under torchrun (``--nproc-per-node`` = the server's tensor-parallel size), in the project venv:

    delta_push.py --endpoint URL --prompts JSON --max-tokens N FILE [FILE ...]

Each PS rank registers its share of every version (the tensors dealt round-robin by name), each
after the first against the one before (``base=``), and pushes them in order with
``update(..., delta=i > 0)``; rank 0 posts every worker's handle to the server
(``VllmClient.update(..., deltas=True)``). ``--direct``: every version whole instead, with
``direct=True`` (docs/vllm.md, Direct full updates). ``--slices``: every update routed by the slice plan the server's workers
record for the first version (``VllmClient.slice_plan``, shared by rank 0): each worker its boxes,
sliced deltas (docs/deltas.md, "Sliced deltas"). After each version rank 0 prints one JSON line:
``{"version", "ps": its result, "engine": the workers' replies, "digests": ckpt_state_digests,
"tokens": greedy completions of the prompts}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx
from safetensors.torch import load_file

from ckpt_core import ParameterServer
from ckpt_vllm import VllmClient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--prompts", type=json.loads, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--direct", action="store_true", help="whole versions with direct=True, not deltas")
    ap.add_argument("--slices", action="store_true", help="route every update by the workers' slice plan")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = VllmClient(args.endpoint, timeout=300)
    plan = None
    with ParameterServer(device="cpu") as ps:
        for i, path in enumerate(args.files):
            name = f"v{i}"
            tensors = load_file(path)
            ps.register_checkpoint(name, named_tensors={n: tensors[n] for n in sorted(tensors)[rank::world]},
                                   base=f"v{i - 1}" if i and not args.direct else None)
            ps.gather_metas(name)
            if args.slices and plan is None:
                plan = ps.share_slice_plan(client.slice_plan(ps.tensor_specs(name)) if rank == 0 else None)
            replies: list = []

            def req(handles, name=name, replies=replies):
                if rank == 0:
                    how: dict = {"direct": True} if args.direct else {"deltas": True}
                    if plan is not None:
                        how["slices"] = plan.digest
                    replies.append(client.update(handles, version=name, timeout=300, **how).workers)

            result = ps.update(name, req, timeout=300, delta=bool(i) and not args.direct, slices=plan)
            if rank == 0:
                emit({"version": name, "ps": result, "engine": replies[0],
                      "digests": client.collective_rpc("ckpt_state_digests"),
                      "tokens": completions(args.endpoint, args.prompts, args.max_tokens)})


def completions(endpoint: str, prompts: list, max_tokens: int) -> list[list[int]]:
    """The server's greedy completions (token ids) of token-id prompts, EOS ignored like HF's reference."""
    with httpx.Client(base_url=endpoint, timeout=120.0) as http:
        resp = http.post("/v1/completions", json={
            "model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "seed": 0})
    resp.raise_for_status()
    return [c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def emit(line: dict) -> None:
    """One JSON line on stdout (what the test reads)."""
    sys.stdout.write(json.dumps(line, default=str) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
