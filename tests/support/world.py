"""Parameter-server worlds: W PS rank processes that run a script of steps (``run_ps_world``) or
commands one at a time (``PsWorld``), so a test can act between steps (kill a process, restart a
worker, check digests) and time every error; ``FreshCheckpoints`` registers checkpoints of one
layout with fresh data in a ``PsWorld``. The engines they update are ``support.engine``'s.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from support.data import FAULT_DTYPES, fresh_tensors, want_digests
from support.engine import EngineFront, group_req_func, make_req_func
from support.ports import on_a_free_port, store_lost_port
from support.procs import CTX, StorePortLost, release, rss_bytes, run_world


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
                    results.append(("ok", None))
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
                elif step == "mem":   # device and host footprint of this PS rank, now
                    free = torch.cuda.mem_get_info(ps.device_index)[0] if kind == "cuda" else 0
                    alloc = torch.cuda.memory_allocated(ps.device_index) if kind == "cuda" else 0
                    results.append(("ok", {"device_free": free, "allocated": alloc, "rss": rss_bytes()}))
            except Exception as exc:
                results.append(("error", type(exc).__name__, str(exc)))
        ps.close()
    except Exception:
        results.append(("fatal", traceback.format_exc()))
    out.put((rank, results))


def run_ps_world(kind: str, world: int, script: list, *, timeout: float = 120) -> dict[int, list]:
    """Start ``world`` PS processes running ``script``; return each rank's step results."""
    def ranks(port: int):
        q = CTX.Queue()
        return [CTX.Process(target=ps_main, args=(r, world, port, kind, script, q), daemon=True)
                for r in range(world)], q

    return run_world(ranks, "PS world", timeout)


# ---------------------------------------------------------------- PS side, driven step by step
@dataclass
class Outcome:
    """What one PS rank answered to one command."""
    ok: bool
    value: object = None
    error: str | None = None      # exception class name
    message: str = ""
    seconds: float = 0.0          # how long the call ran inside the PS process

    def __repr__(self) -> str:
        what = repr(self.value)[:200] if self.ok else f"{self.error}: {self.message[:2000]}"
        return f"Outcome({'ok' if self.ok else 'error'}, {what}, {self.seconds:.2f}s)"


def _ps_command(ps, rank: int, cmd: str, arg):
    """One command of the interactive PS; returns a picklable value or raises."""
    if cmd == "register":
        name, kwargs = arg
        return ps.register_checkpoint(name, **kwargs)
    if cmd == "gather":
        return ps.gather_metas(arg)
    if cmd == "update":
        name, address, timeout, behaviors = arg
        req = make_req_func(address, behaviors) if rank == 0 and address is not None else (lambda h: None)
        return ps.update(name, req, timeout=timeout)
    if cmd == "update_gc_probe":  # an update whose req_func notes whether the PS paused the GC meanwhile
        import gc
        name, address, timeout = arg
        seen = []
        inner = make_req_func(address) if rank == 0 else (lambda h: None)
        ps.update(name, lambda h: (seen.append(gc.isenabled()), inner(h)), timeout=timeout)
        return {"gc_during_update": seen, "gc_after": gc.isenabled()}
    if cmd == "update_group":     # several engines: the first rank of each group posts its group's handles
        name, address, ips, timeout = arg
        return ps.update(name, group_req_func(rank, ips, address), timeout=timeout)
    if cmd == "updates":          # many back-to-back updates, one command (the soak test)
        names, address, timeout, *rest = arg
        faults = rest[0] if rest else {}          # update number -> per-worker fault injections
        out = []
        for k, n in enumerate(names):
            req = make_req_func(address, faults.get(k)) if rank == 0 else (lambda h: None)
            try:
                out.append(("ok", ps.update(n, req, timeout=timeout)["seconds"]["total"]))
            except Exception as exc:
                out.append((type(exc).__name__, str(exc)[:200]))
        return out
    if cmd == "act_during_update":
        return _act_during_update(ps, rank, *arg)
    if cmd == "two_updates_at_once":
        name, address, timeout, behaviors = arg
        return _two_updates_at_once(ps, rank, name, address, timeout, behaviors)
    if cmd == "unregister":
        name, kwargs = arg
        return ps.unregister_checkpoint(name, **kwargs)
    if cmd == "checkpoints":
        return ps.checkpoints()
    if cmd == "pool_bytes":       # bytes the shared memory pool holds (None: no pool memory)
        return None if ps._pool is None or not ps._pool.regions else ps._pool.nbytes
    if cmd == "get_metas":
        return ps.get_metas()
    if cmd == "load_metas":
        return ps.load_metas(arg)
    if cmd == "close":
        return ps.close()
    if cmd == "ipc_prefix":       # /dev/shm name prefix of this world's IPC buffers (cpu kind)
        return f"ckpt-{ps._ctx.run_id}-"
    if cmd == "ipc_buffer":       # the IPC buffer this rank holds between updates (None: released)
        return None if ps._ctx.ipc is None else dict(ps._ctx.ipc.descriptor)
    if cmd == "call":             # run fn(ps, rank, *args) from a test helper module (module, fn, args)
        import importlib
        module, fn, args = arg
        return getattr(importlib.import_module(module), fn)(ps, rank, *args)
    raise ValueError(f"unknown PsWorld command {cmd!r}")


def _two_updates_at_once(ps, rank, name, address, timeout, behaviors=None):
    """Start an update in a thread, call update again while it runs; report both outcomes."""
    first: dict = {}

    def one():
        try:
            req = make_req_func(address, behaviors) if rank == 0 else (lambda h: None)
            first["ok"] = ps.update(name, req, timeout=timeout)
        except Exception as exc:
            first["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=one)
    t.start()
    deadline = time.monotonic() + timeout
    while not ps._update_lock.locked() and t.is_alive():   # the first update is under way
        if time.monotonic() > deadline:
            raise TimeoutError("the first update never started")
        time.sleep(0.001)
    try:
        ps.update(name, lambda h: None, timeout=timeout)
        second = "no error"
    except Exception as exc:
        second = type(exc).__name__ + ": " + str(exc)
    t.join(timeout + 5)
    return {"second": second, "first": "ok" if "ok" in first else first.get("error", "still running")}


def _act_during_update(ps, rank, name, address, timeout, behaviors, mark, action, ranks=None):
    """Run an update in a thread; once file ``mark`` exists (a worker is inside a bucket), call
    ``action`` ("close", "unregister" or None) from this thread. Reports both outcomes and the
    order in which they ended. ``ranks``: a P2P update into those ranks (the first posts)."""
    order: list[str] = []
    result: dict = {}

    def one():
        req = make_req_func(address, behaviors) if rank == min(ranks or [0]) else (lambda h: None)
        try:
            ps.update(name, req, ranks=ranks, timeout=timeout)
            result["update"] = "ok"
        except Exception as exc:
            result["update"] = f"{type(exc).__name__}: {exc}"
        order.append("update ended")

    t = threading.Thread(target=one)
    t.start()
    if action is not None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(mark):
            if time.monotonic() > deadline or not t.is_alive():
                raise TimeoutError(f"the update never reached {mark}")
            time.sleep(0.005)
        try:
            ps.close() if action == "close" else ps.unregister_checkpoint(name)
            result["action"] = "ok"
        except Exception as exc:
            result["action"] = f"{type(exc).__name__}: {exc}"
        order.append(f"{action} returned")
    t.join(timeout + 30)
    result["order"] = order
    return result


def ps_server_main(rank: int, world: int, port: int, kind: str, init: dict, env: dict, conn) -> None:
    """A PS rank that executes commands from the test process, answering each with an Outcome."""
    os.environ.update(env)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # PsWorld asks for stacks when a rank hangs
    from ckpt_core import ParameterServer
    try:
        ps = ParameterServer(rank, world, device=kind, master_addr="127.0.0.1", master_port=port, **init)
    except Exception as exc:
        conn.send(Outcome(False, None, type(exc).__name__, traceback.format_exc()))
        return
    conn.send(Outcome(True, {"pid": os.getpid(), "device_uuid": ps.device_uuid}))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            ps.close()
            conn.send(Outcome(True))
            return
        t0 = time.monotonic()
        try:
            value = _ps_command(ps, rank, cmd, arg)
            conn.send(Outcome(True, value, seconds=time.monotonic() - t0))
        except Exception as exc:
            conn.send(Outcome(False, None, type(exc).__name__, str(exc), time.monotonic() - t0))


class PsWorld:
    """W parameter-server processes that run commands on demand, so a test can act between steps
    (kill a process, restart a worker, check digests) and time every error.

    ``env`` is set in the PS processes before the ParameterServer is built (e.g. a small
    PS_COLLECTIVE_TIMEOUT_S); ``init`` goes to its constructor.
    """

    def __init__(self, kind: str, size: int, *, init: dict | None = None, env: dict | None = None,
                 start_timeout: float = 120):
        self.kind, self.size = kind, size
        hello = on_a_free_port(lambda port: self._start(port, dict(init or {}), dict(env or {}), start_timeout),
                               lambda outcome, port: isinstance(outcome, StorePortLost), "a PS world's store")
        bad = {r: o for r, o in hello.items() if not o.ok}
        if bad:
            self.kill_all()
            raise RuntimeError(f"PS ranks failed to start: {bad}")
        self.pids = [hello[r].value["pid"] for r in range(size)]
        self.device_uuids = [hello[r].value["device_uuid"] for r in range(size)]

    def _start(self, port: int, init: dict, env: dict, timeout: float) -> dict[int, Outcome]:
        """The ranks started on ``port`` and their first answers; :class:`StorePortLost` (the ranks
        killed) when rank 0 could not serve the store there, another process holding it."""
        self.conns, self.procs = [], []
        for r in range(self.size):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=ps_server_main, args=(r, self.size, port, self.kind, init, env, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        deadline = time.monotonic() + timeout
        hello = self._collect([0], timeout)   # rank 0 serves the store: the others wait on it until their timeout
        if not hello[0].ok and store_lost_port(hello[0].message, port):
            self.kill_all()
            raise StorePortLost(f"PS world: rank 0 could not serve the rendezvous store on port {port}, "
                                "another process holding it")
        hello.update(self._collect(range(1, self.size), max(0.0, deadline - time.monotonic())))
        return hello

    def send(self, cmd: str, arg=None, *, ranks=None, per_rank: dict | None = None) -> list[int]:
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        for r in ranks:
            self.conns[r].send((cmd, per_rank[r] if per_rank is not None else arg))
        return ranks

    def _collect(self, ranks, timeout: float) -> dict[int, Outcome]:
        out, deadline = {}, time.monotonic() + timeout
        for r in ranks:
            left = deadline - time.monotonic()
            try:
                if not self.conns[r].poll(max(0.0, left)):
                    out[r] = Outcome(False, None, "HarnessTimeout", f"PS rank {r} did not answer within {timeout} s "
                                     "(its threads' stacks are in the captured stderr)")
                    self._dump_stacks(r)
                    continue
                out[r] = self.conns[r].recv()
            except (EOFError, OSError):
                out[r] = Outcome(False, None, "ProcessDied", f"PS rank {r} (pid {self.procs[r].pid}) died")
        return out

    def _dump_stacks(self, r: int) -> None:
        """A rank that hangs prints every thread's stack to stderr (faulthandler), for the log."""
        try:
            os.kill(self.procs[r].pid, signal.SIGUSR1)
            time.sleep(0.5)
        except OSError:
            pass

    def collect(self, ranks=None, timeout: float = 60) -> dict[int, Outcome]:
        return self._collect(range(self.size) if ranks is None else ranks, timeout)

    def all(self, cmd: str, arg=None, *, ranks=None, per_rank: dict | None = None,
            timeout: float = 60) -> dict[int, Outcome]:
        """Run one command on the given ranks (all by default) and wait for their answers."""
        return self.collect(self.send(cmd, arg, ranks=ranks, per_rank=per_rank), timeout)

    def update(self, name: str, front: EngineFront | None, timeout: float = 30, behaviors: dict | None = None,
               *, wait: float | None = None) -> dict[int, Outcome]:
        arg = (name, front.address if front is not None else None, timeout, behaviors)
        return self.all("update", arg, timeout=wait if wait is not None else timeout + 60)

    def kill(self, rank: int) -> None:
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.procs[rank].join(10)

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)

    def close(self) -> None:
        alive = [r for r, p in enumerate(self.procs) if p.is_alive()]
        try:
            self.collect(self.send("exit", ranks=alive), timeout=15)
        except (OSError, EOFError):
            pass
        self.kill_all()
        release(self.conns, self.procs)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FreshCheckpoints:
    """Registers checkpoints of one fixed layout (like a model's, same names every time)
    with fresh random data in a :class:`PsWorld`, and knows the digests each must leave."""

    def __init__(self, world: "PsWorld", *, seed: int, per_rank: int = 6, numel: int = 4096):
        self.world, self.gen, self.count = world, torch.Generator().manual_seed(seed), 0
        self.layout = {r: {f"layer{r}.{i}.w": ((numel,) if i % 3 else (numel // 64, 64), FAULT_DTYPES[i % 4])
                           for i in range(per_rank)} for r in range(world.size)}

    def new(self, prefix: str = "ckpt", **register_kwargs) -> tuple[str, dict[str, str]]:
        """Register, gather; return (checkpoint name, {tensor: digest})."""
        self.count += 1
        name = f"{prefix}-{self.count}"
        data = {r: fresh_tensors(self.layout[r], self.gen) for r in range(self.world.size)}
        got = self.world.all("register", per_rank={r: (name, {"named_tensors": data[r], **register_kwargs})
                                                   for r in range(self.world.size)})
        assert all(o.ok for o in got.values()), got
        got = self.world.all("gather", name)
        assert all(o.ok for o in got.values()), got
        return name, want_digests(*data.values())

    def drop(self, name: str) -> None:
        got = self.world.all("unregister", (name, {}))
        assert all(o.ok for o in got.values()), got
