"""The tests' child processes: how the worlds start them (a fork server that imported torch once),
the PYTHONPATH a child interpreter gets, collecting what a world of rank processes reports, and what
a process holds (memory, descriptors, threads, /dev/shm buffers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from support.ports import on_a_free_port, store_lost_port

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


class StorePortLost(RuntimeError):
    """A world's rank could not serve the rendezvous store on the port it was given: another process
    held it (taken after free_port() picked it). Nothing of the test ran; its ranks were killed."""


def kill_with_children(pids: list[int]) -> None:
    """SIGKILL each process and the processes it started (a PS rank's engine worker), children first:
    a worker left behind would wait for its rank for ever."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for victim in [*children, pid]:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass


def collect_world(procs: list, q, what: str, timeout: float, join_s: float = 5, *,
                  port: int | None = None) -> dict[int, list]:
    """Start ``procs`` (one per rank; each puts ``(rank, result)`` on ``q``) and return every rank's
    result, failing with ``what`` named when they do not finish within ``timeout`` or all die silently.
    ``port``: the world's store port; a rank whose result says it could not serve the store there
    (``store_lost_port``) ends the world at once, the others killed (they would wait for that store
    until their timeout), with :class:`StorePortLost`."""
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
                continue
            if port is not None and store_lost_port(str(res), port):
                kill_with_children([p.pid for p in procs if p.is_alive()])
                raise StorePortLost(f"{what}: rank {rank} could not serve the rendezvous store on port {port}, "
                                    "another process holding it")
    finally:
        for p in procs:
            p.join(join_s)
            if p.is_alive():
                p.kill()
    return out


def run_world(ranks, what: str, timeout: float, join_s: float = 5) -> dict[int, list]:
    """``collect_world`` of the rank processes ``ranks(port)`` makes (not started, and the queue they
    report on) on a port of free_port()'s; made and started again on another (``on_a_free_port``) when a
    rank could not serve the store there (:class:`StorePortLost`)."""
    def launch(port: int) -> dict[int, list]:
        procs, q = ranks(port)
        return collect_world(procs, q, what, timeout, join_s, port=port)

    return on_a_free_port(launch, lambda outcome, port: isinstance(outcome, StorePortLost), f"{what}'s store")


def release(conns: list, procs: list) -> None:
    """Close a world's pipe ends and its exited ``Process`` objects (their sentinel descriptors): a pytest
    process starts hundreds of worlds, and what each left open once passed FD_SETSIZE (1024) in the
    whole suite (``select()`` then refused a descriptor). A process still running keeps its object."""
    for c in conns:
        c.close()
    for p in procs:
        try:
            p.close()
        except ValueError:   # still running: kill_with_children or the caller's kill comes first
            pass


def leave_gloo_world(out) -> None:
    """End a spawned rank of a gloo world once everything it reports is in ``out`` (a multiprocessing
    queue): a barrier (no rank tears its group down under a peer's collective), the group destroyed,
    the queue flushed, then ``os._exit(0)`` without the interpreter's teardown. There a gloo
    std::thread not joined yet (one a rank gave up waiting on, completed later) can make libstdc++
    call std::terminate: exit code -6 after every result was right (seen on a loaded 2-core machine)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    out.close()
    out.join_thread()
    os._exit(0)


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


def rss_bytes(pid: int | str = "self") -> int:
    return _proc_status(pid).get("VmRSS", 0) * 1024


def process_footprint(pid: int) -> dict[str, int]:
    """Resident memory, open descriptors and threads of a process (Linux /proc)."""
    status = _proc_status(pid)
    return {"rss": status.get("VmRSS", 0) * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": status.get("Threads", 0)}


def shm_footprint(pids=None) -> dict[str, int]:
    """/dev/shm bytes in use and the number of ckpt-engine IPC buffers in it; with ``pids``, only the
    buffers those processes made (``ckpt-NAME-pPIDnNS``): other tests running at the same time (the
    suite's other half, say) make and free their own."""
    st = os.statvfs("/dev/shm")
    owned = None if pids is None else tuple(f"-p{pid}n" for pid in pids)
    buffers = [n for n in os.listdir("/dev/shm") if n.startswith("ckpt-") and os.path.isfile(f"/dev/shm/{n}")
               and (owned is None or any(o in n for o in owned))]
    return {"used": (st.f_blocks - st.f_bfree) * st.f_frsize, "ipc_buffers": len(buffers)}
