"""A real training loop that pushes its FSDP2 shards into a running vLLM server after every step.

Under torchrun, one rank per device of the engine (gloo on CPU, NCCL on GPU)::

    torchrun --nproc-per-node 2 examples/fsdp2_update.py --model-dir /models/qwen2-0.5b \\
        --endpoint http://127.0.0.1:8000 --steps 5

A small causal LM (a Hugging Face config, or a checkpoint with ``--load-weights``) is sharded
with ``fully_shard`` (each decoder layer, then the root) and trained on random tokens. After
every step each rank registers its own shards (``model.state_dict()``: DTensors) in a parameter
server that lives inside the trainer process, in the trainer's default process group
(``ParameterServer(auto_pg=False)``); nothing is gathered. The update then delivers every full
tensor to every worker of the engine. Rank 0 prints one JSON line per step with the timings of
the step, the registration, ``gather_metas`` and the update.

The vLLM server runs with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
ckpt_vllm.VllmColocateWorkerExtension``, with one worker per trainer rank on the same host
(``--tensor-parallel-size`` = the world size, or ``--inference-parallel-size`` ranks per server,
one ``--endpoint`` per server). Its model must have the trainer's config. ``--dump-dir`` also
writes the gathered model of every step (``full_tensor()``, after the update, outside the PS
path) and, with ``--prompts``, the server's greedy completions after each update, for checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ckpt_core import ParameterServer
from ckpt_core.engines import MAX_DEVICES, TIMEOUT, count, emit_json_line, number
from ckpt_vllm import VllmClient

# Bounds of the toy training loop's numbers: far above what it is for, low enough to fail fast.
MAX_STEPS, MAX_BATCH, MAX_SEQ, MAX_NEW_TOKENS = 10**6, 1 << 16, 1 << 20, 1 << 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True, help="a Hugging Face model directory (its config.json)")
    ap.add_argument("--load-weights", action="store_true", help="start from its weights, not a fresh init")
    ap.add_argument("--endpoint", default="http://127.0.0.1:8000",
                    help="vLLM server URL; comma-separated, one per group of --inference-parallel-size ranks")
    ap.add_argument("--inference-parallel-size", type=count(MAX_DEVICES), default=None,
                    help="workers of one server (default: world)")
    ap.add_argument("--steps", type=count(MAX_STEPS), default=3, help="training steps, one update after each")
    ap.add_argument("--lr", type=number(float, low=0, high=1e3), default=1e-2, help="AdamW learning rate")
    ap.add_argument("--batch", type=count(MAX_BATCH), default=4, help="sequences per rank and step")
    ap.add_argument("--seq", type=count(MAX_SEQ), default=32, help="tokens per sequence")
    ap.add_argument("--seed", type=number(int, low=0, low_open=False, high=2**32 - 1), default=0,
                    help="seed of the initial weights and the random batches")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    ap.add_argument("--timeout", type=TIMEOUT, default=600.0, help="seconds for one update")
    ap.add_argument("--dump-dir", default=None, help="write step-K.safetensors (the gathered model) here")
    ap.add_argument("--prompts", default=None, help="JSON token-id prompts: greedy completions after each update")
    ap.add_argument("--max-tokens", type=count(MAX_NEW_TOKENS), default=12, help="tokens of each completion")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def build_model(args, device: torch.device):
    """The causal LM, sharded with FSDP2 on a 1-D mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(args.seed)   # every rank starts from the same weights
    if args.load_weights:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_dir), dtype=torch.float32)
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model, opt, args, step: int, device: torch.device) -> float:
    gen = torch.Generator().manual_seed(args.seed * 7919 + 1000 * step + dist.get_rank())   # each rank its own batch
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def own_share(state: dict, rank: int) -> dict:
    """What this rank registers: its shards of every DTensor (the PS finds their boxes), and plain
    tensors (buffers every rank holds alike) on rank 0 only: a whole tensor has one owner."""
    from torch.distributed.tensor import DTensor
    return {n: t for n, t in state.items() if isinstance(t, DTensor) or rank == 0}


def complete(client: VllmClient, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy completions (token ids) of token-id prompts, EOS ignored."""
    resp = client.http.raise_for_status(client.http.request("POST", "/v1/completions", json={
        "model": served_model(client), "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "seed": 0}))
    return [c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def served_model(client: VllmClient) -> str:
    resp = client.http.raise_for_status(client.http.request("GET", "/v1/models"))
    return resp.json()["data"][0]["id"]


def dump(model, path: str) -> None:
    """The gathered model (a collective on every rank; rank 0 writes), for checks only."""
    from safetensors.torch import save_file
    full = {n: t.full_tensor().detach().cpu().contiguous() for n, t in model.state_dict().items()}
    if dist.get_rank() == 0:
        save_file(full, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ips = args.inference_parallel_size or world
    endpoints = [e.strip() for e in args.endpoint.split(",") if e.strip()]
    group, leader = rank // ips, rank % ips == 0
    client = VllmClient(endpoints[group % len(endpoints)], timeout=args.timeout) if leader else None
    prompts = json.loads(args.prompts) if args.prompts else None
    try:
        if client is not None:
            client.wait_ready(timeout=300)
        model = build_model(args, device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        # The PS lives in the trainer: the trainer's default group, this process's device.
        with ParameterServer(device=device.type, auto_pg=False) as ps:
            req = client.req_func(rank=rank, inference_parallel_size=ips, path="extension") if client \
                else (lambda handles: None)
            previous = None
            for step in range(args.steps):
                t0 = time.perf_counter()
                loss = train_step(model, opt, args, step, device)
                t1 = time.perf_counter()
                name = f"step-{step}"
                ps.register_checkpoint(name, named_tensors=own_share(model.state_dict(), rank))
                t2 = time.perf_counter()
                ps.gather_metas(name)
                t3 = time.perf_counter()
                result = ps.update(name, req, timeout=args.timeout)
                t4 = time.perf_counter()
                if previous is not None:
                    ps.unregister_checkpoint(previous)
                previous = name
                line = {"step": step, "loss": round(loss, 5), "train_s": round(t1 - t0, 4),
                        "register_s": round(t2 - t1, 4), "registered_bytes": ps.last_register["bytes"],
                        "gather_metas_s": round(t3 - t2, 4), "update_s": round(t4 - t3, 4),
                        "bytes": result["bytes"], "buckets": result["buckets"]}
                if args.dump_dir:
                    os.makedirs(args.dump_dir, exist_ok=True)
                    dump(model, os.path.join(args.dump_dir, f"{name}.safetensors"))
                    if prompts is not None and client is not None:
                        line["completions"] = complete(client, prompts, args.max_tokens)
                if leader:
                    emit_json_line({"rank": rank, **line})
                dist.barrier()
    finally:
        if client is not None:
            client.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
