"""The engine side of the worlds: engine-worker processes that receive updates and keep digests of
what they loaded (``SimEngine``, with injectable faults), the engine front that fans an update
request out to them as an engine's ``/collective_rpc`` does (``EngineFront``), and the req_funcs a
PS rank passes to ``update()`` to post to it.

Shape (mirrors a real deployment): W parameter-server processes (gloo/NCCL world,
``support.world``), W engine-worker processes (one per device), and an "engine front" thread in
the test process that plays vLLM's /collective_rpc: rank 0's req_func connects to it, it fans the
handles out to every worker and answers when all are done. Workers keep what they received and
report SHA-256 digests.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener

from support.data import digest
from support.procs import CTX, release

AUTH = b"ckpt-tests"


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
            if this.get("hold"):   # a pipelined engine (a delta's buckets on a GPU): done once the next bucket ran
                from ckpt_core.wire.worker import Unfinished
                return Unfinished(lambda: None)
            return None

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
        self.listener = (Listener(uds, family="AF_UNIX", authkey=AUTH) if uds
                         else Listener(("127.0.0.1", 0), authkey=AUTH))
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
            release([self.conns[i]], [self.procs[i]])
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
                p.join(5)
        self.listener.close()
        release(self.conns, self.procs)


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
