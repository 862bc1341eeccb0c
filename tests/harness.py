"""Real multi-process worlds for end-to-end tests: PS rank processes + engine worker processes.

Shape (mirrors a real deployment): W parameter-server processes (gloo/NCCL
world), W engine-worker processes (one per device), and an "engine front"
thread in the test process that plays vLLM's /collective_rpc: rank 0's
req_func connects to it, it fans the handles out to every worker and answers
when all are done. Workers keep what they received and report SHA-256 digests.
"""

from __future__ import annotations

import faulthandler
import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

import torch

from ports import free_port  # noqa: F401  (re-exported: the tests take it from here)

AUTH = b"ckpt-tests"

# Children of the worlds start from a fork server that has imported torch once (and what every
# PS rank and engine worker imports after it): a spawned child spends ~3-5 s of a core importing
# torch again, and the suite starts hundreds of them on CI's 2 cores. Each child still runs in
# an interpreter that imported nothing of ours, with the sys.path of its parent (as with spawn)
# and the environment its parent had when it was started (``_Process``: a fork server's
# children would otherwise inherit the fork server's own). CKPT_TEST_START_METHOD=spawn
# restores plain spawned children.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "zmq", "httpx",
           "safetensors"]


class _Process(mp.context.ForkServerProcess):
    """A fork-server child that runs with its parent's ``os.environ`` as of ``start()``."""

    def start(self):
        self._parent_environ = dict(os.environ)
        super().start()

    def run(self):
        os.environ.clear()
        os.environ.update(self._parent_environ)
        super().run()


class _Context(mp.context.ForkServerContext):
    Process = _Process


def _context():
    method = os.environ.get("CKPT_TEST_START_METHOD", "forkserver")
    if method != "forkserver":
        return mp.get_context(method)
    ctx = _Context()
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


CTX = _context()


def pythonpath(*paths) -> str:
    """PYTHONPATH for a child interpreter: ``paths`` first, then the caller's own (an air-gapped
    host puts its wheels there; a child that loses them cannot import zmq or Mooncake)."""
    parts = [str(p) for p in paths] + [os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def process_gone(pid: int, timeout: float = 60) -> bool:
    """Whether ``pid`` exits (or is left a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:   # a zombie of a dead parent is reaped by init; a stopped one would still show here
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def digest(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() + f"|{t.dtype}|{tuple(t.shape)}"


# ---------------------------------------------------------------- engine worker side
def worker_main(kind: str, index: int, conn, behavior: dict, env: dict | None = None, engine_cls=None) -> None:
    """One engine worker: waits for handles, receives updates, keeps digests of what it loaded.
    ``env`` is set first (e.g. PS_CPU_VISIBLE_DEVICES for a second engine on the host);
    ``engine_cls``: another engine (a SimEngine subclass, e.g. one running the stock worker)."""
    os.environ.update(env or {})
    engine = (engine_cls or SimEngine)(kind, index, behavior)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", engine.command(cmd)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class SimEngine:
    """The engine side of the tests: records a digest per tensor it loaded; behaviours inject faults."""

    def __init__(self, kind: str, index: int, behavior: dict):
        import zmq
        from ckpt_core import local_device_key
        from ckpt_core.devices import get_backend
        get_backend(kind).set_device(index)   # like a real engine worker: on its device before anything else
        self.ctx, self.index, self.behavior = zmq.Context(), index, behavior
        self.key = local_device_key(kind, index)
        self.loaded: dict[str, str] = {}
        self.updates = 0
        self.runs = 0   # run() calls over the worker's life: a rejected frame must leave it unchanged
        self.gc_in_run: bool | None = None   # was Python's cyclic GC enabled inside the latest run()?

    def command(self, cmd):
        if cmd[0] == "stats":
            from ckpt_core.wire import worker as _worker
            return {"runs": self.runs, "updates": self.updates, "pid": os.getpid(), "mapped": sorted(_worker._mapped),
                    "gc_in_run": self.gc_in_run}
        if cmd[0] == "digests":
            return dict(self.loaded)
        if cmd[0] == "behavior":
            self.behavior = cmd[1]
            return None
        if cmd[0] == "slices":   # (plan digest, engine rank) this worker loads by from now on; None: whole tensors
            self.behavior = dict(self.behavior, slices=cmd[1])
            return None
        this = dict(self.behavior, **(cmd[2] if len(cmd) > 2 and cmd[2] else {}))  # for this update only
        return self.update(cmd[1], this)

    def update(self, handles, this: dict) -> dict:
        from ckpt_core import update_weights_from_ipc
        if this.get("never_connect"):
            time.sleep(this.get("never_connect"))
            raise RuntimeError("worker did not connect (injected)")
        run, post_hook, on_plan, buckets = self.callbacks(this)
        update_weights_from_ipc(self.ctx, handles[self.key], self.index, run=run, post_hook=post_hook,
                                timeout=this.get("timeout", 60), on_plan=on_plan, slices=this.get("slices"))
        self.updates += 1
        return {"buckets": buckets[0]}

    def callbacks(self, this: dict):
        """(run, post_hook, on_plan, bucket counter) of one update, with its fault injections."""
        buckets = [0]
        staged: dict[str, str] = {}

        def run(weights):
            import gc
            b = buckets[0]
            buckets[0] += 1
            self.runs += 1
            self.gc_in_run = gc.isenabled()
            if this.get("mark_dir"):   # lets a test act while the worker is inside bucket b
                open(os.path.join(this["mark_dir"], f"w{self.index}-b{b}"), "w").close()
            fail = this.get("fail_bucket")
            if fail == b:
                raise RuntimeError(f"injected engine failure at bucket {b}")
            if this.get("sleep_s"):
                time.sleep(this["sleep_s"])
            for name, t in weights:
                staged[name] = digest(t)

        def post_hook():
            if this.get("fail_post_hook"):
                raise RuntimeError("injected post-hook failure")
            self.loaded.update(staged)

        def on_plan(tensors):
            missing = set(this.get("require", ())) - {n for n, _, _ in tensors}
            if missing:
                raise KeyError(f"checkpoint lacks {sorted(missing)}")

        return run, post_hook, on_plan, buckets


def queue_worker_main(kind: str, index: int, inbox, outbox, env: dict | None = None) -> None:
    """An engine worker fed by its own PS rank's req_func (``req_func = inbox.put``), the
    reference's test shape. A dict in ``inbox`` sets faults for the next update only; a
    handles list runs one update, answered in ``outbox`` with ("ok", result, digests of
    exactly what it loaded) or ("error", traceback); None ends the worker. Says ("ready", pid)
    first, so that a test's short update timeouts do not count the worker's start."""
    os.environ.update(env or {})
    engine = SimEngine(kind, index, {})
    outbox.put(("ready", os.getpid()))
    this: dict = {}
    while True:
        item = inbox.get()
        if item is None:
            return
        if isinstance(item, dict):
            this = item
            continue
        engine.loaded = {}
        try:
            result = engine.update(dict(item), this)
            outbox.put(("ok", result, dict(engine.loaded)))
        except Exception:
            outbox.put(("error", traceback.format_exc()))
        this = {}


# ---------------------------------------------------------------- engine front (the "server")
class EngineFront:
    """Listens like an engine's HTTP API; fans an update request out to every worker."""

    def __init__(self, kind: str, world: int, behavior: dict | None = None, devices: list[int] | None = None,
                 *, uds: str | None = None, env: dict | None = None, engine_cls=None,
                 slices: tuple[str, list[int]] | None = None):
        # uds: listen on that Unix socket only (an engine that only its own host can reach)
        # slices: (plan digest, engine rank of each worker): worker i loads by that plan as that engine rank,
        # like a vLLM worker of that tensor-parallel rank (it refuses an update routed otherwise)
        self.slices = slices
        self.listener = Listener(uds, family="AF_UNIX", authkey=AUTH) if uds else Listener(("127.0.0.1", 0), authkey=AUTH)
        self.engine_cls = engine_cls
        self.address = self.listener.address
        self.env = dict(env or {})
        self.requests: list[list[str]] = []   # the device keys of each update request, in order
        self.kind, self.behavior = kind, dict(behavior or {})
        self.devices = devices or list(range(world))
        self.conns, self.procs = [], []
        for r in range(world):
            parent, p = self._spawn(r)
            self.conns.append(parent)
            self.procs.append(p)
        self._lock = threading.Lock()
        self.fanouts = 0                 # update requests served so far
        self.last_results: list = []     # each worker's (status, value or traceback) of the latest one
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c = self.listener.accept()
            except OSError:
                return
            try:
                with c:
                    handles, behaviors = c.recv()
                    self.requests.append(sorted(handles))
                    with self._lock:
                        results = self._fan_out(handles, behaviors or {})
                        self.last_results, self.fanouts = results, self.fanouts + 1
                    c.send(results)
            except (EOFError, OSError):
                continue   # the caller (a PS rank) went away: keep serving the next one

    def _spawn(self, i: int):
        parent, child = CTX.Pipe()
        behavior = dict(self.behavior, **({"slices": (self.slices[0], self.slices[1][i])} if self.slices else {}))
        p = CTX.Process(target=worker_main, args=(self.kind, self.devices[i], child, behavior, self.env,
                                                  self.engine_cls), daemon=True)
        p.start()
        child.close()   # so that recv() on parent sees EOF when the worker dies
        return parent, p

    def _fan_out(self, handles, behaviors: dict) -> list:
        """Send one update to every worker; a dead worker answers with an error, never a hang."""
        sent = []
        for i, wc in enumerate(self.conns):
            try:
                wc.send(("update", handles, behaviors.get(i)))
                sent.append(True)
            except (OSError, EOFError):
                sent.append(False)
        results = []
        for i, wc in enumerate(self.conns):
            try:
                if not sent[i]:
                    raise EOFError
                results.append(wc.recv())
            except (OSError, EOFError):
                results.append(("error", f"engine worker {i} (pid {self.procs[i].pid}) died"))
        return results

    def kill(self, i: int) -> None:
        """SIGKILL engine worker ``i`` (no cleanup runs in it)."""
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].join(10)

    def restart(self, i: int) -> None:
        """Replace worker ``i`` by a fresh process (after a kill); waits for any update in flight."""
        with self._lock:
            if self.procs[i].is_alive():
                self.procs[i].kill()
                self.procs[i].join(10)
            self.conns[i].close()
            self.conns[i], self.procs[i] = self._spawn(i)

    def worker_outcomes(self, since: int, timeout: float = 60) -> list:
        """Each worker's (status, value or traceback) of the first update request after ``since``
        requests, once every worker answered it (a worker may leave a failed update late)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if self.fanouts > since:
                    return list(self.last_results)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine front served no update request after #{since}")
            time.sleep(0.02)

    def stats(self, i: int) -> dict:
        return self.call(i, "stats")[1]

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

    def expect_slices(self, slices: tuple[str, list[int]] | None) -> None:
        """From now on worker i loads by plan ``slices[0]`` as engine rank ``slices[1][i]`` (None: whole tensors)."""
        self.slices = slices
        for i in range(len(self.conns)):
            self.call(i, "slices", None if slices is None else (slices[0], slices[1][i]))

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
        if (behaviors or {}).get("req_fail_after"):
            raise RuntimeError("injected: req_func failed after the engine finished")
    return req_func


def group_req_func(rank: int, ips: int, address):
    """A req_func as in the reference's examples/update.py: it runs on every rank; the first rank
    of each inference group of ``ips`` ranks posts that group's handles to its own engine at
    ``address``; the other ranks return at once."""
    inner = make_req_func(address) if rank % ips == 0 else None

    def req_func(handles):
        if inner is not None:
            inner(handles[rank: rank + ips])
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
                    results.append(("ok", {"device_free": free, "allocated": alloc, "rss": _rss_bytes()}))
            except Exception as exc:
                results.append(("error", type(exc).__name__, str(exc)))
        ps.close()
    except Exception:
        results.append(("fatal", traceback.format_exc()))
    out.put((rank, results))


def collect_world(procs: list, q, what: str, timeout: float, join_s: float = 5) -> dict[int, list]:
    """Start ``procs`` (one per rank; each puts ``(rank, result)`` on ``q``) and return every rank's
    result, failing with ``what`` named when they do not finish within ``timeout`` or all die silently."""
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    start = time.monotonic()
    deadline = start + timeout
    try:
        while len(out) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} did not finish within {timeout} s; finished ranks {sorted(out)}")
            try:
                rank, res = q.get(timeout=min(left, 1.0))
                out[rank] = res
            except Exception:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                # A rank's last put may still be in flight for a moment after it exits.
                if dead and time.monotonic() > start + 5 and all(not p.is_alive() for p in procs) and q.empty():
                    raise RuntimeError(f"PS ranks {dead} died without reporting")
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
    return out


def run_ps_world(kind: str, world: int, script: list, *, timeout: float = 120) -> dict[int, list]:
    """Start ``world`` PS processes running ``script``; return each rank's step results."""
    port = free_port()
    q = CTX.Queue()
    procs = [CTX.Process(target=ps_main, args=(r, world, port, kind, script, q), daemon=True) for r in range(world)]
    return collect_world(procs, q, "PS world", timeout)


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


def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """The leading number of each field of /proc/PID/status that has one (VmRSS in kB, Threads, ...)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            first = rest.split()[:1]
            if first and first[0].isdigit():
                out[key] = int(first[0])
    return out


def _rss_bytes(pid: int | str = "self") -> int:
    return _proc_status(pid).get("VmRSS", 0) * 1024


def process_footprint(pid: int) -> dict[str, int]:
    """Resident memory, open descriptors and threads of a process (Linux /proc)."""
    status = _proc_status(pid)
    return {"rss": status.get("VmRSS", 0) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": status.get("Threads", 0)}


def shm_footprint() -> dict[str, int]:
    """/dev/shm bytes in use and the number of ckpt-engine IPC buffers in it."""
    st = os.statvfs("/dev/shm")
    buffers = [n for n in os.listdir("/dev/shm") if n.startswith("ckpt-") and os.path.isfile(f"/dev/shm/{n}")]
    return {"used": (st.f_blocks - st.f_bfree) * st.f_frsize, "ipc_buffers": len(buffers)}


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
        return None if ps._pool is None or ps._pool.region is None else ps._pool.region.nbytes
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
    raise ValueError(f"unknown harness command {cmd!r}")


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
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # the harness asks for stacks when a rank hangs
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
        port = free_port()
        self.conns, self.procs = [], []
        for r in range(size):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=ps_server_main, args=(r, size, port, kind, dict(init or {}), dict(env or {}), child),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        hello = self._collect(range(size), start_timeout)
        bad = {r: o for r, o in hello.items() if not o.ok}
        if bad:
            self.kill_all()
            raise RuntimeError(f"PS ranks failed to start: {bad}")
        self.pids = [hello[r].value["pid"] for r in range(size)]
        self.device_uuids = [hello[r].value["device_uuid"] for r in range(size)]

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

    def all(self, cmd: str, arg=None, *, ranks=None, per_rank: dict | None = None, timeout: float = 60) -> dict[int, Outcome]:
        """Run one command on the given ranks (all by default) and wait for their answers."""
        return self.collect(self.send(cmd, arg, ranks=ranks, per_rank=per_rank), timeout)

    def update(self, name: str, front: "EngineFront | None", timeout: float = 30, behaviors: dict | None = None,
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

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- helpers of the fault-injection suite
FAULT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def fresh_tensor(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random data (never zeros: a transfer that moves nothing must not pass) in any dtype, float8 included."""
    x = torch.randn(shape, generator=gen) * 3
    x[x == 0] = 1.0
    return x.to(dtype)


def fresh_tensors(names_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], gen: torch.Generator) -> dict:
    """``fresh_tensor`` for fixed names."""
    return {name: fresh_tensor(shape, dtype, gen) for name, (shape, dtype) in names_shapes.items()}


def want_digests(*groups: dict[str, torch.Tensor]) -> dict[str, str]:
    """{tensor name: digest} of every tensor of the groups: what the engines must hold afterwards."""
    return {n: digest(t) for g in groups for n, t in g.items()}


def assert_every_rank_failed(got: dict, error: str, *needles: str) -> dict:
    """Every rank's outcome is the exception class ``error`` with each needle in its message."""
    for r, o in got.items():
        assert not o.ok and o.error == error, f"rank {r} should have failed with {error}: {o}"
        for needle in needles:
            assert needle in o.message, f"rank {r}: {needle!r} not in {o.message!r}"
    return got


def assert_healthy_workers_aborted(front: "EngineFront", since: int, before: dict[int, dict], *,
                                   failing: tuple[int, ...] = ()) -> None:
    """After a failed update: every worker not in ``failing`` raised RemoteWorkerError from
    ``update_weights_from_ipc`` (the PS aborted it) and still holds exactly the weights it held
    before (``before``: worker -> digests); no worker committed anything of the failed update."""
    outcomes = front.worker_outcomes(since)
    for i, (status, text) in enumerate(outcomes):
        if i in failing:
            assert status == "error", f"the failing worker {i} reported success: {text}"
            continue
        assert status == "error" and "RemoteWorkerError" in str(text), \
            f"healthy worker {i} did not raise RemoteWorkerError: {status} {str(text)[-800:]}"
    for i in range(len(outcomes)):
        if front.procs[i].is_alive():
            assert front.digests(i) == before[i], f"engine worker {i} changed its weights in a failed update"


class PickleBomb:
    """Unpickling this would create a file: proof that nothing from a socket was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


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


def report_case(case: str, outcome: str, seconds: float | None) -> None:
    """One row of the fault table: printed (pytest -s shows it) and appended to
    $CKPT_FAULT_TABLE when set, so the figures can be collected for the issue note."""
    sec = "-" if seconds is None else f"{seconds:.2f}"
    line = f"FAULT | {case} | {outcome} | {sec}"
    print(line, flush=True)
    path = os.environ.get("CKPT_FAULT_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# --- test-only helpers that used to live in product modules (issue 34 item 6) ---

def hello_fields(device_kind: str, buffer: dict, slot_bytes: int, num_slots: int,
                 buckets: list[list[tuple[str, str, tuple[int, ...], int]]]) -> dict:
    """A hello's fields with its plan inline (``buckets``), for ``protocol.encode("hello", ...)``: the
    PS sends the plan as a second frame (``plan_fragment``); tests build small ones by hand."""
    return {"device_kind": device_kind, "buffer": buffer, "slot_bytes": slot_bytes,
            "num_slots": num_slots, "buckets": [[[n, d, list(s), o] for n, d, s, o in b] for b in buckets]}


def digest_of(view) -> str:
    """The P2P digest of one uint8 tensor's bytes (``ckpt_core.p2p.digests.digests_of`` of one view)."""
    from ckpt_core.p2p.digests import digests_of
    return digests_of([view])[0]
