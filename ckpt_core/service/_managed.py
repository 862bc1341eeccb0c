"""A parameter-server rank as a child process of an engine worker (managed mode, engine-agnostic).

An engine adapter calls :func:`start_managed` from the worker's start-up hook and
``ManagedParameterServer.stop()`` from its shutdown hook; the RL controller then only talks to
the service (``ckpt-engine serve`` on a Unix socket): register files, gather, update.

The child cannot outlive its worker: it runs ``ckpt-engine serve --parent-pid PID``, which asks
the kernel (``PR_SET_PDEATHSIG``) for SIGTERM when the thread that started it exits, and exits
at once if that parent is already gone. SIGTERM makes the service close the ParameterServer
(host memory, /dev/shm buffers, process groups) and remove its socket. A child that is itself
SIGKILLed leaves its /dev/shm buffer to the next PS on the host, which reclaims buffers of dead
owners. Start it from a thread that lives as long as the worker (its main thread).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from ..errors import ConfigError, UpdateTimeoutError
from .._log import rank_logger

PR_SET_PDEATHSIG = 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def die_with_parent(parent_pid: int) -> None:
    """In the child: SIGTERM when the parent dies; exit now if it already did (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as exc:
        raise ConfigError(f"--parent-pid needs Linux prctl: {exc}") from exc
    if os.getppid() != parent_pid:   # the parent died before prctl took effect
        sys.exit(0)


def parse_serve_spec(spec: str) -> str:
    """``uds:PATH`` (PATH may hold ``{rank}``) -> PATH; anything else is a ``ConfigError``."""
    kind, sep, path = spec.partition(":")
    if kind != "uds" or not sep or not path:
        raise ConfigError(f"managed serving spec must be 'uds:PATH' (e.g. uds:/run/ckpt/ps-{{rank}}.sock), got {spec!r}")
    return path


class ManagedParameterServer:
    """One child ``ckpt-engine serve`` process; ``stop()`` is idempotent."""

    def __init__(self, proc: subprocess.Popen, uds: str, rank: int, log_path: str | None):
        self.proc, self.uds, self.rank, self.log_path = proc, uds, rank, log_path
        self._log = rank_logger(f"managed ps rank {rank}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (the service closes the PS and removes its socket), SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._log.warning("phase=stop pid %d ignored SIGTERM for %.0f s: SIGKILL", self.proc.pid, timeout)
                self.proc.kill()
                self.proc.wait(10)
        if os.path.lexists(self.uds) and self.proc.returncode != 0:
            os.unlink(self.uds)   # a killed child could not remove it
        return self.proc.returncode


def start_managed(spec: str, *, rank: int, world_size: int, local_rank: int, device: str,
                  master_addr: str = "127.0.0.1", master_port: int = 29555, extra_args: list[str] | tuple = (),
                  log_path: str | None = None) -> ManagedParameterServer:
    """Start this worker's PS rank as a child serving on the socket of ``spec`` (``uds:PATH``).

    ``rank``/``world_size``: the PS world (one rank per engine worker; every worker of the engine
    must start one, they rendezvous at ``master_addr:master_port``). ``device``: the worker's
    device kind; ``local_rank`` its device index. Returns at once: poll the service's
    ``/v1/healthz`` for readiness.
    """
    uds = parse_serve_spec(spec).format(rank=rank, local_rank=local_rank)
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
               MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ckpt_core.cli", "serve", "--device", device, "--uds", uds,
                                 "--parent-pid", str(os.getpid()), *extra_args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, close_fds=True)
    finally:
        if log_path:
            out.close()
    rank_logger(f"managed ps rank {rank}").info("phase=start pid %d serving on %s (world %d, %s:%d)", proc.pid, uds,
                                                world_size, device, local_rank)
    return ManagedParameterServer(proc, uds, rank, log_path)


def wait_socket(path: str, proc: subprocess.Popen, timeout: float) -> None:
    """Wait until the service's socket exists (or fail naming the child's exit)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise ConfigError(f"the managed parameter server exited with {proc.returncode} before serving on {path}")
        if time.monotonic() > deadline:
            raise UpdateTimeoutError(f"the managed parameter server did not create {path} within {timeout} s")
        time.sleep(0.05)
