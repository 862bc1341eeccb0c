"""The SGLang CPU engine process and tiny Qwen2 checkpoints for tests/integration/test_sglang*.py.

The engine (``engine.py``) runs under ``CKPT_SGLANG_PYTHON`` (the venv of
``scripts/sglang_env.sh``); the tests, our launcher and the parameter server run in the project
venv. Without ``CKPT_SGLANG_PYTHON`` every SGLang test is skipped, with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch

from ckpt_core.checkpoint.safetensors import write_file
from support.data import digest
from support.ports import LAUNCHES, free_port, lost_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "float32",
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}


def sglang_python() -> str:
    python = os.environ.get("CKPT_SGLANG_PYTHON")
    if not python or not os.path.exists(python):
        pytest.skip("SGLang venv not available: run scripts/sglang_env.sh and export CKPT_SGLANG_PYTHON "
                    "(scripts/test.sh does)")
    return python


def hf_weights(seed: int) -> dict[str, torch.Tensor]:
    """A Hugging Face Qwen2 state dict (separate q/k/v and gate/up) with fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    c = CONFIG
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd

    def t(*shape):
        x = torch.randn(shape, generator=gen)
        x[x == 0] = 1.0
        return x

    out = {"model.embed_tokens.weight": t(v, h), "model.norm.weight": t(h), "lm_head.weight": t(v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": t(h, h), p + "self_attn.q_proj.bias": t(h),
                    p + "self_attn.k_proj.weight": t(kv, h), p + "self_attn.k_proj.bias": t(kv),
                    p + "self_attn.v_proj.weight": t(kv, h), p + "self_attn.v_proj.bias": t(kv),
                    p + "self_attn.o_proj.weight": t(h, h), p + "mlp.gate_proj.weight": t(inter, h),
                    p + "mlp.up_proj.weight": t(inter, h), p + "mlp.down_proj.weight": t(h, inter),
                    p + "input_layernorm.weight": t(h), p + "post_attention_layernorm.weight": t(h)})
    return out


def sglang_digests(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """What SGLang's parameters must hold after loading ``weights``: q/k/v and gate/up fused."""
    out, fused = {}, {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, tensor in weights.items():
        module = name.split(".")[-2]
        if module in fused:
            target = name.replace(module, fused[module])
            out[target] = digest(torch.cat([weights[name.replace(module, m)] for m in parts[fused[module]]]))
        elif not any(module in ms for ms in parts.values()):
            out[name] = digest(tensor)
    return out


def write_checkpoint(root: Path, seed: int, shards: int = 2) -> tuple[Path, dict[str, str]]:
    """An HF checkpoint directory (config, ``shards`` safetensors files); returns it and the digests
    SGLang's parameters must show after loading it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    weights = hf_weights(seed)
    names = sorted(weights)
    for s in range(shards):
        write_file(root / f"model-{s:05d}.safetensors", {n: weights[n] for n in names[s::shards]})
    return root, sglang_digests(weights)


class SglangEngine:
    """The engine process (``engine.py``; one per TP rank with ``tp_size``) and an HTTP client of its
    test routes. Rank r > 0 logs to ``log`` with ``.rank<r>`` appended. ``extra``: arguments of
    ``engine.py`` given to every rank (``--without-sessions``)."""

    def __init__(self, python: str, model_dir: Path, log: Path, tp_size: int = 1, extra: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        paths = (REPO, REPO / "tests", REPO / "tests" / "integration")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in paths))
        self.log = log
        self._outs = [open(log if r == 0 else f"{log}.rank{r}", "w") for r in range(tp_size)]
        self._out = self._outs[0]
        self.procs = [subprocess.Popen([python, "-m", "sglang_support.engine", "--model-dir", str(model_dir),
                                        "--port", str(self.port), "--tp-size", str(tp_size), "--tp-rank", str(r),
                                        *extra],
                                       stdout=out, stderr=subprocess.STDOUT, env=env)
                      for r, out in enumerate(self._outs)]
        self.proc = self.procs[0]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def rank_params(self) -> list[dict[str, str]]:
        """Every TP rank's parameter digests, in rank order."""
        return self.state()["ranks"]

    def cold_params(self, model_dir: Path) -> list[dict[str, str]]:
        """Every TP rank's parameter digests after a cold load of ``model_dir`` into a fresh model."""
        resp = httpx.get(f"{self.url}/ckpt_test/cold_digests", params={"model_dir": str(model_dir)}, timeout=120)
        resp.raise_for_status()
        return resp.json()["ranks"]

    def state(self) -> dict:
        return httpx.get(f"{self.url}/ckpt_test/digests", timeout=30).json()

    def set_busy(self, n: int) -> None:
        httpx.post(f"{self.url}/ckpt_test/busy", params={"n": n}, timeout=30).raise_for_status()

    def tail(self, n: int = 3000) -> str:
        self._out.flush()
        return self.log.read_text()[-n:]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for out in self._outs:
            out.close()


@contextmanager
def ready_engine(root: Path, seed: int = 100, tp_size: int = 1, extra: tuple[str, ...] = ()):
    """An engine on a fresh model directory under ``root`` (weights of ``seed``), ready to update;
    ``extra``: arguments of ``engine.py`` (``--without-sessions``)."""
    from ckpt_sglang import SglangClient
    python = sglang_python()
    model_dir, _ = write_checkpoint(root / "model", seed=seed)
    for launch in range(1, LAUNCHES + 1):
        eng = SglangEngine(python, model_dir, root / "engine.log", tp_size, extra)
        try:
            with SglangClient(eng.url) as client:
                client.wait_ready(timeout=240, alive=eng.alive)
            break
        except Exception:
            lost = lost_port(eng.tail())
            eng.close()
            if not lost or launch == LAUNCHES:   # another process was handed its port first: relaunch
                raise
    try:
        yield eng
    finally:
        eng.close()


def _launcher(args, env: dict | None):
    env = {k: v for k, v in dict(os.environ, **(env or {})).items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    return [sys.executable, "-m", "ckpt_sglang.update", *args], env


def run_launcher(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m ckpt_sglang.update ARGS`` as a user runs it (RANK unset: it re-executes under torchrun)."""
    cmd, env = _launcher(args, env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=str(REPO))


def start_launcher(*args: str, out: Path, env: dict | None = None) -> subprocess.Popen:
    """The same, in the background; stdout and stderr go to ``out`` and ``out``.err."""
    cmd, env = _launcher(args, env)
    with open(out, "w") as stdout, open(f"{out}.err", "w") as stderr:   # the child keeps its own copies
        return subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=str(REPO))


def wait_for(fn, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not fn():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.2)
