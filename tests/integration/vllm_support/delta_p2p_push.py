"""P2P deltas into a real vLLM server from a joining world: owners serve a chain of versions, a joiner pulls.

Two roles, each in the project venv:

    # the owners' world (torchrun, 2 ranks, PS_P2P_SERVE=1): register every version, the ones after the
    # first against the one before (base=), save the metas, serve until DONE_FILE appears
    torchrun --nproc-per-node 2 delta_p2p_push.py owners --metas METAS --done DONE_FILE FILE [FILE ...]
    # the joining world (one rank): load the owners' metas, take v0 whole, then the rest as P2P deltas
    delta_p2p_push.py joiner --metas METAS --endpoint URL --prompts JSON --max-tokens N --versions N

The joiner's engine is the vLLM server at ``URL`` (our worker extension, ``deltas=True``). Its steps:
v0 whole; v1 as a delta; v3 (a skipped version: the engine holds v1, v3's delta applies to v2),
which must be refused with ``DeltaBaseError`` before anything is read; v2, v3 as deltas. After each
step it prints one JSON line: ``{"version", "ok", "error", "result", "engine": the workers'
replies, "digests": ckpt_state_digests, "tokens": greedy completions}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

from ckpt_core import ParameterServer
from ckpt_core.errors import CkptError
from ckpt_vllm import VllmClient


def owners(args) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with ParameterServer(device="cpu", serve_p2p=True) as ps:
        for i, path in enumerate(args.files):
            tensors = load_file(path)
            ps.register_checkpoint(f"v{i}", named_tensors={n: tensors[n] for n in sorted(tensors)[rank::world]},
                                   base=f"v{i - 1}" if i else None)
            ps.gather_metas(f"v{i}")   # a version registered with base= carries its delta (v1@delta, ...)
        if rank == 0:
            tmp = Path(args.metas + ".tmp")
            ps.save_metas(str(tmp))
            tmp.rename(args.metas)
        deadline = time.monotonic() + args.serve_s
        while not Path(args.done).exists():   # serve the joiner's reads until it is done (bounded)
            if time.monotonic() > deadline:
                raise SystemExit(f"owners: no {args.done} after {args.serve_s} s")
            time.sleep(0.2)


def joiner(args) -> None:
    deadline = time.monotonic() + 300
    while not Path(args.metas).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"joiner: the owners wrote no {args.metas} in 300 s")
        time.sleep(0.2)
    client = VllmClient(args.endpoint, timeout=300)
    steps = [(0, False), (1, True), (3, True), (2, True), (3, True)][:args.versions + 1]
    with ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1",
                         master_port=int(os.environ["JOINER_PORT"])) as ps:
        ps.load_metas(args.metas)
        for index, delta in steps:
            name = f"v{index}"
            replies: list = []

            def req(handles, name=name, replies=replies):
                replies.append(client.update(handles, version=name, timeout=300, deltas=True).workers)

            line: dict = {"version": name, "delta": delta, "ok": True, "error": None, "result": None}
            try:
                line["result"] = ps.update(name, req, ranks=[0], timeout=300, delta=delta)
            except CkptError as exc:
                line.update(ok=False, error=type(exc).__name__, message=str(exc))
            with httpx.Client(base_url=args.endpoint, timeout=120.0) as http:
                resp = http.post("/v1/completions", json={
                    "model": "tiny", "prompt": args.prompts, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, "seed": 0})
            resp.raise_for_status()
            line.update(engine=replies[0] if replies else None,
                        digests=client.collective_rpc("ckpt_state_digests"),
                        tokens=[c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])])
            sys.stdout.write(json.dumps(line, default=str) + "\n")
            sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("owners", "joiner"))
    ap.add_argument("--metas", required=True)
    ap.add_argument("--done", help="owners: serve until this file exists")
    ap.add_argument("--serve-s", type=float, default=900.0)
    ap.add_argument("--endpoint")
    ap.add_argument("--prompts", type=json.loads)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--versions", type=int, default=4, help="joiner: steps after v0")
    ap.add_argument("files", nargs="*")
    args = ap.parse_intermixed_args()
    (owners if args.role == "owners" else joiner)(args)


if __name__ == "__main__":
    main()
