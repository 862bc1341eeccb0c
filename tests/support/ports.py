"""Ports for the servers and worlds the tests start, picked where nothing else is handed them.

``bind(("127.0.0.1", 0))`` returns a port of the kernel's ephemeral range, the range every other
``bind(0)`` and every outgoing connection draws from. Between the moment a test picks a port and
the moment its server binds it (a vLLM server imports for ~20 s first), another process of the
two-half suite can be handed the same port, and the server dies with "Address already in use".
``free_port()`` picks at random below that range and checks that the port is free.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000
LAUNCHES = 3   # a server that lost its port to another process is launched again on another, this often
_RNG = random.SystemRandom()   # not a seeded generator: forked processes must not pick alike


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
