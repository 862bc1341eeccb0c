"""Fixtures of the tests of a lost ``free_port()`` pick (``test_torchrun_ports.py``, ``test_world_ports.py``):
import them into a test module (``from support.port_fixtures import held, picks``)."""

from __future__ import annotations

import socket

import pytest

import support.ports as ports


@pytest.fixture
def held():
    """A port another process holds (listening), as one of the suite's other half would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def picks(monkeypatch):
    """free_port() as the launchers see it: the ports queued first, then free ones; every pick listed.
    (queued, picked, the real free_port)."""
    queued: list[int] = []
    picked: list[int] = []
    free_port = ports.free_port

    def pick() -> int:
        picked.append(queued.pop(0) if queued else free_port())
        return picked[-1]

    monkeypatch.setattr(ports, "free_port", pick)
    return queued, picked, free_port
