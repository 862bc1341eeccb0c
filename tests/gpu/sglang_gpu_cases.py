"""The models, servers and references of tests/gpu/test_sglang_gpu.py (a real SGLang on a GPU).

A case is a tiny model (random weights, built here) with two checkpoints A and B, each a directory
``ckpt-{0,1}`` holding ``config.json`` and ``model.safetensors``. Per case:

- ``dummy``: a server started with dummy weights and ``--checkpoint-engine-wait-weights-before-ready``
  (so its first update is the launcher's); every update path is checked on it;
- ``cold``: one true cold start on A (``--load-format auto``), started in the background once the
  dummy server is up (one start at a time, so no server sizes its KV cache while another takes
  memory), and used last: its digests must equal the reference of A, its greedy tokens A's tokens;
- the references: A and B loaded into the dummy server by SGLang's own file loader
  (``/update_weights_from_disk``: load and post-process, as a cold start does), then the digests of
  every parameter and buffer read in the scheduler (``ckpt_sglang.probe``) and greedy tokens. The
  cold start validates that reference for A on the same model.

The model builders are tests/gpu/test_vllm_gpu.py's (``build_case``: fp8 block 128x128 with
``weight_scale_inv``, fp8 per tensor, Qwen3-MoE experts one tensor each). Results of each case go
to ``$CKPT_BENCH_OUT/sglang-gpu-<case>.json`` when that is set (scripts/gpu_check.sh sets it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from _sglang_server import SglangServer, differences, recipe_env, say  # noqa: E402

MAX_NEW = 12
MOE_FLAGS = ["--moe-runner-backend", "triton"]   # SGLang's Triton fused MoE (no FlashInfer JIT, no repacking)


def ckpt_dir(root: Path, model_dir: Path, weights: Path) -> Path:
    """``root`` with the model's config and ``weights`` as its one ``model.safetensors`` (a hard link)."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_dir / "config.json", root / "config.json")
    os.link(weights, root / "model.safetensors")
    return root


class Case:
    """One model's checkpoints, servers and references (see the module docstring)."""

    def __init__(self, name: str, root: Path):
        from test_vllm_gpu import build_case   # the vLLM GPU test's builders: same models on both engines

        self.name, self.root = name, root
        self.seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(1, 2**31 - 4))
        say(f"{name}: building the model and checkpoints A, B (seed {self.seed}; CKPT_TEST_SEED reproduces)")
        self.model_dir, weights, _ = build_case(name, root / "model", self.seed)
        self.ckpts = [ckpt_dir(root / f"ckpt-{i}", self.model_dir, w) for i, w in enumerate(weights)]
        self.extra = MOE_FLAGS if name.startswith("qwen3_moe") else []
        rng = random.Random(self.seed)
        self.prompts = [[rng.randrange(2, 380) for _ in range(n)] for n in (5, 17, 120)]
        self.dummy: SglangServer | None = None
        self.cold: SglangServer | None = None
        self.refs: dict[int, dict] = {}     # checkpoint index -> {"digests", "tokens"}
        self.record: dict = {"case": name, "seed": self.seed, "steps": []}

    def files(self, index: int) -> list[str]:
        return [str(self.ckpts[index] / "model.safetensors")]

    def start_dummy(self) -> SglangServer:
        self.dummy = SglangServer(self.model_dir, self.root / "dummy.log", load_format="dummy",
                                  extra=[*self.extra, "--checkpoint-engine-wait-weights-before-ready"],
                                  name=f"{self.name} dummy")
        self.record["dummy_start_s"] = self.dummy.wait_up()
        return self.dummy

    def start_cold(self, index: int = 0) -> SglangServer:
        """A true cold start on checkpoint ``index`` (waited for by :meth:`wait_cold`)."""
        self.cold = SglangServer(self.ckpts[index], self.root / "cold.log", load_format="auto", extra=self.extra,
                                 name=f"{self.name} cold")
        return self.cold

    def wait_cold(self) -> SglangServer:
        self.record["cold_start_s"] = self.cold.wait_up()
        return self.cold

    def take_references(self) -> None:
        """A and B through SGLang's own file loader into the dummy server; B first, so A is live after."""
        for index in (1, 0):
            took = self.dummy.load_from_disk(self.ckpts[index])
            self.refs[index] = {"digests": self.dummy.digests(), "tokens": self.dummy.generate(self.prompts, MAX_NEW)}
            say(f"{self.name}: reference {'AB'[index]} from SGLang's file loader ({took:.2f} s): "
                f"{len(self.refs[index]['digests'])} tensors")
        assert differences(self.refs[0]["digests"], self.refs[1]["digests"]), "A and B must differ"

    def check(self, server: SglangServer, index: int, step: str, *, tokens: bool = True) -> None:
        """``server`` holds checkpoint ``index`` byte for byte (every parameter and buffer), and its
        greedy tokens equal the reference's."""
        differ = differences(server.digests(), self.refs[index]["digests"])
        assert not differ, (f"{self.name} {step}: {len(differ)} tensors differ from a cold load of "
                            f"{'AB'[index]}:\n" + "\n".join(differ[:20]))
        if tokens:
            got = server.generate(self.prompts, MAX_NEW)
            assert got == self.refs[index]["tokens"], f"{self.name} {step}: greedy tokens differ from a cold load"
        self.record["steps"].append({"step": step, "holds": "AB"[index], "tensors": len(self.refs[index]["digests"])})
        say(f"{self.name} {step}: equal to a cold load of {'AB'[index]} "
            f"({len(self.refs[index]['digests'])} tensors{', tokens' if tokens else ''})")

    def save(self) -> None:
        out = os.environ.get("CKPT_BENCH_OUT")
        if out:
            with open(os.path.join(out, f"sglang-gpu-{self.name}.json"), "w") as f:
                json.dump(self.record, f, indent=1, default=str)

    def close(self) -> None:
        for server in (self.dummy, self.cold):
            if server is not None:
                server.close()
        self.save()


def launcher(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m ckpt_sglang.update ARGS`` as a user runs it (it re-executes under torchrun)."""
    run_env = {k: v for k, v in recipe_env(env).items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "ckpt_sglang.update", *args], capture_output=True, text=True,
                          timeout=timeout, env=run_env, cwd=str(REPO))


def start_launcher(*args: str, out: Path, env: dict | None = None) -> subprocess.Popen:
    run_env = {k: v for k, v in recipe_env(env).items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    with open(out, "w") as stdout, open(f"{out}.err", "w") as stderr:
        return subprocess.Popen([sys.executable, "-m", "ckpt_sglang.update", *args], stdout=stdout, stderr=stderr,
                                env=run_env, cwd=str(REPO), start_new_session=True)


def figures(proc: subprocess.CompletedProcess) -> list[dict]:
    """The launcher's JSON lines; fails with its output when it did not succeed."""
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, f"launcher exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return lines


def new_ps(**kwargs):
    """A one-rank CUDA parameter server speaking the stock wire (SGLang embeds the stock worker)."""
    from _sglang_server import free_port
    from ckpt_core import ParameterServer

    return ParameterServer(rank=0, world_size=1, device="cuda", wire="stock", master_addr="127.0.0.1",
                           master_port=free_port(), **kwargs)
