"""A real SGLang server on one GPU, started as ../shared/gpu_sglang/README.md's recipe runs it.

Shared by ``tests/gpu/test_sglang_gpu.py`` and ``benchmarks/sglang_bench.py``. The server is
``python -m sglang.launch_server`` in its own process group (SGLang spawns its scheduler and
detokenizer), with the recipe's flags (FA3 attention, PyTorch sampling, no CUDA graphs, no
warmup, no tokenizer: requests send token ids) and both of our loaders
(``--custom-weight-loader ckpt_sglang.staging.load ckpt_sglang.probe.load``): staged updates, and
digests of every parameter and buffer read in the scheduler process. Every wait is bounded and
says what it waited for; progress lines go to stdout with the seconds since the module loaded.

    server = SglangServer(model_dir, log_dir / "dummy.log", load_format="dummy")
    server.wait_up(300)
    server.load_from_disk(ckpt_dir)          # SGLang's own file loader into the live model
    digests = server.digests()               # {name: [dtype, shape, sha256]}
    tokens = server.generate([[5, 6, 7]], 12)
    server.close()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

T0 = time.monotonic()
STAGING = "ckpt_sglang.staging.load"
PROBE = "ckpt_sglang.probe.load"
# The recipe's environment (README "Run time on the air-gapped H200"); the caller's values win.
RECIPE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0",
              "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1", "SGLANG_USE_SGL_FA3_KERNEL": "1",
              "SGLANG_ENABLE_JIT_DEEPGEMM": "0", "TVM_FFI_CACHE_DIR": "/tmp/tvm-ffi",
              "FLASHINFER_WORKSPACE_BASE": "/tmp/fi", "SGLANG_WAIT_WEIGHTS_READY_TIMEOUT": "600",
              "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
# --max-total-tokens keeps each server's KV cache small, so several servers share the GPU and one
# starting beside another does not size its cache from memory the other is about to take.
BASE_FLAGS = ["--attention-backend", "fa3", "--sampling-backend", "pytorch", "--disable-cuda-graph",
              "--skip-server-warmup", "--context-length", "256", "--max-total-tokens", "16384",
              "--grammar-backend", "none", "--skip-tokenizer-init", "--dtype", "bfloat16",
              "--custom-weight-loader", STAGING, PROBE]


def say(msg: str) -> None:
    print(f"[sglang-gpu +{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_env(extra: dict | None = None) -> dict:
    env = {**RECIPE_ENV, **os.environ, **(extra or {})}
    repo = str(Path(__file__).resolve().parents[1])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if repo not in parts:   # the server imports our loaders; a site folder given first stays first
        parts.append(repo)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


class SglangServer:
    """One ``sglang.launch_server`` process group and an HTTP client of the routes used."""

    def __init__(self, model_dir: Path, log: Path, *, load_format: str = "dummy", extra: list[str] = (),
                 mem_fraction: float = 0.2, env: dict | None = None, name: str = "server"):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--load-format",
               load_format, "--host", "127.0.0.1", "--port", str(self.port), "--mem-fraction-static",
               str(mem_fraction), *BASE_FLAGS, *extra]
        self._out = open(self.log, "w")
        self._out.write(" ".join(cmd) + "\n")
        self._out.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=recipe_env(env),
                                     start_new_session=True)
        self.started = time.monotonic()
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=10.0))
        say(f"{name}: starting on port {self.port} ({load_format} weights, {model_dir}); log {self.log}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 4000) -> str:
        self._out.flush()
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _fail(self, what: str) -> None:
        raise RuntimeError(f"{self.name} ({self.url}): {what}\n--- last lines of {self.log} ---\n{self.tail()}")

    def wait_up(self, timeout: float = 600.0) -> float:
        """Until ``GET /model_info`` answers (also while the server waits for its first weights)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                self._fail(f"exited with {self.proc.returncode} while starting")
            try:
                if self.http.get("/model_info", timeout=5.0).status_code == 200:
                    took = time.monotonic() - self.started
                    say(f"{self.name}: up after {took:.1f} s")
                    return took
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._fail(f"GET /model_info did not answer within {timeout:g} s")

    def health(self) -> int:
        try:
            return self.http.get("/health", timeout=10.0).status_code
        except httpx.HTTPError:
            return 0

    def wait_healthy(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()
        while self.health() != 200:
            if time.monotonic() - t0 > timeout:
                self._fail(f"GET /health did not answer 200 within {timeout:g} s (last {self.health()})")
            time.sleep(0.2)
        return time.monotonic() - t0

    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        resp = self.http.post(path, json=body, timeout=timeout)
        if resp.status_code != 200:
            self._fail(f"POST {path} answered {resp.status_code}: {resp.text[:2000]}")
        return resp.json() if resp.content else {}

    def generate(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Greedy continuations, one request per prompt (no batching across prompts)."""
        out = []
        for prompt in prompts:
            got = self._post("/generate", {"input_ids": list(prompt), "sampling_params": {
                "temperature": 0.0, "max_new_tokens": int(max_new), "ignore_eos": True}}, timeout=300)
            out.append(list(got["output_ids"]))
        return out

    def load_from_disk(self, ckpt_dir: Path, timeout: float = 600.0) -> float:
        """SGLang's own file loader (``/update_weights_from_disk``: load and post-process) into the
        live model: the cold-load reference, read in the same server."""
        t0 = time.monotonic()
        got = self._post("/update_weights_from_disk", {"model_path": str(ckpt_dir), "load_format": "auto",
                                                        "flush_cache": True}, timeout=timeout)
        if not got.get("success"):
            self._fail(f"/update_weights_from_disk {ckpt_dir} failed: {got}")
        return time.monotonic() - t0

    def reset_tensors(self) -> None:
        """SGLang's weight checker overwrites every weight with random values (not its rotary caches)."""
        self._post("/weights_checker", {"action": "reset_tensors"})

    def digests(self, mode: str = "sha256") -> dict:
        """``{name: [dtype, shape, digest]}`` of every parameter and buffer (TP rank 0), read by
        ``ckpt_sglang.probe`` in the scheduler process."""
        from ckpt_sglang import SglangClient

        with SglangClient(self.url, timeout=600) as client:
            return client.state_digests(mode)[0]["digests"]

    def close(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.http.close()
        self._out.close()
        say(f"{self.name}: closed")


def differences(got: dict, want: dict) -> list[str]:
    """Names whose digests differ (or that only one side has), with both digests shortened."""
    out = []
    for name in sorted(set(got) | set(want)):
        if got.get(name) != want.get(name):
            g, w = got.get(name), want.get(name)
            out.append(f"{name}: {g[:2] + [str(g[2])[:12]] if g else 'absent'} vs {w[:2] + [str(w[2])[:12]] if w else 'absent'}")
    return out
