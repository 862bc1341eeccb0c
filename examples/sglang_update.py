"""Push one checkpoint per training step into running SGLang servers (the library, under torchrun).

For a single push, SGLang's own launcher flags work with ours: ``python -m ckpt_sglang.update
--checkpoint-path DIR --inference-parallel-size 8`` (docs/sglang.md). This driver is the same flow
written out for an RL loop: the parameter server is built once and reused for every step, so
process groups and the transfer plan are made once. Start each server with the stock worker
waiting for weights::

    python -m sglang.launch_server --model-path /models/qwen2 --tp 8 --port 19730 \\
        --load-format dummy --checkpoint-engine-wait-weights-before-ready
    torchrun --nproc-per-node 8 examples/sglang_update.py --endpoint http://127.0.0.1:19730 \\
        /ckpt/step-1 /ckpt/step-2 /ckpt/step-3

SGLang embeds the stock checkpoint-engine worker, so the PS speaks its wire (``wire="stock"``;
``--wire stock-0.3`` for servers with checkpoint-engine 0.2.1-0.3.4). The first rank of each
inference group posts its group's handles to its server with the step's name as SGLang's
``weight_version``; with requests in flight the client pauses generation (``--busy``), flushes
the cache and continues. One JSON line per step; the previous step is unregistered after each.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ckpt_core import ParameterServer, split_checkpoint_files
from ckpt_core.engines import MAX_DEVICES, TIMEOUT, count, emit_json_line, group_handles   # emit: ranks share stdout
from ckpt_sglang import BUSY_MODES, SglangClient


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="checkpoint directories, one per step, in order")
    ap.add_argument("--endpoint", default="http://localhost:19730", help="this group's SGLang server")
    ap.add_argument("--inference-parallel-size", type=count(MAX_DEVICES), default=None, help="ranks per server (default: all)")
    ap.add_argument("--wire", default="stock", choices=("stock", "stock-0.3"))
    ap.add_argument("--busy", default="retract", choices=BUSY_MODES,
                    help="requests in flight: pause generation this way, flush, continue; fail: fail the update")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    ap.add_argument("--timeout", type=TIMEOUT, default=300.0, help="seconds for each update")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    ips = args.inference_parallel_size or world
    client = SglangClient(args.endpoint, timeout=args.timeout) if rank % ips == 0 else None
    try:
        if client is not None:
            client.wait_ready(timeout=300)   # GET /model_info answers once the server runs
        with ParameterServer(device=args.device, wire=args.wire) as ps:
            previous = None
            for directory in args.checkpoints:
                name = os.path.basename(os.path.normpath(directory))
                ps.register_checkpoint(name, files=split_checkpoint_files(directory, ps.rank, ps.world_size))
                ps.gather_metas(name)
                reports = []

                def req_func(handles, name=name, reports=reports):
                    mine = group_handles(handles, ps.rank, ips)   # None on every rank but a group's first
                    if mine is not None:
                        reports.append(client.update(mine, weight_version=name, busy=args.busy))
                if client is not None:   # a model SGLang cannot reload: refused on every rank before anything moves
                    req_func.precheck = client.check_reloadable

                result = ps.update(name, req_func, timeout=args.timeout)
                if previous is not None:
                    ps.unregister_checkpoint(previous)
                previous = name
                if reports:
                    emit_json_line({"step": name, "rank": ps.rank, "bytes": result["bytes"],
                                    "update_s": round(result["seconds"]["total"], 4),
                                    "engine_s": {k: round(v, 4) for k, v in reports[0].seconds.items()}})
    finally:
        if client is not None:
            client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
