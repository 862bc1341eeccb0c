"""A new inference instance joins and pulls the current weights from the owners' host memory (P2P).

Owners (the PS world that holds the checkpoint) serve it over Mooncake and write its metas; a
joining world (a separate torchrun world beside a new or restarted engine) registers nothing,
loads those metas and updates its own engines with ``ps.update(name, req_func, ranks=[...])``:
each joining rank reads its buckets from the owners' host memory and broadcasts them to the
other joiners. Needs the ``p2p`` extra (Mooncake; on hosts without CUDA
``mooncake-transfer-engine-non-cuda`` and ``libibverbs1``)::

    # host A, the owners: register, gather, write the metas, keep serving for 10 minutes
    torchrun --nproc-per-node 2 examples/p2p_join.py serve --checkpoint-path /ckpt/step-7 \\
        --metas /shared/metas.json --serve-s 600
    # host B, the joiners: load the metas, pull the checkpoint into this instance's engines
    torchrun --nproc-per-node 2 examples/p2p_join.py join --metas /shared/metas.json

The joiners' engine here is a stand-in inside each PS process (a dict of tensors filled by the
engine-side ``update_weights_from_ipc``), so this runs anywhere; each joining rank prints one JSON
line with what its engine received and a digest of it. With real engines, ``examples/
vllm_update.py`` and ``python -m ckpt_sglang.update`` take ``--save-metas-file`` /
``--load-metas-file`` / ``--update-method p2p`` for the same flow. Serving exposes the owners'
registered memory to whoever reaches Mooncake's ports: docs/p2p.md, "Who can read and write what".
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time

import torch
import zmq

from ckpt_core import ParameterServer, split_checkpoint_files, update_weights_from_ipc
from ckpt_core.engines import SECONDS, TIMEOUT, emit_json_line   # emit: one write per line, ranks share stdout


def serve(args: argparse.Namespace) -> int:
    """Owners: register this rank's share, gather, save the metas (rank 0), keep serving."""
    with ParameterServer(device=args.device, serve_p2p=True) as ps:
        ps.register_checkpoint(args.name, files=split_checkpoint_files(args.checkpoint_path, ps.rank, ps.world_size))
        ps.gather_metas(args.name)
        if ps.rank == 0:
            ps.save_metas(args.metas)   # versioned JSON: give it to the joiners (a shared file, HTTP, ...)
            emit_json_line({"serving": args.name, "metas": args.metas, "owners": ps.world_size})
        time.sleep(args.serve_s)        # the joiners pull while the checkpoint stays registered
    return 0


def digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def join(args: argparse.Namespace) -> int:
    """Joiners: own nothing, load the owners' metas, pull the checkpoint into this world's engines."""
    engine: dict[str, torch.Tensor] = {}   # this rank's engine: filled bucket by bucket
    lock = threading.Lock()

    def load(bucket):   # engine side: the tensors view the shared buffer only during the call
        with lock:
            engine.update((name, t.clone()) for name, t in bucket)

    with ParameterServer(device=args.device) as ps:
        ps.load_metas(args.metas)
        names = sorted(ps.get_metas()["checkpoints"])
        if args.name is None and len(names) != 1:
            raise SystemExit(f"the metas hold {names}: choose one with --name")
        name = args.name or names[0]
        req_func = lambda handles: update_weights_from_ipc(   # noqa: E731  (a real engine: post to it)
            zmq.Context.instance(), dict(handles)[ps.device_uuid], 0, run=load, timeout=args.timeout)
        result = ps.update(name, req_func, ranks=list(range(ps.world_size)), timeout=args.timeout)
        emit_json_line({"rank": ps.rank, "checkpoint": name, "tensors": len(engine),
                        "bytes": sum(t.numel() * t.element_size() for t in engine.values()),
                        "digest": digest(engine), "update_s": round(result["seconds"]["total"], 4)})
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("serve", help="owners: register a checkpoint, write its metas, serve it over P2P")
    s.add_argument("--checkpoint-path", required=True, help="directory of safetensors files")
    s.add_argument("--name", default="current", help="checkpoint name (default %(default)s)")
    s.add_argument("--serve-s", type=SECONDS, default=600.0, help="seconds to keep serving")
    j = sub.add_parser("join", help="joiners: pull the checkpoint described by the metas")
    j.add_argument("--name", default=None, help="checkpoint name (default: the only one in the metas)")
    for p in (s, j):
        p.add_argument("--metas", required=True, help="metas file the owners write and the joiners read")
        p.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
        p.add_argument("--timeout", type=TIMEOUT, default=300.0, help="seconds for the update")
    args = ap.parse_args(argv)
    return serve(args) if args.role == "serve" else join(args)


if __name__ == "__main__":
    sys.exit(main())
