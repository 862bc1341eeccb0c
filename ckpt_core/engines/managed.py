"""A parameter-server rank started by an engine worker (managed mode, engine-agnostic). Public: it
serves engine adapters (``ckpt_vllm``'s weight-transfer backend calls :func:`start_from_env`).

An engine adapter calls :func:`start_managed` (or :func:`start_from_env`) from the worker's
start-up hook and ``ManagedParameterServer.stop()`` from its shutdown hook; the RL controller
then only talks to the service (``ckpt-engine serve`` on a Unix socket): register, gather, update.

The PS is *not* left a descendant of the worker: engines tear their process tree down with
SIGKILL (vLLM's ``kill_process_tree``), which would leave the socket file behind and skip the
PS's cleanup. It is started through a short-lived intermediate, in its own session, and runs
``ckpt-engine serve --parent-pid PID``: a watcher thread sees the worker gone (or its pid reused)
within :data:`WATCH_S` and stops the service as SIGTERM does: the ParameterServer is closed (host
memory, /dev/shm buffers, process groups) and the socket removed. A PS that is itself SIGKILLed
leaves its /dev/shm buffer to the next PS on the host (it reclaims buffers of dead owners) and its
socket file to the next service on that path (a stale socket is replaced).

The engine does not learn of a PS that fails on its own (a store port another process holds, a
socket path it may not bind, a bad option): the engine keeps serving without it. So the worker
watches its PS too, and logs an error at once when it exits without being stopped, with the last
error line of the PS's log (the root cause; ``ckpt-engine serve`` prints it as it exits):

    ERROR ckpt_core [managed ps rank 0] phase=serve the managed PS (pid 4242) exited without being
    stopped: this engine worker has no PS rank 0; its log /run/ckpt/ps-0.sock.log ends: ckpt-engine
    serve: TransportError: rank 0: cannot reach the rendezvous store at 127.0.0.1:29555: [Errno 98]
    Address already in use
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from ckpt_core.errors import ConfigError
from ckpt_core.ops.log import rank_logger

WATCH_S = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a pid from a reused one); None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def watch_parent(parent_pid: int, on_gone=lambda: os.kill(os.getpid(), signal.SIGTERM)) -> threading.Thread:
    """In the PS: call ``on_gone`` (default: SIGTERM to ourselves) once ``parent_pid`` has exited."""
    born = _start_time(parent_pid)
    if born is None:
        raise ConfigError(f"--parent-pid {parent_pid}: no such process")

    def loop():
        while _start_time(parent_pid) == born:
            time.sleep(WATCH_S)
        rank_logger("managed ps").warning("phase=stop engine worker pid %d is gone: stopping", parent_pid)
        on_gone()
    t = threading.Thread(target=loop, name="ckpt-parent-watch", daemon=True)
    t.start()
    return t


SPEC_OPTIONS = ("allow-dir", "engine-url", "engine-uds")   # ckpt-engine serve's allow-lists (repeatable)
LOG_OPTION = "log"   # log=PATH: where the PS logs ({rank} filled in); default PATH.log of a uds, none for tcp


def parse_serve_spec(spec: str) -> str:
    """``uds:PATH[,OPTION=VALUE...]`` (PATH may hold ``{rank}``) -> PATH; ``tcp:HOST:PORT[,...]`` ->
    ``HOST:PORT``; anything else is a ``ConfigError``."""
    return _parse_spec(spec)[0]


def _parse_spec(spec: str) -> tuple[str, list[str]]:
    """(where, ``serve`` arguments). ``uds:PATH``: a Unix socket (``--uds``); ``tcp:HOST:PORT``: TCP on HOST,
    local rank i on PORT + i (``--host``/``--port``; the service then needs a bearer token,
    ``CKPT_SERVICE_TOKEN`` in the engine's environment, which its PS ranks inherit). Options are the
    allow-lists of ``ckpt-engine serve`` (``allow-dir=DIR``, ``engine-url=URL``, ``engine-uds=PATH``, each
    repeatable), comma-separated."""
    head, *options = spec.split(",")
    kind, sep, where = head.partition(":")
    host, colon, port = where.rpartition(":")
    if kind == "uds" and sep and where:
        args = ["--uds", where]
    elif kind == "tcp" and colon and host and port.isdigit() and 0 < int(port) < 65536:
        args = ["--host", host.strip("[]"), "--port", port]
    else:
        raise ConfigError(f"managed serving spec must be 'uds:PATH[,allow-dir=DIR,...]' "
                          f"(e.g. uds:/run/ckpt/ps-{{rank}}.sock,allow-dir=/ckpt) or 'tcp:HOST:PORT[,...]' (a bearer "
                          f"token in CKPT_SERVICE_TOKEN), got {spec!r}")
    for opt in options:
        key, sep, value = opt.partition("=")
        if key == LOG_OPTION and value:
            continue   # read by log_path_of
        if key not in SPEC_OPTIONS or not sep or not value:
            raise ConfigError(f"managed serving spec option {opt!r} is not one of "
                              f"{', '.join(k + '=...' for k in (*SPEC_OPTIONS, LOG_OPTION))}")
        args += [f"--{key}", value]
    return where, args


def log_path_of(spec: str, rank: int, local_rank: int) -> str | None:
    """Where the PS of ``spec`` logs: its ``log=PATH`` option, else ``PATH.log`` of a Unix socket, else none."""
    where, args = _parse_spec(spec)
    given = [v for k, _, v in (o.partition("=") for o in spec.split(",")[1:]) if k == LOG_OPTION]
    path = given[-1] if given else (where + ".log" if args[0] == "--uds" else None)
    return None if path is None else path.format(rank=rank, local_rank=local_rank)


def last_error(log_path: str | None) -> str:
    """What the end of a managed PS's log says of why it ended: its last ``ckpt-engine serve:`` line
    (the CLI's one line per fatal error), else its last line; a note when there is no log."""
    if log_path is None:
        return "it logs nowhere (add log=PATH to CKPT_ENGINE_SERVE to see why)"
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError as exc:
        return f"its log {log_path} cannot be read: {exc}"
    fatal = [ln for ln in lines if ln.startswith("ckpt-engine serve:")]
    return f"its log {log_path} ends: {(fatal or lines or ['(nothing)'])[-1][-1000:]}"


class ManagedParameterServer:
    """A PS process started by :func:`start_managed`; ``stop()`` is idempotent.

    ``exited``: set when the PS ended without ``stop()`` (the watch thread has logged why, as far as
    its log says: :func:`last_error`); ``failure`` is that message.
    """

    def __init__(self, pid: int, uds: str | None, rank: int, log_path: str | None):
        self.pid, self.uds, self.rank, self.log_path = pid, uds, rank, log_path
        self._born = _start_time(pid)
        self._log = rank_logger(f"managed ps rank {rank}")
        self._stopping = threading.Event()
        self.exited = threading.Event()
        self.failure: str | None = None

    def alive(self) -> bool:
        return self._born is not None and _start_time(self.pid) == self._born

    def watch(self) -> threading.Thread:
        """Watch the PS from the engine worker (a daemon thread, every :data:`WATCH_S`) until ``stop()``:
        if it exits on its own, log an error naming its rank and why (once) and set ``exited``."""
        def loop():
            while not self._stopping.wait(WATCH_S):
                if not self.alive():
                    if self._stopping.is_set():
                        return
                    self.failure = (f"the managed PS (pid {self.pid}) exited without being stopped: this engine "
                                    f"worker has no PS rank {self.rank}; {last_error(self.log_path)}")
                    self._log.error("phase=serve %s", self.failure)
                    self.exited.set()
                    return
        t = threading.Thread(target=loop, name=f"ckpt-managed-ps-{self.rank}", daemon=True)
        t.start()
        return t

    def stop(self, timeout: float = 30.0) -> bool:
        """SIGTERM (the service closes the PS and removes its socket), SIGKILL after ``timeout``.

        Returns whether it stopped by itself (False: it had to be killed).
        """
        self._stopping.set()   # the watch thread: this exit is asked for
        clean = True
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if not self.alive():
                break
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.alive() and sig == signal.SIGTERM:
                self._log.warning("phase=stop pid %d ignored SIGTERM for %.0f s: SIGKILL", self.pid, timeout)
                clean = False
        if not clean and self.uds is not None and os.path.lexists(self.uds):
            os.unlink(self.uds)   # a killed service could not remove it
        return clean


def start_managed(spec: str, *, rank: int, world_size: int, local_rank: int, device: str,
                  master_addr: str = "127.0.0.1", master_port: int = 29555, extra_args: list[str] | tuple = (),
                  log_path: str | None = None) -> ManagedParameterServer:
    """Start this worker's PS rank serving where ``spec`` says (``uds:PATH[,allow-dir=DIR,...]`` or
    ``tcp:HOST:PORT[,...]``: the options are ``ckpt-engine serve``'s allow-lists); returns at once.

    ``rank``/``world_size``: the PS world (one rank per engine worker; every worker of the engine
    starts one; they meet at ``master_addr:master_port``). ``device``: the worker's device kind,
    ``local_rank`` its index. Poll the service's ``/v1/healthz`` for readiness. A PS that exits on its
    own (its store port taken, ...) is logged here at once, with the cause its log gives
    (:meth:`ManagedParameterServer.watch`).
    """
    where, args = _parse_spec(spec)
    uds: str | None = None
    if args[0] == "--uds":
        args[1] = uds = where.format(rank=rank, local_rank=local_rank)
    host, _, port = where.rpartition(":")
    shown = uds if uds is not None else f"{host}:{int(port) + local_rank} (TCP)"   # local rank i: PORT + i
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
               MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    argv = [sys.executable, "-m", "ckpt_core.cli", "serve", "--device", device,
            "--parent-pid", str(os.getpid()), *args, *extra_args]
    # The intermediate starts the PS in a new session, prints its pid and exits: the PS is then
    # nobody's descendant here, so a process-tree kill of the engine cannot reach it.
    launcher = ("import json, subprocess, sys\n"
                "argv, log = json.loads(sys.argv[1]), sys.argv[2]\n"
                "out = open(log, 'ab') if log else subprocess.DEVNULL\n"
                "p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,"
                " start_new_session=True)\n"
                "print(p.pid, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", launcher, json.dumps(argv), log_path or ""], env=env,
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0 or not proc.stdout.strip().isdigit():
        raise ConfigError(f"could not start the managed parameter server: {proc.stderr.strip()[-2000:]}")
    pid = int(proc.stdout.strip())
    rank_logger(f"managed ps rank {rank}").info("phase=start pid %d serving on %s (world %d, %s:%d)", pid, shown,
                                                world_size, device, local_rank)
    managed = ManagedParameterServer(pid, uds, rank, log_path)
    managed.watch()
    return managed


def start_from_env(*, rank: int, world_size: int, local_rank: int, device: str) -> ManagedParameterServer | None:
    """:func:`start_managed` as ``CKPT_ENGINE_SERVE`` asks (None when unset); the PS logs to ``log=PATH``
    of the spec, else to PATH.log of a Unix socket."""
    from ckpt_core._settings import engine_serve
    asked = engine_serve()
    if asked is None:
        return None
    spec, host, port = asked
    return start_managed(spec, rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                         master_addr=host, master_port=port, log_path=log_path_of(spec, rank, local_rank))
