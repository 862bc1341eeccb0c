"""A service world (support.service_world.ServiceWorld, real ``ckpt-engine serve`` processes) whose
rank 0 could not serve its store on the port free_port() gave, another process holding it, is started
again on another port before any test sees it; a world that fails otherwise is not."""

from __future__ import annotations

import socket

import pytest
import support.ports as ports
from support.service_world import ServiceWorld

PS_LOST = ("ckpt-engine serve: TransportError: rank 0: cannot reach the rendezvous store at 127.0.0.1:{port}: "
           "[Errno 98] Address already in use")


@pytest.fixture
def held():
    """A port another process holds (listening), as one of the suite's other half would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def picks(monkeypatch):
    """free_port() as the launchers see it: the ports queued first, then free ones; every pick listed."""
    queued: list[int] = []
    picked: list[int] = []
    free_port = ports.free_port

    def pick() -> int:
        picked.append(queued.pop(0) if queued else free_port())
        return picked[-1]

    monkeypatch.setattr(ports, "free_port", pick)
    return queued, picked


@pytest.mark.parametrize("log, lost", [
    (PS_LOST, True),
    (PS_LOST.replace("{port}", "12346"), False),   # another port
    ("TransportError: rank 1: cannot reach the rendezvous store at 127.0.0.1:{port}: connection refused", False),
    ("OSError: [Errno 98] Address already in use", False),   # not the store's
])
def test_a_lost_store_port_is_told_by_the_parameter_servers_own_words(log, lost):
    assert ports.store_lost_port(log.replace("{port}", "12345"), 12345) is lost


@pytest.mark.slow   # real serve processes, started twice
def test_a_world_whose_store_port_was_taken_starts_again_on_another_and_serves(tmp_path, held, picks, capsys):
    queued, picked = picks
    queued.append(held)
    world = ServiceWorld(2, str(tmp_path))
    try:
        assert [c.get("/v1/healthz").status_code for c in world.clients] == [200, 200]
    finally:
        assert world.close() == [0, 0]
    assert len(picked) == 2 and picked[0] == held != picked[1]
    said = capsys.readouterr().err
    assert f"could not bind port {held}" in said and f"launch 2 of {ports.LAUNCHES}" in said


@pytest.mark.slow   # a real serve process
def test_a_world_failing_for_another_reason_is_not_started_again(tmp_path, picks):
    _, picked = picks
    with pytest.raises(RuntimeError, match="unknown device kind 'nosuch'"):
        ServiceWorld(1, str(tmp_path), device="nosuch")
    assert len(picked) == 1
