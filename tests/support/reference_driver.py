"""A driver written for the reference checkpoint-engine (the shape of its README's `examples/update.py`
usage: torchrun, one PS rank per device, the first rank of each inference group posts to its engine's
/collective_rpc), spelled with the reference's own keywords, where only the imports were changed.

    # before: from checkpoint_engine.ps import ParameterServer
    #         from checkpoint_engine.api import request_inference_to_update
    from ckpt_core import ParameterServer, request_inference_to_update

tests/integration/test_migration.py runs it under torchrun against an engine that has no
/reset_prefix_cache route. Nothing below the imports may change for the test to mean anything.
"""

import argparse
import os
import time
from datetime import timedelta

import httpx
import torch.distributed as dist

from ckpt_core import ParameterServer, request_inference_to_update


def shard_of_files(checkpoint_path: str, rank: int, world_size: int) -> list[str]:
    files = sorted(os.path.join(checkpoint_path, f) for f in os.listdir(checkpoint_path)
                   if f.endswith(".safetensors"))
    per_rank = -(-len(files) // world_size)
    return files[rank * per_rank:(rank + 1) * per_rank]


def wait_for_engine(endpoint: str, uds: str | None = None, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(transport=httpx.HTTPTransport(uds=uds)) as client:
        while True:
            try:
                if client.get(f"{endpoint}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{endpoint} is not ready")
            time.sleep(0.5)


def make_req_func(endpoint: str, inference_parallel_size: int, uds: str | None = None):
    rank = int(os.environ["RANK"])
    first = rank // inference_parallel_size * inference_parallel_size

    def req_func(socket_paths: list[tuple[str, str]]) -> None:
        if rank == first:
            request_inference_to_update(url=f"{endpoint}/collective_rpc",
                                        socket_paths=dict(socket_paths[first:first + inference_parallel_size]),
                                        timeout=120.0, uds=uds)
    return req_func


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-path", required=True)
    parser.add_argument("--checkpoint-name", default="my-checkpoint-iter-0")
    parser.add_argument("--endpoint", default="http://localhost:19730")
    parser.add_argument("--inference-parallel-size", type=int, default=8)
    parser.add_argument("--uds", default=None)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    ps = ParameterServer(auto_pg=True)
    ps.register_checkpoint(checkpoint_name=args.checkpoint_name,
                           files=shard_of_files(args.checkpoint_path, rank, world_size), named_tensors={},
                           use_shared_memory_pool=False, use_inplace_pin_memory=True)
    ps.init_process_group(timeout=timedelta(minutes=10))
    wait_for_engine(args.endpoint, args.uds)
    dist.barrier()
    ps.gather_metas(checkpoint_name=args.checkpoint_name)
    req_func = make_req_func(args.endpoint, args.inference_parallel_size, args.uds)
    ps.update(checkpoint_name=args.checkpoint_name, req_func=req_func, timeout=timedelta(minutes=5), ranks=None)
    ps.store_based_barrier(timeout=timedelta(minutes=5))
    ps.unregister_checkpoint(args.checkpoint_name, True)
    print(f"rank {rank}: updated {args.checkpoint_name}", flush=True)


if __name__ == "__main__":
    main()
