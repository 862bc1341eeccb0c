"""The shared HTTP transport against a raw socket server whose connection handling we script."""

import socket
import threading
import time

import pytest

from ckpt_core.engines.http import HttpTransport, Phases
from ckpt_core.errors import ClosedError, RemoteWorkerError, TransportError, UpdateTimeoutError

pytestmark = pytest.mark.timeout(60)


class RawServer:
    """Answers ``answers_per_connection`` requests on each connection, then closes it on the next
    request without answering (what a server whose keep-alive ended does). ``silent``: never answers."""

    def __init__(self, answers_per_connection: int = 1, *, status: int = 200, silent: bool = False):
        self.answers, self.status, self.silent = answers_per_connection, status, silent
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.requests: list[str] = []
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        answered = 0
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length")), 0)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                self.requests.append(head.split(b"\r\n")[0].decode())
                if self.silent:
                    time.sleep(30)
                    return
                if answered >= self.answers:
                    return   # close without an answer
                answered += 1
                body = b'{"error": {"message": "boom"}}' if self.status != 200 else b'{"ok": true}'
                conn.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (self.status, len(body), body))

    def close(self):
        self.sock.close()
        for c in self._open:
            c.close()


@pytest.fixture
def raw():
    servers = []

    def make(*a, **kw):
        servers.append(RawServer(*a, **kw))
        return servers[-1]
    yield make
    for s in servers:
        s.close()


def test_a_request_on_a_pooled_connection_the_server_closed_is_sent_again_on_a_fresh_one(raw):
    srv = raw(answers_per_connection=1)
    with HttpTransport(srv.url, timeout=10) as http:
        assert http.request("POST", "/a", json={}).json() == {"ok": True}
        assert http.request("POST", "/b", json={}).json() == {"ok": True}
    assert http.retries == 1
    assert srv.requests == ["POST /a HTTP/1.1", "POST /b HTTP/1.1", "POST /b HTTP/1.1"]
    assert srv.connections == 2


def test_a_fresh_connection_closed_without_an_answer_is_not_sent_twice(raw):
    srv = raw(answers_per_connection=0)
    with HttpTransport(srv.url, timeout=10) as http:
        with pytest.raises(TransportError, match="POST /update on .*RemoteProtocolError"):
            http.request("POST", "/update", json={})
    assert srv.requests == ["POST /update HTTP/1.1"] and http.retries == 0


def test_a_silent_server_is_a_timeout_naming_the_call_and_is_not_retried(raw):
    srv = raw(silent=True)
    with HttpTransport(srv.url, timeout=10) as http:
        with pytest.raises(UpdateTimeoutError, match=r"GET /health on .*no answer within 0.5 s"):
            http.request("GET", "/health", timeout=0.5)
    assert srv.requests == ["GET /health HTTP/1.1"]


def test_an_error_answer_becomes_a_remote_worker_error_with_the_server_text(raw):
    srv = raw(status=500)
    with HttpTransport(srv.url) as http:
        resp = http.request("POST", "/x")
        with pytest.raises(RemoteWorkerError, match="POST /x on .* answered HTTP 500: boom"):
            http.raise_for_status(resp)


def test_unix_socket_and_use_after_close(tmp_path):
    path = str(tmp_path / "s.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    http = HttpTransport(uds=path)
    assert http.request("GET", "/health").status_code == 200 and "unix socket" in http.where
    http.close()
    http.close()
    with pytest.raises(ClosedError):
        http.request("GET", "/health")
    srv.close()


def test_phases_add_up_per_name_and_count_a_failing_phase():
    phases = Phases()
    phases.run("a", lambda: None)
    with pytest.raises(ZeroDivisionError):
        phases.run("b", lambda: 1 / 0)
    assert list(phases.seconds) == ["a", "b"] and all(v >= 0 for v in phases.seconds.values())


def test_the_service_client_sends_a_request_again_when_the_service_closed_its_pooled_connection(raw):
    # one rank of a ServiceWorld: its second call goes out on the kept connection, which the server closes (as
    # a service whose keep-alive ended); the call is sent again on a fresh one instead of failing that rank
    # while the others wait in the update's collective
    from ckpt_core.client import ServiceWorld
    srv = raw(answers_per_connection=1)
    with ServiceWorld([srv.url], token="t0k", timeout=10, margin_s=1) as world:
        assert world.call("POST", "/v1/a", [{}]) == [None]
        assert world.call("POST", "/v1/b", [{}]) == [None]
    assert srv.requests == ["POST /v1/a HTTP/1.1", "POST /v1/b HTTP/1.1", "POST /v1/b HTTP/1.1"]
    assert srv.connections == 2
    silent = raw(silent=True)
    with ServiceWorld([silent.url], timeout=0.5, margin_s=0) as world:
        with pytest.raises(UpdateTimeoutError, match=r"rank 0 \(http://127.*\) did not answer GET /v1/healthz within 0 s"):
            world.call("GET", "/v1/healthz")
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with ServiceWorld([url], timeout=5, margin_s=0) as world:
        with pytest.raises(TransportError, match=r"rank 0 \(http://127.*\) unreachable on GET /v1/healthz: .*Connect"):
            world.call("GET", "/v1/healthz")
