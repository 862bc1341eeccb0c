"""Real `ckpt-engine serve` processes (one per rank, env as torchrun sets it) and an HTTP engine front.

``ServiceWorld`` starts the console script's code (``python -m ckpt_core.cli serve``) in W
processes forming one CPU (gloo) world, each on its own Unix socket, and hands out httpx
clients bound to those sockets. ``HttpEngineFront`` puts the simulated engine workers
(``support.engine``) behind a real HTTP ``/collective_rpc`` route, so the service's ``update_url``
path is exercised as with vLLM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

import support.ports as ports
from support.engine import EngineFront, make_req_func
from support.ports import on_a_free_port, store_lost_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the project


def start_serve(args: list[str], env: dict, log_path: str) -> subprocess.Popen:
    """``python -m ckpt_core.cli serve ARGS`` with ``env`` added; stderr/stdout into ``log_path``."""
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, "-m", "ckpt_core.cli", "serve", *args], env=full, stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)


def serve_healthy(args_of, env: dict, log_path: str, client_of, timeout: float = 120) -> tuple[subprocess.Popen, int]:
    """One rank's ``serve`` started (``start_serve``) and healthy: ``args_of(port)`` its arguments with an HTTP
    port of ``free_port()``'s (or none: a Unix socket), ``env`` its environment, ``MASTER_PORT`` another of
    ``free_port()``'s; ``client_of(port)`` the client its health is asked through (closed here). Started again
    on fresh ports, ``LAUNCHES`` times in all, only when it exited before it was healthy with its log saying
    another process held its store's port or its HTTP port (so nothing of the test ran yet). Returns the
    process and its HTTP port."""
    for n in range(1, ports.LAUNCHES + 1):
        port, store = ports.free_port(), ports.free_port()
        proc = start_serve(args_of(port), {**env, "MASTER_PORT": str(store)}, log_path)
        client = client_of(port)
        try:
            wait_healthy(client, proc, log_path, timeout)
            return proc, port
        except RuntimeError:   # it exited: the port question is asked of its log only then
            text = _tail(log_path)
            # serve's own words: "ckpt-engine serve: ConfigError: cannot listen on 127.0.0.1:PORT: [Errno 98] Address
            # already in use"
            http_lost = re.search(rf"cannot listen on \S+:{port}: .*address already in use", text, re.I) is not None
            if n == ports.LAUNCHES or not (store_lost_port(text, store) or http_lost):
                raise
            which = f"its HTTP port {port}" if http_lost else f"its store port {store}"
            print(f"serve could not bind {which} (another process took it after free_port() picked it): "
                  f"launch {n + 1} of {ports.LAUNCHES}, on fresh ports", file=sys.stderr)
        finally:
            client.close()
    raise AssertionError("unreachable: the last launch returns or raises")


def wait_healthy(client: httpx.Client, proc: subprocess.Popen | None, log_path: str, timeout: float = 120) -> None:
    """Poll ``/v1/healthz`` until 200; fail with the process's log if it exits or never answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{_tail(log_path)}")
        try:   # a short wait per poll: a listener that never answers (a port another process holds) is
            # asked again, and the serve's exit seen, instead of waiting out the client's own timeout
            if client.get("/v1/healthz", timeout=min(5.0, max(0.1, deadline - time.monotonic()))).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"serve did not become healthy within {timeout} s:\n{_tail(log_path)}")


def _tail(log_path: str) -> str:
    """The end of a serve log (a managed PS that never started has none)."""
    try:
        with open(log_path, errors="replace") as f:
            return f.read()[-4000:]
    except OSError as exc:
        return f"(no log at {log_path}: {exc})"


def stop(proc: subprocess.Popen, timeout: float = 20) -> int:
    """SIGTERM (uvicorn's graceful stop), then SIGKILL after ``timeout``; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def metrics_world(tmp: str, size: int = 2, **kw) -> "ServiceWorld":
    """A ``ServiceWorld`` whose ranks serve ``/metrics`` on ``--metrics-port`` P (rank r on P + r, as ``serve``
    does), P of ``free_port()``'s (``world.metrics_port``); started again on another, ``LAUNCHES`` times in all,
    only when a rank could not listen there because another process held the port (nothing ran yet; ``serve``
    says "ConfigError: cannot serve metrics on 127.0.0.1:P: [Errno 98] Address already in use")."""
    def launch(port: int) -> ServiceWorld:
        world = ServiceWorld(size, tmp, extra=["--metrics-port", str(port)], **kw)
        world.metrics_port = port
        return world

    def lost(outcome, port: int) -> bool:
        return isinstance(outcome, RuntimeError) and any(
            re.search(rf"cannot serve metrics on \S+:{port + r}: .*address already in use", str(outcome), re.I)
            for r in range(size))

    return on_a_free_port(launch, lost, "a service world's metrics port")


class ServiceWorld:
    """W service processes on Unix sockets under ``tmp``; ``clients[r]`` talks to rank r."""

    def __init__(self, size: int, tmp: str, *, extra: list[str] = (), env: dict | None = None, device: str = "cpu",
                 allow_dirs: tuple[str, ...] | None = None, rank_env: dict[int, dict] | None = None):
        """``allow_dirs``: the ``--allow-dir`` of every rank (default: ``tmp``, where the tests write files).
        ``env``: added to every rank's environment; ``rank_env``: to some ranks' only (rank -> variables).
        A world whose rank 0 could not serve the store on the port free_port() gave (another process took
        it first) is started again on another, LAUNCHES times in all: no test has seen it yet."""
        self.size, self.tmp = size, tmp
        allow = [a for d in (allow_dirs if allow_dirs is not None else (tmp,)) for a in ("--allow-dir", d)]
        self.socks = [os.path.join(tmp, f"ps-{r}.sock") for r in range(size)]
        self.logs = [os.path.join(tmp, f"ps-{r}.log") for r in range(size)]

        def launch(port: int) -> None:
            self.procs = [start_serve(["--device", device, "--uds", os.path.join(tmp, "ps-{rank}.sock"), *allow,
                                       *extra],
                                      {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(size),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(env or {}),
                                       **(rank_env or {}).get(r, {})},
                                      self.logs[r]) for r in range(size)]
            self.clients = [httpx.Client(transport=httpx.HTTPTransport(uds=s), base_url="http://ps", timeout=120)
                            for s in self.socks]
            try:
                self._wait_healthy(time.monotonic() + 120)
            except Exception:
                self.close()
                raise

        on_a_free_port(launch, lambda failed, port: isinstance(failed, Exception) and
                       store_lost_port(_tail(self.logs[0]), port), "a service world's rank 0 (its store)")

    def _wait_healthy(self, deadline: float) -> None:
        for r in range(self.size):
            while not os.path.exists(self.socks[r]) and self.procs[r].poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            wait_healthy(self.clients[r], self.procs[r], self.logs[r], max(1.0, deadline - time.monotonic()))

    def all(self, method: str, path: str, bodies=None, **kw) -> list[httpx.Response]:
        """The same call on every rank at once (collectives need every rank); responses in rank order."""
        with ThreadPoolExecutor(self.size) as pool:
            futs = [pool.submit(self.clients[r].request, method, path,
                                **(dict(kw, json=bodies[r]) if bodies is not None else kw)) for r in range(self.size)]
            return [f.result() for f in futs]

    def close(self) -> list[int]:
        for c in self.clients:
            c.close()
        return [stop(p) for p in self.procs]


class HttpEngineFront:
    """The simulated engine workers (``support.engine.EngineFront``) behind ``POST /collective_rpc``
    and ``/reset_prefix_cache`` (a real HTTP server, answering like vLLM's), and ``GET /health``.
    ``reset_route=False``: an engine without ``/reset_prefix_cache`` (404, as FastAPI answers a
    route it does not have). ``paths``: every request's method and path, in order."""

    def __init__(self, world: int, kind: str = "cpu", *, reset_route: bool = True):
        self.engine = EngineFront(kind, world)
        self.requests = 0
        self.paths: list[str] = []
        front = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                front.paths.append(f"GET {self.path}")
                self._answer(200 if self.path == "/health" else 404, b"{}")

            def do_POST(self):
                front.paths.append(f"POST {self.path}")
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path.startswith("/reset_prefix_cache"):   # asked after every update, like vLLM's
                    return self._answer(200, b"{}") if reset_route else self._answer(404, b'{"detail":"Not Found"}')
                front.requests += 1
                try:
                    make_req_func(front.engine.address)(list(body["args"][0].items()))
                    code, out = 200, json.dumps({"results": [None] * world}).encode()
                except Exception as exc:
                    code, out = 500, str(exc).encode()
                self._answer(code, out)

            def _answer(self, code: int, out: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/collective_rpc"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.engine.close()
