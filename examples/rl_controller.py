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
from concurrent.futures import ThreadPoolExecutor

import httpx

from ckpt_core import CkptError, split_checkpoint_files


class StepFailed(Exception):
    """A service refused or failed one call of a step: the engine keeps its previous weights."""


class WorldBroken(Exception):
    """A rank is unhealthy or unreachable: the PS world must be restarted."""


class Services:
    """One httpx client per PS rank (Unix socket, or TCP with a bearer token); calls on all ranks at once."""

    def __init__(self, args: argparse.Namespace):
        self.size = args.world_size
        headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
        if args.ps_uds:
            self.clients = [httpx.Client(transport=httpx.HTTPTransport(uds=args.ps_uds.format(rank=r)),
                                         base_url="http://ps", timeout=args.timeout + 30) for r in range(self.size)]
        else:
            self.clients = [httpx.Client(base_url=args.ps_url.format(rank=r), headers=headers,
                                         timeout=args.timeout + 30) for r in range(self.size)]
        self.pool = ThreadPoolExecutor(self.size)

    def all(self, method: str, path: str, bodies: list[dict] | None = None) -> list[dict]:
        """The call on every rank at once (collectives need all ranks); each rank's ``result``.
        Raises StepFailed with every rank's error when any rank answered one."""
        def one(r):
            kw = {"json": bodies[r]} if bodies is not None else {}
            try:
                return self.clients[r].request(method, path, **kw)
            except httpx.TransportError as exc:
                raise WorldBroken(f"rank {r} unreachable on {method} {path}: {exc}") from exc
        answers = list(self.pool.map(one, range(self.size)))
        errors = [f"rank {r}: {a.status_code} {_error(a)}" for r, a in enumerate(answers) if a.status_code != 200]
        if errors:
            raise StepFailed(f"{method} {path}: " + "; ".join(errors))
        return [a.json().get("result") for a in answers]

    def check_healthy(self) -> None:
        for r, c in enumerate(self.clients):
            try:
                code = c.get("/v1/healthz").status_code
            except httpx.TransportError as exc:
                raise WorldBroken(f"rank {r} unreachable: {exc}") from exc
            if code != 200:
                raise WorldBroken(f"rank {r} is not healthy ({code}): restart the PS world")

    def registered(self) -> set[str]:
        """The checkpoints any rank holds now."""
        return {n for c in self.clients for n in c.get("/v1/status").json()["checkpoints"]}

    def close(self) -> None:
        self.pool.shutdown()
        for c in self.clients:
            c.close()


def _error(answer: httpx.Response) -> str:
    try:
        err = answer.json()["error"]
        return f"{err['type']}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        return answer.text[:500]


def run_step(svc: Services, name: str, directory: str, args: argparse.Namespace) -> dict:
    """Register, gather and update one checkpoint on every rank; the update's figures (rank 0)."""
    try:
        shares = [split_checkpoint_files(directory, r, svc.size) for r in range(svc.size)]
    except CkptError as exc:   # a missing or empty directory, a bad index: nothing was sent yet
        raise StepFailed(f"{type(exc).__name__}: {exc}") from exc
    svc.all("POST", f"/v1/checkpoints/{name}/files", [{"files": s} for s in shares])
    svc.all("POST", f"/v1/checkpoints/{name}/gather-metas")
    bodies = [{"timeout": args.timeout, "engine": args.engine} for _ in range(svc.size)]
    bodies[0]["update_url"] = args.update_url   # one rank per engine posts every rank's handles
    if args.engine == "sglang":
        bodies[0]["weight_version"] = name
    return svc.all("POST", f"/v1/checkpoints/{name}/update", bodies)[0]


def unregister(svc: Services, name: str) -> None:
    """Drop a checkpoint on every rank that holds it (a failed step may have registered it on some)."""
    for r, c in enumerate(svc.clients):
        a = c.delete(f"/v1/checkpoints/{name}", params={"force": "true"})
        if a.status_code not in (200, 404):   # 404: this rank never registered it
            print(f"rank {r}: could not unregister {name}: {a.status_code} {_error(a)}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", help="checkpoint directories, one per step, in order")
    ap.add_argument("--world-size", type=int, required=True, help="number of PS ranks")
    ap.add_argument("--ps-uds", help="each rank's Unix socket, {rank} filled in (serve's default kind)")
    ap.add_argument("--ps-url", help="each rank's TCP URL, {rank} filled in (with --token)")
    ap.add_argument("--token", help="bearer token of the TCP services")
    ap.add_argument("--update-url", required=True, help="vLLM's /collective_rpc URL, or the SGLang server's URL")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for each update")
    ap.add_argument("--keep-going", action="store_true", help="after a failed step, go on with the next one")
    args = ap.parse_args(argv)
    if bool(args.ps_uds) == bool(args.ps_url):
        ap.error("give exactly one of --ps-uds and --ps-url")
    svc, failed = Services(args), 0
    try:
        svc.check_healthy()
        previous = svc.registered()   # left by an earlier run: dropped after this run's first success
        for step, directory in enumerate(args.checkpoints, 1):
            name, t0 = os.path.basename(os.path.normpath(directory)), time.monotonic()
            if name in previous:   # the same directory again: register it afresh
                unregister(svc, name)
                previous.discard(name)
            try:
                result = run_step(svc, name, directory, args)
            except StepFailed as exc:
                failed += 1
                print(json.dumps({"step": step, "checkpoint": directory, "ok": False, "error": str(exc)}), flush=True)
                unregister(svc, name)
                svc.check_healthy()   # a broken world is not worth another step
                if not args.keep_going:
                    return 1
                continue
            for old in previous:
                unregister(svc, old)
            previous = {name}
            print(json.dumps({"step": step, "checkpoint": directory, "ok": True, "bytes": result["bytes"],
                              "update_s": round(result["seconds"]["total"], 4),
                              "step_s": round(time.monotonic() - t0, 3)}), flush=True)
    except WorldBroken as exc:
        print(f"stopping: {exc}", file=sys.stderr)
        return 2
    finally:
        svc.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
