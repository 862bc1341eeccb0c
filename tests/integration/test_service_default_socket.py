"""`ckpt-engine serve` without --uds listens in a private per-user directory, not in world-writable /tmp."""

import os
import stat

import httpx
import pytest

pytest.importorskip("fastapi")
from support.ports import free_port  # noqa: E402
from support.service_world import serve_healthy, start_serve, stop  # noqa: E402


def test_the_default_socket_is_in_a_0700_directory_of_this_user(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "XDG_RUNTIME_DIR": str(runtime)}
    log = str(tmp_path / "serve.log")
    sock = runtime / "ckpt-engine" / "ps-0.sock"

    def client_of(_port):
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://ps", timeout=60)

    proc, _ = serve_healthy(lambda _port: ["--device", "cpu"], env, log, client_of)   # again if its store was taken
    client = client_of(None)
    try:
        d = os.lstat(runtime / "ckpt-engine")
        assert stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        assert str(sock) in open(log).read(), "the log says where it listens"
    finally:
        client.close()
        assert stop(proc) == 0, open(log).read()[-3000:]
    assert not sock.exists()


def test_a_default_socket_directory_that_others_can_enter_is_refused(tmp_path):
    runtime = tmp_path / "run"
    (runtime / "ckpt-engine").mkdir(parents=True)
    os.chmod(runtime / "ckpt-engine", 0o777)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "XDG_RUNTIME_DIR": str(runtime)}
    log = str(tmp_path / "serve.log")
    proc = start_serve(["--device", "cpu"], env, log)
    assert proc.wait(120) == 4
    text = open(log).read()
    assert "mode 0700" in text and "Traceback" not in text, text[-2000:]
