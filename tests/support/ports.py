"""Ports for the servers and worlds the tests start, picked where nothing else is handed them.

``bind(("127.0.0.1", 0))`` returns a port of the kernel's ephemeral range, the range every other
``bind(0)`` and every outgoing connection draws from. Between the moment a test picks a port and
the moment its server binds it (a vLLM server imports for ~20 s first), another process of the
two-half suite can be handed the same port, and the server dies with "Address already in use".
``free_port()`` picks at random below that range and checks that the port is free.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
from typing import Callable, TypeVar

LOWEST = 10000
LAUNCHES = 3   # a server that lost its port to another process is launched again on another, this often
_RNG = random.SystemRandom()   # not a seeded generator: forked processes must not pick alike
T = TypeVar("T")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bound(port: int) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        return s.getsockname()[1]


def free_port() -> int:
    high = _ephemeral_low() - 1
    if high - LOWEST >= 1000:
        for _ in range(100):
            try:
                return _bound(_RNG.randint(LOWEST, high))
            except OSError:
                continue
    return _bound(0)   # an ephemeral range that starts low: the kernel's choice


def lost_port(log: str) -> bool:
    """Whether a server's log says another process bound its port first (vLLM: "Address already
    in use", uvicorn: "address already in use")."""
    return "address already in use" in log.lower()


def store_lost_port(log: str, port: int) -> bool:
    """Whether a process's output says it could not serve its rendezvous store on ``port`` because
    another process held it: a ParameterServer's ("TransportError: rank 0: cannot reach the rendezvous
    store at 127.0.0.1:PORT: [Errno 98] Address already in use"; a rank that could not connect to the
    store says the same without "address already in use") or torch's TCPStore's ("DistNetworkError: The
    server socket has failed to listen on any local network address. port: PORT, useIpv6: false,
    code: -98, name: EADDRINUSE, ...")."""
    ours = re.search(rf"cannot reach the rendezvous store at \S+:{port}: .*address already in use", log, re.I)
    torchs = re.search(rf"failed to listen on any local network address\. port: {port}\b.*EADDRINUSE", log)
    return ours is not None or torchs is not None


def on_a_free_port(launch: Callable[[int], T], lost: Callable[[object, int], bool], what: str) -> T:
    """``launch(port)`` on a port of ``free_port()``'s, launched again on another, ``LAUNCHES`` times in
    all, while ``lost(outcome, port)`` says of what it returned or raised that another process took the
    port before ``launch``'s process bound it (so nothing of what the test runs ran yet); the last
    launch's return or exception. Each retry is said on stderr, naming ``what``."""
    for n in range(1, LAUNCHES + 1):
        port = free_port()
        try:
            outcome = launch(port)
        except Exception as exc:
            if n == LAUNCHES or not lost(exc, port):
                raise
        else:
            if n == LAUNCHES or not lost(outcome, port):
                return outcome
        print(f"{what} could not bind port {port} (another process took it after free_port() picked it): "
              f"launch {n + 1} of {LAUNCHES}, on another port", file=sys.stderr)
    raise AssertionError("unreachable: the last launch returns")


def run_with_master_port(cmd, *, env: dict, timeout: float, cwd=None) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)``, output captured as text, with ``MASTER_PORT`` a port of ``free_port()``'s,
    for a process whose ParameterServer serves its store there (rank 0 of a world of its own); run again
    on another port when it failed having printed nothing on stdout and its stderr says that it could not
    serve the store there (``store_lost_port``)."""
    def launch(port: int) -> subprocess.CompletedProcess:
        return subprocess.run([str(c) for c in cmd], env={**env, "MASTER_PORT": str(port)}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def lost(run, port: int) -> bool:
        return (isinstance(run, subprocess.CompletedProcess) and bool(run.returncode) and not run.stdout.strip()
                and store_lost_port(run.stderr, port))

    return on_a_free_port(launch, lost, "a ParameterServer's store")
