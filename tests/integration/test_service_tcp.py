"""The service on TCP: only with a bearer token, and then every request must carry it."""

import os
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi")
from support.ports import free_port  # noqa: E402
from support.service_world import ROOT, serve_healthy, stop  # noqa: E402

TOKEN = "s3cret-token-for-tests"


def _single_rank_env(**extra) -> dict:
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), **extra}


def _client_with_token(port) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)


def test_tcp_without_a_token_refuses_to_start_with_a_config_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_SERVICE_TOKEN="", **_single_rank_env())
    proc = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr
    assert "ConfigError" in proc.stderr and "requires a bearer token" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("source", ["env", "file"])
def test_every_tcp_request_needs_the_right_bearer_token(tmp_path, source):
    extra: list[str] = []
    env = _single_rank_env()
    if source == "env":
        env["CKPT_SERVICE_TOKEN"] = TOKEN
    else:
        (tmp_path / "token").write_text(TOKEN + "\n")
        extra = ["--token-file", str(tmp_path / "token")]
    log = str(tmp_path / "serve.log")
    proc, port = serve_healthy(lambda port: ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *extra],
                               env, log, _client_with_token)
    right = _client_with_token(port)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as anon:
            for path in ("/v1/healthz", "/v1/status", "/openapi.json", "/metrics"):
                none = anon.get(path)
                wrong = anon.get(path, headers={"Authorization": f"Bearer {TOKEN}x"})
                prefix = anon.get(path, headers={"Authorization": f"Bearer {TOKEN[:-1]}"})
                for resp in (none, wrong, prefix):
                    assert resp.status_code == 401, (path, resp.status_code)
                    assert resp.json()["error"]["type"] == "Unauthorized"
                    assert resp.headers["www-authenticate"] == "Bearer"
            denied = anon.post("/v1/checkpoints/x/files", json={"files": ["/etc/passwd"]})
            assert denied.status_code == 401
        assert right.get("/v1/status").json()["checkpoints"] == [], "the refused request registered nothing"
        assert right.get("/v1/healthz").status_code == 200
    finally:
        right.close()
        assert stop(proc) == 0, open(log).read()[-3000:]


@pytest.mark.parametrize("token", ["x", "short-token-15c", " padded-token-of-20 "])
def test_a_token_shorter_than_16_characters_is_refused_at_start(tmp_path, token):
    env = dict(os.environ, PYTHONPATH=ROOT, CKPT_SERVICE_TOKEN=token, **_single_rank_env())
    proc = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120)
    if token.strip() != token:   # the env value is taken as given: surrounding spaces are a mistake
        assert proc.returncode == 4 and "surrounding spaces" in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert "at least 16 characters" in proc.stderr and "Traceback" not in proc.stderr
    assert len(token) < 3 or token not in proc.stderr, "the refused token is not echoed"


def test_the_bearer_scheme_is_case_insensitive_and_the_token_is_not(tmp_path):
    log = str(tmp_path / "serve.log")
    proc, port = serve_healthy(lambda port: ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port)],
                               _single_rank_env(CKPT_SERVICE_TOKEN=TOKEN), log, _client_with_token)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    try:
        for header in (f"bearer {TOKEN}", f"BEARER {TOKEN}", f"BeArEr  {TOKEN}"):
            assert client.get("/v1/status", headers={"Authorization": header}).status_code == 200, header
        for header in (f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}", f"Bearer{TOKEN}", TOKEN):
            assert client.get("/v1/status", headers={"Authorization": header}).status_code == 401, header
    finally:
        client.close()
        assert stop(proc) == 0, open(log).read()[-3000:]


def test_every_refusal_of_the_token_policy_and_validation_is_logged_and_counted(tmp_path):
    """401 (token), 403 (a file outside --allow-dir), 422 (a malformed body) refuse before any long
    operation runs: each is a WARNING line naming the route, status, type and message, and is counted
    in ckpt_requests_refused_total{status, error}."""
    log = str(tmp_path / "serve.log")
    proc, port = serve_healthy(
        lambda port: ["--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--allow-dir", str(tmp_path)],
        _single_rank_env(CKPT_SERVICE_TOKEN=TOKEN), log, _client_with_token)
    right = _client_with_token(port)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=60).status_code == 401
        assert right.post("/v1/checkpoints/x/files", json={"files": ["/etc/passwd"]}).status_code == 403
        assert right.post("/v1/checkpoints/x/files", json={"files": "not a list"}).status_code == 422
        metrics = right.get("/metrics").text
        for status, error in (("401", "Unauthorized"), ("403", "Forbidden"), ("422", "ValidationError")):
            line = f'ckpt_requests_refused_total{{error="{error}",rank="0",status="{status}"}} 1.0'
            assert line in metrics, (line, [m for m in metrics.splitlines() if "refused" in m])
    finally:
        right.close()
        assert stop(proc) == 0, open(log).read()[-3000:]
    text = open(log).read()
    assert "refused GET /v1/status status=401 error=Unauthorized: missing or wrong bearer token" in text, text[-3000:]
    assert "refused POST /v1/checkpoints/x/files status=403 error=Forbidden: file '/etc/passwd'" in text, text[-3000:]
    assert "refused POST /v1/checkpoints/x/files status=422 error=ValidationError: invalid request" in text
    assert text.count("status=403") == 1, "each refusal is logged once"


def test_a_token_given_also_guards_the_unix_socket(tmp_path):
    """docs/operations.md: a token (CKPT_SERVICE_TOKEN or --token-file) guards every route on the Unix
    socket too, not only on TCP; the socket stays 0600 as well."""
    sock = str(tmp_path / "ps.sock")
    log = str(tmp_path / "serve.log")

    def client_of(_port):
        return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://ps",
                            headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)

    proc, _ = serve_healthy(lambda _port: ["--device", "cpu", "--uds", sock],
                            _single_rank_env(CKPT_SERVICE_TOKEN=TOKEN), log, client_of)
    right = client_of(None)
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://ps", timeout=60) as anon:
            for path in ("/v1/healthz", "/v1/status", "/v1/metas"):
                resp = anon.get(path)
                assert resp.status_code == 401 and resp.json()["error"]["type"] == "Unauthorized", (path, resp.text)
            assert anon.post("/v1/checkpoints/x/files", json={"files": ["/etc/passwd"]}).status_code == 401
        assert right.get("/v1/status").status_code == 200
        assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    finally:
        right.close()
        assert stop(proc) == 0, open(log).read()[-3000:]
    assert "bearer token required" in open(log).read(), "the start line says the socket needs the token"
