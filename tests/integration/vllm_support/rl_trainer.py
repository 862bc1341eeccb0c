"""A trainer that syncs its weights into a vLLM server through vLLM's own trainer API (backend ``ckpt``).

Runs under the vLLM venv's python (one process, or every rank under torchrun with a gloo group
the trainer made itself, as an FSDP/DDP trainer does), with this repo first on PYTHONPATH:

    python rl_trainer.py --model DIR --weights FILE --url URL --out DIR --prompts JSON
                         --phases send,silent,dead,send,stage,stage [--timeout 20] [--seed N] [--slices] [--on-device]
    python -m torch.distributed.run --nproc-per-node 2 rl_trainer.py ...      (two trainer ranks)

Each ``send`` phase trains one step (AdamW on random tokens, the same on every rank), saves the
trainer's weights to ``OUT/step-<k>.safetensors`` (rank 0) and calls ``engine.send_weights()``;
then rank 0 reads every worker's digests (``ckpt_state_digests``, our worker extension) and the
server's greedy completions of the prompts. ``stage``: the same through a second trainer engine,
``CkptTrainerInitInfo(stage=True, version_prefix="staged")`` (made at the first ``stage``, the first
shut down; one trainer process serves both modes). ``silent``: a send with a client whose server
accepts connections and never answers; ``dead``: one whose server is gone (nothing listens). Rank
0 prints one JSON line per phase: ``{"phase", "file", "digests", "tokens", "seconds", "result"}`` or
``{"phase", "error", "message", "seconds"}``; every rank prints the error type it saw.

``--p2p-services JSON`` (a list of the engine's managed PS services): the trainer ranks are P2P
owners and the engine's PS world pulls (``CkptTrainerInitInfo(p2p_services=...)``; the bearer token
from ``CKPT_SERVICE_TOKEN``). Its fault phase ``kill-owner`` trains a step and sends it while rank
1 SIGKILLs itself once it has published its metas (the sender waits ``--kill-wait`` seconds before
the pull, so that the engine's PS world reads from an owner that is gone); rank 0 then reports its
error and the engine's digests, and the trainer stops (its world has lost a rank).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

MAX_TOKENS = 12


def build_model(model_dir: Path, weights: Path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model


def train_step(model, optimizer, step: int, seed: int, vocab: int) -> float:
    import torch

    gen = torch.Generator().manual_seed(seed * 1000 + step)   # the same batch on every rank: replicas stay equal
    tokens = torch.randint(2, vocab, (4, 24), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    import httpx

    resp = httpx.post(f"{url}/v1/completions", timeout=120.0, json={
        "model": "tiny", "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "seed": 0})
    resp.raise_for_status()
    return [c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]


def silent_server() -> tuple[socket.socket, str]:
    """A TCP server that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dead_url() -> str:
    with socket.socket() as sock:   # bound, then closed: nothing listens there any more
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def failing_round(engine, client, rank: int) -> dict:
    """send_weights through ``client``; the outcome (it must fail), then the real client back."""
    real, engine.client = engine.client, client
    t0 = time.monotonic()
    try:
        engine.send_weights()
        return {"error": None, "seconds": time.monotonic() - t0}
    except Exception as exc:   # noqa: BLE001 - reported to the test, which checks the type
        return {"error": type(exc).__name__, "message": str(exc)[-3000:], "seconds": time.monotonic() - t0,
                "typed": exc.__class__.__module__.startswith("ckpt_core")}
    finally:
        engine.client = real


def kill_owner(engine, rank: int, wait_s: float) -> None:
    """The next round's rank 1 dies by SIGKILL right after it published its metas (at the round's outcome
    exchange); the sender waits ``wait_s`` before the engine's PS world pulls, so it reads from a dead owner."""
    import signal

    if rank == 1:
        engine.ps.all_gather_json = lambda obj: os.kill(os.getpid(), signal.SIGKILL)
    elif rank == 0:
        pull = engine._pull.pull

        def late_pull(doc, name):
            time.sleep(wait_s)
            return pull(doc, name)
        engine._pull.pull = late_pull


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--weights", type=Path, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=json.loads, required=True)
    ap.add_argument("--phases", default="send,send,send")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slices", action="store_true", help="CkptTrainerInitInfo(slices=True): each worker its slices")
    ap.add_argument("--on-device", action="store_true",
                    help="CkptTrainerInitInfo(on_device=True): the parameters registered in place (the cpu device)")
    ap.add_argument("--p2p-services", type=json.loads, default=None,
                    help="JSON list: the engine's managed PS services; the trainer ranks are P2P owners")
    ap.add_argument("--kill-wait", type=float, default=2.0, help="kill-owner: the sender waits this long first")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)

    from ckpt_vllm import VllmClient
    from ckpt_vllm.trainer import CkptTrainerInitInfo

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")   # the trainer's own group: the parameter server joins it
    model = build_model(args.model, args.weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    def trainer_engine(stage: bool, port: int | None = None):
        return WeightTransferTrainerFactory.trainer_init(
            CkptTrainerInitInfo(rank=rank, world_size=world, timeout_s=args.timeout, stage=stage, slices=args.slices,
                                version_prefix="staged" if stage else "step", master_port=port,
                                p2p_services=args.p2p_services, on_device=True if args.on_device else None),
            client=HTTPVLLMWeightSyncClient(args.url), source=ModuleSource(model))

    engine, staged = trainer_engine(False), False
    print(f"rank {rank}: trainer engine {type(engine).__name__}", file=sys.stderr, flush=True)
    inspect = VllmClient(args.url, timeout=120.0) if rank == 0 else None
    steps = 0
    for phase in args.phases.split(","):
        if phase == "stage" and not staged:   # the stage=True engine replaces the plain one
            engine.shutdown()
            engine, staged = trainer_engine(True, free_port() if world == 1 else None), True
        if phase in ("send", "stage"):
            steps += 1
            loss = train_step(model, optimizer, steps, args.seed, model.config.vocab_size)
            file = args.out / f"step-{steps}.safetensors"
            if rank == 0:
                save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()}, str(file))
            t0 = time.monotonic()
            result = engine.send_weights()
            line = {"phase": phase, "step": steps, "loss": loss, "seconds": time.monotonic() - t0,
                    "result": {"bytes": result["bytes"], "name": result["name"],
                               "received_bytes": result.get("slices", {}).get("received_bytes")},
                    "on_device": engine.ps.last_register["on_device"]}
            if rank == 0:
                line.update(file=str(file), digests=inspect.collective_rpc("ckpt_state_digests"),
                            tokens=greedy(args.url, args.prompts), versions=inspect.weight_versions())
        elif phase == "silent":
            sock, url = silent_server()
            line = {"phase": phase, **failing_round(engine, HTTPVLLMWeightSyncClient(url, timeout=120), rank)}
            sock.close()   # the request still waiting in the sender's thread ends now
        elif phase == "dead":
            line = {"phase": phase, **failing_round(engine, HTTPVLLMWeightSyncClient(dead_url()), rank)}
        elif phase == "kill-owner":
            steps += 1
            train_step(model, optimizer, steps, args.seed, model.config.vocab_size)
            file = args.out / f"step-{steps}.safetensors"
            if rank == 0:
                save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()}, str(file))
            kill_owner(engine, rank, args.kill_wait)
            line = {"phase": phase, "step": steps, **failing_round(engine, engine.client, rank)}
            if rank == 0:
                line.update(file=str(file), digests=inspect.collective_rpc("ckpt_state_digests"))
                print(json.dumps(line), flush=True)
            print(f"rank {rank}: {phase}: {line.get('error')} in {line['seconds']:.2f} s", file=sys.stderr, flush=True)
            engine.shutdown()   # the world lost rank 1: no more rounds, no group teardown (it would wait for it)
            return
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        print(f"rank {rank}: {phase}: {line.get('error') or 'ok'} in {line['seconds']:.2f} s", file=sys.stderr,
              flush=True)
        if rank == 0:
            print(json.dumps(line), flush=True)
    engine.shutdown()
    engine.shutdown()   # idempotent
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
