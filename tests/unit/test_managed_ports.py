"""A server whose managed PS lost a port picked for it (its store's, a TCP service's) to another process
before it bound it is launched again, on fresh ports (its HTTP port too), and only then: a managed PS
that failed otherwise fails the wait at once, with its log. The server is a stand-in for vLLM's
(``python -m vllm.entrypoints.openai.api_server`` answering ``/health``) whose worker starts its PS
rank with the product's ``start_from_env``, as the ``ckpt`` backend does: real ``ckpt-engine serve``."""

from __future__ import annotations

import os
import sys
import textwrap

import httpx
import pytest
from support.managed_ps import ManagedPs

pytest_plugins = ["support.port_fixtures"]   # held, picks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))
from vllm_support.server import VllmServer  # noqa: E402

API_SERVER = textwrap.dedent("""
    import argparse
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from ckpt_core.engines.managed import start_from_env

    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args, _ = parser.parse_known_args()
    managed = start_from_env(rank=0, world_size=1, local_rank=0, device="cpu")   # the worker's start hook

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    ThreadingHTTPServer((args.host, args.port), Health).serve_forever()
""")
TOKEN = "t" * 32


@pytest.fixture
def fake_vllm(tmp_path):
    """A folder for PYTHONPATH whose ``vllm.entrypoints.openai.api_server`` is the stand-in."""
    root = tmp_path / "fake"
    package = root / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (root / "vllm", root / "vllm" / "entrypoints", package):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(API_SERVER)
    return str(root)


def _server(tmp_path, fake_vllm, managed: ManagedPs, **env) -> VllmServer:
    return VllmServer(sys.executable, tmp_path, tmp_path / "server.log", extension=False, managed=managed,
                      env={"PYTHONPATH": fake_vllm, **env})


def _serves_uds(path) -> bool:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://ps", timeout=30) as client:
        return client.get("/v1/healthz").status_code == 200


def test_a_server_whose_managed_ps_lost_its_store_port_is_launched_again_on_fresh_ports(
        tmp_path, fake_vllm, held, picks, capfd):
    queued, picked, free_port = picks
    queued += [free_port(), held]   # the server's HTTP port, then its PS's store port: taken
    managed = ManagedPs(f"uds:{tmp_path}/ps-{{rank}}.sock")
    with _server(tmp_path, fake_vllm, managed) as server:
        assert managed.state() == "serving" and _serves_uds(tmp_path / "ps-0.sock")
        assert len(picked) == 4 and managed.store_port == picked[3] != held and server.port == picked[2]
        log = (tmp_path / "ps-0.sock.log").read_text()
        assert f"cannot reach the rendezvous store at 127.0.0.1:{held}: [Errno 98] Address already in use" in log
    err = capfd.readouterr().err
    assert f"its managed PS's port (store {held})" in err and "launch 2 of 3, on fresh ports" in err


def test_a_server_whose_managed_ps_lost_its_tcp_service_port_is_launched_again(
        tmp_path, fake_vllm, held, picks, capfd):
    queued, picked, free_port = picks
    queued += [free_port(), free_port(), held]   # HTTP, store, the PS service's port: taken
    managed = ManagedPs(f"tcp:127.0.0.1:{{port}},log={tmp_path}/ps-{{rank}}.log")
    with _server(tmp_path, fake_vllm, managed, CKPT_SERVICE_TOKEN=TOKEN):
        assert managed.state() == "serving" and managed.port == picked[5] != held
        with httpx.Client(base_url=managed.services()[0], headers={"Authorization": f"Bearer {TOKEN}"}) as client:
            assert client.get("/v1/healthz").status_code == 200
    assert f"service {held})" in capfd.readouterr().err


def test_a_managed_ps_that_failed_otherwise_fails_the_wait_at_once_without_a_relaunch(
        tmp_path, fake_vllm, held, picks, capfd):
    """Its socket's folder does not exist: ``serve`` fails after the store bound. The held port is
    not the store's; ``free_port`` was asked for no second launch."""
    picked = picks[1]
    managed = ManagedPs(f"uds:{tmp_path}/missing/ps-{{rank}}.sock,log={tmp_path}/ps-{{rank}}.log")
    server = _server(tmp_path, fake_vllm, managed)
    with pytest.raises(RuntimeError, match="managed PS did not start") as failed:
        server.start(timeout=120)
    assert "the directory of the unix socket does not exist" in str(failed.value)
    assert len(picked) == 2 and not server.alive()
    assert "fresh ports" not in capfd.readouterr().err


@pytest.mark.parametrize("rank, fatal, lost", [
    (0, "ckpt-engine serve: TransportError: rank 0: cannot reach the rendezvous store at 127.0.0.1:{store}: "
        "[Errno 98] Address already in use", True),
    (0, "ckpt-engine serve: DistNetworkError: The server socket has failed to listen on any local network address. "
        "port: {store}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use", True),
    (1, "ckpt-engine serve: ConfigError: cannot listen on 127.0.0.1:{service1}: [Errno 98] Address already in use",
     True),
    (0, "ckpt-engine serve: TransportError: rank 0: cannot reach the rendezvous store at 127.0.0.1:{other}: "
        "[Errno 98] Address already in use", False),                   # another port than the one picked
    (1, "ckpt-engine serve: TransportError: rank 1: cannot reach the rendezvous store at 127.0.0.1:{store}: "
        "[Errno 111] Connection refused", False),                      # a rank that could not connect
    (0, "ckpt-engine serve: ConfigError: cannot listen on 127.0.0.1:{service1}: [Errno 98] Address already in use",
     False),                                                            # rank 1's port, in rank 0's log
    (0, "phase=serve listening on 127.0.0.1:{service0}\nckpt-engine serve: TransportError: rank 0: cannot reach "
        "the rendezvous store at 127.0.0.1:{store}: Address already in use", False),   # it served first
    (0, "ckpt-engine serve: ConfigError: the directory of the unix socket does not exist", False),
])
def test_a_lost_managed_port_is_told_by_the_whole_signature(tmp_path, rank, fatal, lost):
    managed = ManagedPs(f"tcp:127.0.0.1:{{port}},log={tmp_path}/ps-{{rank}}.log", ranks=2)
    managed.pick()
    ports_of = {"store": managed.store_port, "service0": managed.port, "service1": managed.port + 1,
                "other": managed.store_port + 7}
    (tmp_path / f"ps-{rank}.log").write_text("INFO starting\n" + fatal.format(**ports_of) + "\n")
    assert managed.lost_port() is lost
    assert managed.state() == ("lost" if lost else "failed")
