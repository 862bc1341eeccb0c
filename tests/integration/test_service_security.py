"""The service acts only on what the operator allowed at start: files under --allow-dir, engines it may post to.

A real `ckpt-engine serve` process (1 rank, Unix socket) started with `--allow-dir CKPTS`. A client
names files outside it (absolute, relative, `..`, a symlink out): 403 `Forbidden` naming the rule,
nothing read, nothing of the file echoed. A file inside that is not safetensors is a 422 that does not
echo its bytes either. An update whose `update_url`/`uds` point at another local service (a
docker.sock stand-in on a Unix socket, or a loopback HTTP server's other route) is a 403 and that
service receives nothing.
"""

from __future__ import annotations

import os
import socket
import struct
import threading

import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor  # noqa: E402
from support.service_world import ServiceWorld  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402

SECRET = b"root:*:20000:0:99999:7:::\n"   # what /etc/shadow starts with; its first 8 bytes as a u64 were echoed


class Listener:
    """A stand-in for a local service (docker.sock, another HTTP API): records every request line."""

    def __init__(self, path: str | None = None):
        self.lines: list[bytes] = []
        if path:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(path)
        else:
            self.sock = socket.socket()
            self.sock.bind(("127.0.0.1", 0))
            self.port = self.sock.getsockname()[1]
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                try:
                    self.lines.append(conn.recv(65536).split(b"\r\n", 1)[0])
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("svc-sec")
    ckpts, outside = root / "ckpts", root / "outside"
    ckpts.mkdir()
    outside.mkdir()
    (outside / "shadow").write_bytes(SECRET)
    gen = torch.Generator().manual_seed(2101)
    write_file(str(ckpts / "good.safetensors"), {f"w{i}": fresh_tensor((257 + i,), FAULT_DTYPES[i % 4], gen)
                                                 for i in range(4)})
    (ckpts / "not-safetensors.txt").write_bytes(SECRET)
    os.symlink(outside / "shadow", ckpts / "link-out.safetensors")
    os.symlink(ckpts / "good.safetensors", ckpts / "link-in.safetensors")
    w = ServiceWorld(1, str(root), allow_dirs=(str(ckpts),))
    w.ckpts, w.outside = ckpts, outside
    yield w
    assert w.close() == [0]


def _leaks(text: str) -> bool:
    (as_u64,) = struct.unpack("<Q", SECRET[:8])
    return str(as_u64) in text or SECRET[:8].decode() in text or repr(SECRET[:8])[2:-1] in text


@pytest.mark.parametrize("case", ["absolute outside", "relative", "dot-dot out", "symlink out", "etc shadow"])
def test_a_file_outside_the_allowed_directories_is_a_403_naming_the_rule_and_nothing_is_read(service, case):
    path = {"absolute outside": str(service.outside / "shadow"),
            "relative": "ckpts/good.safetensors",
            "dot-dot out": f"{service.ckpts}/../outside/shadow",
            "symlink out": str(service.ckpts / "link-out.safetensors"),
            "etc shadow": "/etc/shadow"}[case]
    c = service.clients[0]
    resp = c.post(f"/v1/checkpoints/{case.replace(' ', '-')}/files", json={"files": [path]})
    assert resp.status_code == 403, resp.text
    err = resp.json()["error"]
    assert err["type"] == "Forbidden" and "--allow-dir" in err["message"] and str(service.ckpts) in err["message"], err
    assert not _leaks(resp.text), f"the answer echoes the file's bytes: {resp.text}"
    assert c.get("/v1/status").json()["checkpoints"] == [], "nothing was registered"


def test_files_inside_the_allowed_directory_register_through_a_symlink_too_and_bad_ones_do_not_echo_bytes(service):
    c = service.clients[0]
    resp = c.post("/v1/checkpoints/inside/files", json={"files": [str(service.ckpts / "link-in.safetensors")]})
    assert resp.status_code == 200, resp.text
    assert c.delete("/v1/checkpoints/inside").status_code == 200
    resp = c.post("/v1/checkpoints/text/files", json={"files": [str(service.ckpts / "not-safetensors.txt")]})
    assert resp.status_code == 422 and resp.json()["error"]["type"] == "CheckpointFormatError", resp.text
    assert "not-safetensors.txt" in resp.json()["error"]["message"]
    assert not _leaks(resp.text), f"the format error echoes the file's bytes: {resp.text}"


def _registered(service, name: str) -> None:
    c = service.clients[0]
    assert c.post(f"/v1/checkpoints/{name}/files", json={"files": [str(service.ckpts / "good.safetensors")]}
                  ).status_code == 200
    assert c.post(f"/v1/checkpoints/{name}/gather-metas").status_code == 200


def test_an_update_never_posts_to_a_unix_socket_or_route_the_operator_did_not_allow(service, tmp_path):
    _registered(service, "target")
    docker = Listener(str(tmp_path / "docker.sock"))
    web = Listener()
    c = service.clients[0]
    try:
        for body, needle in (
                ({"update_url": "http://localhost/v1.43/containers/victim/kill", "uds": docker.sock.getsockname()},
                 "--engine-uds"),
                ({"update_url": "http://localhost/collective_rpc", "uds": docker.sock.getsockname()}, "--engine-uds"),
                ({"update_url": f"http://127.0.0.1:{web.port}/v1.43/containers/victim/kill"}, "/collective_rpc"),
                ({"update_url": f"http://127.0.0.1:{web.port}/collective_rpc/../admin"}, "/collective_rpc"),
                ({"update_url": "http://192.0.2.7:8000/collective_rpc"}, "loopback")):
            resp = c.post("/v1/checkpoints/target/update", json=dict(body, timeout=20))
            assert resp.status_code == 403, (body, resp.text)
            err = resp.json()["error"]
            assert err["type"] == "Forbidden" and needle in err["message"], (body, err)
        assert docker.lines == [] and web.lines == [], f"the service posted anyway: {docker.lines + web.lines}"
    finally:
        docker.close()
        web.close()
    assert c.get("/v1/healthz").status_code == 200
    assert c.delete("/v1/checkpoints/target").status_code == 200
