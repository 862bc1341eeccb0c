"""An RL controller that drives `ckpt-engine serve`: register -> gather -> update, once per step.

Each PS rank runs ``ckpt-engine serve`` beside its engine worker (one per device, under torchrun,
or started by the engine in managed mode: docs/operations.md). For every checkpoint directory
given, in order (one per training step), the controller

1. registers each rank's share of the directory's safetensors files (``POST .../files``),
2. gathers the metas on every rank at once (``.../gather-metas``, a collective),
3. updates every rank at once (``.../update``); the first rank posts the handles to the engine
   (``--update-url``: vLLM's ``/collective_rpc``, or the SGLang server with ``--engine sglang``),
4. unregisters the previous step, so host memory holds one checkpoint (two during an update).

A checkpoint is registered under its directory's name (``/ckpt/step-7`` -> ``step-7``); what an
earlier run left registered is unregistered once the first step of this run succeeded.

    python examples/rl_controller.py --ps-uds '/run/ckpt/ps-{rank}.sock' --world-size 2 \\
        --update-url http://127.0.0.1:8000/collective_rpc /ckpt/step-1 /ckpt/step-2

The fan-out to every rank is ``ckpt_core.client.ServiceWorld``; it raises ckpt_core's error types.

Errors: every service answers ``{"error": {"type", "message", ...}}``. A step whose checkpoint is
refused (4xx: a corrupt or missing file, a file outside the service's ``--allow-dir``) or whose
engine update failed (502, 504) leaves the engine on the previous step's weights; the controller
unregisters what it registered for that step and stops with exit code 1, or with
``--keep-going`` carries on with the next step (exit code 1 at the end). A rank that is no longer
healthy (its process groups broke: a peer died) stops the run with exit code 2: restart the
world. Each step prints one JSON line: the step, its outcome, and the update's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ckpt_core import CkptError, TransportError
from ckpt_core.client import ServiceWorld
from ckpt_core.engines import MAX_RANKS, TIMEOUT, count


def connect(args: argparse.Namespace) -> ServiceWorld:
    """The PS world's services: Unix sockets, or TCP URLs with a bearer token."""
    return ServiceWorld.from_template(args.ps_uds or args.ps_url, args.world_size, token=args.token,
                                      timeout=args.timeout)


def run_step(world: ServiceWorld, name: str, directory: str, args: argparse.Namespace) -> dict:
    """Register, gather and update one checkpoint on every rank; the update's figures (rank 0)."""
    world.register(name, directory)
    world.gather_metas(name)
    extra = {"weight_version": name} if args.engine == "sglang" else {}
    return world.update(name, update_url=args.update_url, engine=args.engine, timeout=args.timeout, **extra)


def unregister(world: ServiceWorld, name: str) -> None:
    """Drop a checkpoint on every rank that holds it (a failed step may have registered it on some)."""
    try:
        world.unregister(name, force=True, missing_ok=True)
    except CkptError as exc:
        print(f"could not unregister {name}: {exc}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", help="checkpoint directories, one per step, in order")
    ap.add_argument("--world-size", type=count(MAX_RANKS), required=True, help="number of PS ranks")
    ap.add_argument("--ps-uds", help="each rank's Unix socket, {rank} filled in (serve's default kind)")
    ap.add_argument("--ps-url", help="each rank's TCP URL, {rank} filled in (with --token)")
    ap.add_argument("--token", help="bearer token of the TCP services")
    ap.add_argument("--update-url", required=True, help="vLLM's /collective_rpc URL, or the SGLang server's URL")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--timeout", type=TIMEOUT, default=300.0, help="seconds for each update")
    ap.add_argument("--keep-going", action="store_true", help="after a failed step, go on with the next one")
    args = ap.parse_args(argv)
    if bool(args.ps_uds) == bool(args.ps_url):
        ap.error("give exactly one of --ps-uds and --ps-url")
    world, failed = connect(args), 0
    try:
        world.check_healthy()
        previous = world.checkpoints()   # left by an earlier run: dropped after this run's first success
        for step, directory in enumerate(args.checkpoints, 1):
            name, t0 = os.path.basename(os.path.normpath(directory)), time.monotonic()
            if name in previous:   # the same directory again: register it afresh
                unregister(world, name)
                previous.discard(name)
            try:
                result = run_step(world, name, directory, args)
            except CkptError as exc:   # refused or failed: the engine keeps the previous step's weights
                failed += 1
                print(json.dumps({"step": step, "checkpoint": directory, "ok": False,
                                  "error": f"{type(exc).__name__}: {exc}"}), flush=True)
                unregister(world, name)
                world.check_healthy()   # a broken world is not worth another step
                if not args.keep_going:
                    return 1
                continue
            for old in previous:
                unregister(world, old)
            previous = {name}
            print(json.dumps({"step": step, "checkpoint": directory, "ok": True, "bytes": result["bytes"],
                              "update_s": round(result["seconds"]["total"], 4),
                              "step_s": round(time.monotonic() - t0, 3)}), flush=True)
    except TransportError as exc:   # a rank unreachable or unhealthy: its process groups are gone
        print(f"stopping: {exc}", file=sys.stderr)
        return 2
    finally:
        world.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
