"""Push a checkpoint from parameter-server ranks into running vLLM servers (torchrun driver).

One PS rank per device of the engine, on the same host; every rank registers its share of the
checkpoint's safetensors files, then rank 0 asks each vLLM server to pull::

    torchrun --nproc-per-node 8 examples/vllm_update.py --checkpoint-path /ckpt/step-7 \\
        --endpoint http://127.0.0.1:8000 --inference-parallel-size 8

Flags follow checkpoint-engine's examples/update.py. With more ranks than one engine has
devices (``world size = k * --inference-parallel-size``), give ``--endpoint`` k comma-separated
URLs: ranks [i*n, (i+1)*n) feed the engine at the i-th URL. The vLLM servers must run with
``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls ckpt_vllm.VllmColocateWorkerExtension``
(``--path extension``, the default) or ``--weight-transfer-config '{"backend": "ckpt"}'``
(``--path backend``). Rank 0 prints each update's timings as one JSON line.

P2P (the ``p2p`` extra, Mooncake): ``--update-method p2p`` makes every rank pull the checkpoint
from the owners' host memory instead of broadcasting it (``all``: broadcast, then p2p). Owners
started with ``--save-metas-file m.json --sleep-time 600`` keep serving; a separate, joining
torchrun world started with ``--load-metas-file m.json`` (no ``--checkpoint-path``) registers
nothing and pulls the checkpoint into its own engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from ckpt_core import ParameterServer, split_checkpoint_files
from ckpt_core.errors import ConfigError
from ckpt_vllm import VllmClient



def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint-path", help="directory of safetensors files (an HF checkpoint)")
    ap.add_argument("--checkpoint-name", default="my-checkpoint-iter-0")
    ap.add_argument("--update-method", choices=("broadcast", "p2p", "all"), default="broadcast",
                    help="broadcast from every rank's share; p2p: every rank pulls from the owners' host "
                         "memory (Mooncake, the p2p extra); all: broadcast, then p2p")
    ap.add_argument("--inference-parallel-size", type=int, default=None,
                    help="devices of one engine (default: the world size)")
    ap.add_argument("--endpoint", default="http://localhost:19730",
                    help="vLLM server URL; comma-separated, one per engine, when there are several")
    ap.add_argument("--uds", default=None, help="talk HTTP over this Unix socket (one engine)")
    ap.add_argument("--save-metas-file", default=None, help="rank 0 writes the gathered metas here (JSON)")
    ap.add_argument("--load-metas-file", default=None,
                    help="join: register nothing, load these metas and pull the checkpoint from its owners (P2P)")
    ap.add_argument("--sleep-time", type=float, default=0.0,
                    help="seconds to keep the checkpoint registered after the update (owners serving joiners)")
    # ckpt-engine additions
    ap.add_argument("--path", choices=("extension", "backend"), default="extension",
                    help="worker extension (/collective_rpc) or the ckpt weight-transfer backend")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole update")
    ap.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for the servers")
    ap.add_argument("--pause", choices=("abort", "wait", "keep"), default=None,
                    help="pause generation around the update (default: keep serving)")
    return ap.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> tuple[list[str], int]:
    """Validate flags before any collective; returns the endpoint of each engine and its device count."""
    if not args.checkpoint_path and not args.load_metas_file:
        raise ConfigError("--checkpoint-path (or --load-metas-file, to join) is required")
    ips = args.inference_parallel_size or world_size
    if ips <= 0 or world_size % ips:
        raise ConfigError(f"world size {world_size} is not a multiple of --inference-parallel-size {ips}")
    endpoints = [e.strip() for e in args.endpoint.split(",") if e.strip()]
    if len(endpoints) != world_size // ips:
        raise ConfigError(f"{world_size // ips} engine(s) of {ips} devices need as many --endpoint URLs, "
                          f"got {len(endpoints)}: {endpoints}")
    if args.uds and len(endpoints) != 1:
        raise ConfigError("--uds addresses one engine; give a single --endpoint")
    return endpoints, ips


def make_req_func(clients: list[VllmClient], ips: int, args: argparse.Namespace, reports: list):
    """Rank 0's req_func: each engine pulls from its own ranks' handles, all engines at once."""
    def req_func(handles):
        errors: list[BaseException] = []

        def one(i: int, client: VllmClient) -> None:
            try:
                reports.append(client.update(handles[i * ips:(i + 1) * ips], path=args.path,
                                             timeout=args.timeout, pause=args.pause))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
    return req_func


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    world_size, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    endpoints, ips = check_args(args, world_size)
    clients = [VllmClient(e, uds=args.uds, timeout=args.timeout) for e in endpoints] if rank == 0 else []
    try:
        for c in clients:
            c.wait_ready(timeout=args.ready_timeout)
        with ParameterServer(device=args.device) as ps:
            t0 = time.perf_counter()
            if args.load_metas_file:   # join: this world owns nothing; it pulls from the owners (P2P)
                ps.load_metas(args.load_metas_file)
            else:
                ps.register_checkpoint(args.checkpoint_name,
                                       files=split_checkpoint_files(args.checkpoint_path, ps.rank, ps.world_size))
                ps.gather_metas(args.checkpoint_name)
            t_register = time.perf_counter() - t0
            if args.save_metas_file and ps.rank == 0:
                ps.save_metas(args.save_metas_file)   # versioned JSON, never pickle
            reports: list = []
            methods = ["p2p"] if args.load_metas_file else {"all": ["broadcast", "p2p"]}.get(args.update_method,
                                                                                            [args.update_method])
            for method in methods:
                ranks = list(range(ps.world_size)) if method == "p2p" else None
                result = ps.update(args.checkpoint_name, make_req_func(clients, ips, args, reports),
                                   ranks=ranks, timeout=args.timeout)
                if ps.rank == 0:
                    print(json.dumps({"checkpoint": args.checkpoint_name, "method": method,
                                      "register_and_gather_s": round(t_register, 4), "ps": result,
                                      "engines": [r.__dict__ for r in reports]}), flush=True)
                reports.clear()
            if args.sleep_time > 0:
                time.sleep(args.sleep_time)
    finally:
        for c in clients:
            c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
