"""Real multi-process worlds for end-to-end tests: PS rank processes + engine worker processes.

Shape (mirrors a real deployment): W parameter-server processes (gloo/NCCL
world), W engine-worker processes (one per device), and an "engine front"
thread in the test process that plays vLLM's /collective_rpc: rank 0's
req_func connects to it, it fans the handles out to every worker and answers
when all are done. Workers keep what they received and report SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Listener

import torch

AUTH = b"ckpt-tests"
CTX = mp.get_context("spawn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() + f"|{t.dtype}|{tuple(t.shape)}"


# ---------------------------------------------------------------- engine worker side
def worker_main(kind: str, index: int, conn, behavior: dict) -> None:
    """One engine worker: waits for handles, receives updates, keeps digests of what it loaded."""
    import zmq
    from ckpt_core import local_device_key, update_weights_from_ipc

    ctx = zmq.Context()
    key = local_device_key(kind, index)
    loaded: dict[str, str] = {}
    updates = 0
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            conn.send(("ok", None))
            return
        if cmd[0] == "digests":
            conn.send(("ok", dict(loaded)))
            continue
        if cmd[0] == "behavior":
            behavior = cmd[1]
            conn.send(("ok", None))
            continue
        handles = cmd[1]
        behavior = dict(behavior, **(cmd[2] if len(cmd) > 2 and cmd[2] else {}))
        buckets = [0]
        staged: dict[str, str] = {}

        def run(weights):
            b = buckets[0]
            buckets[0] += 1
            fail = behavior.get("fail_bucket")
            if fail is not None and (fail == b or (fail == -1 and b == behavior.get("n_buckets", -2) - 1)):
                raise RuntimeError(f"injected engine failure at bucket {b}")
            if behavior.get("sleep_s"):
                time.sleep(behavior["sleep_s"])
            for name, t in weights:
                staged[name] = digest(t)

        try:
            if behavior.get("never_connect"):
                time.sleep(behavior.get("never_connect"))
                conn.send(("error", "worker did not connect (injected)"))
                continue
            update_weights_from_ipc(ctx, handles[key], index, run=run,
                                    post_hook=lambda: loaded.update(staged), timeout=behavior.get("timeout", 60))
            updates += 1
            conn.send(("ok", {"buckets": buckets[0]}))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------- engine front (the "server")
class EngineFront:
    """Listens like an engine's HTTP API; fans an update request out to every worker."""

    def __init__(self, kind: str, world: int, behavior: dict | None = None, devices: list[int] | None = None):
        self.listener = Listener(("127.0.0.1", 0), authkey=AUTH)
        self.address = self.listener.address
        self.conns, self.procs = [], []
        for r in range(world):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=worker_main, args=(kind, (devices or list(range(world)))[r], child,
                                                     dict(behavior or {})), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c = self.listener.accept()
            except OSError:
                return
            with c:
                handles, behaviors = c.recv()
                with self._lock:
                    for i, wc in enumerate(self.conns):
                        wc.send(("update", handles, (behaviors or {}).get(i)))
                    results = [wc.recv() for wc in self.conns]
                c.send(results)

    def call(self, i: int, *cmd, timeout: float = 60):
        with self._lock:
            self.conns[i].send(cmd)
            if not self.conns[i].poll(timeout):
                raise TimeoutError(f"engine worker {i} did not answer {cmd[0]}")
            return self.conns[i].recv()

    def digests(self, i: int) -> dict[str, str]:
        return self.call(i, "digests")[1]

    def set_behavior(self, i: int, behavior: dict) -> None:
        self.call(i, "behavior", behavior)

    def close(self) -> None:
        for i, p in enumerate(self.procs):
            try:
                if p.is_alive():
                    self.call(i, "stop", timeout=5)
            except Exception:
                pass
            p.join(5)
            if p.is_alive():
                p.kill()
        self.listener.close()


def make_req_func(address, behaviors: dict | None = None):
    """The req_func rank 0 passes to update(): like an HTTP call to /collective_rpc.

    ``behaviors`` maps a worker index to fault injections for this update only.
    """
    def req_func(handles):
        with Client(address, authkey=AUTH) as c:
            c.send((dict(handles), behaviors))
            results = c.recv()
        errors = [r[1] for r in results if r[0] != "ok"]
        if errors:
            raise RuntimeError("engine reported: " + errors[0])
    return req_func


# ---------------------------------------------------------------- PS side
def ps_main(rank: int, world: int, port: int, kind: str, script: list, out) -> None:
    """Runs a list of steps in one PS rank and reports each step's outcome."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from ckpt_core import ParameterServer
    results = []
    try:
        ps = ParameterServer(rank, world, device=kind, master_addr="127.0.0.1", master_port=port,
                             **script[0][1] if script and script[0][0] == "init" else {})
        for step, arg in script:
            try:
                if step == "init":
                    continue
                if step == "register":
                    name, kwargs = arg
                    ps.register_checkpoint(name, **kwargs.get(rank, {}))
                    results.append(("ok", None))
                elif step == "gather":
                    ps.gather_metas(arg)
                    results.append(("ok", None))
                elif step == "update":
                    name, address, timeout, *rest = arg
                    req = make_req_func(address, rest[0] if rest else None) if rank == 0 else (lambda h: None)
                    results.append(("ok", ps.update(name, req, timeout=timeout)))
                elif step == "unregister":
                    ps.unregister_checkpoint(arg)
                    results.append(("ok", None))
                elif step == "sleep":
                    time.sleep(arg)
                    results.append(("ok", None))
            except Exception as exc:
                results.append(("error", type(exc).__name__, str(exc)))
        ps.close()
    except Exception:
        results.append(("fatal", traceback.format_exc()))
    out.put((rank, results))


@dataclass
class World:
    kind: str
    size: int
    results: dict = field(default_factory=dict)


def run_ps_world(kind: str, world: int, script: list, *, timeout: float = 120) -> dict[int, list]:
    """Start ``world`` PS processes running ``script``; return each rank's step results."""
    port = free_port()
    q = CTX.Queue()
    procs = [CTX.Process(target=ps_main, args=(r, world, port, kind, script, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"PS world did not finish within {timeout} s; finished ranks {sorted(out)}")
            try:
                rank, res = q.get(timeout=min(left, 1.0))
                out[rank] = res
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead and time.monotonic() > deadline - timeout + 5 and all(not p.is_alive() for p in procs):
                    raise RuntimeError(f"PS ranks {dead} died without reporting")
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out
