"""A real vLLM-CPU server with our worker extension: updates arrive exactly, failures are named.

Needs CKPT_VLLM_PYTHON (scripts/test.sh sets it via scripts/vllm_env.sh); skipped otherwise.
One server (dummy weights, TCP, with the ``ckpt`` backend too) serves every test of this module,
in order; test_vllm_traffic.py uses the same one afterwards (``shared_servers``).
"""

import pytest

from ckpt_core import request_inference_to_update
from ckpt_core.errors import RemoteWorkerError
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, push, shared_servers, tiny_model,  # noqa: F401
                                   vllm_python)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


def completions(server, model):
    return server.complete(model.prompts, MAX_TOKENS)


def test_after_an_update_greedy_completions_equal_the_hf_reference_token_for_token(server, tiny_model):
    if server.pushed:   # a shared server: start from the other weights, so the update must change the output
        push(server, [tiny_model.weights[1]], path="extension")
    before = completions(server, tiny_model)
    result = push(server, [tiny_model.weights[0]], path="extension")
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[0])
    assert before != tiny_model.reference(tiny_model.weights[0])
    report = server.client.last_report
    worker = report.workers[0]
    assert worker["bytes"] == result["bytes"] == tiny_model.weights[0].stat().st_size - _header(tiny_model.weights[0])
    assert worker["tensors"] == 27 and not worker["drafter"]
    print(f"update: PS {result['seconds']}, requester {report.seconds}, worker {worker['seconds']}, "
          f"{result['bytes']} bytes")


def test_a_second_update_with_different_weights_switches_to_the_new_reference(server, tiny_model):
    push(server, [tiny_model.weights[0]], path="extension")
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[0])
    # The 200-token prompt's KV blocks are now cached; they must not survive the update.
    push(server, [tiny_model.weights[1]], path="extension")
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[1])


def test_layers_split_across_many_small_buckets_still_arrive_exactly(server, tiny_model):
    result = push(server, [tiny_model.weights[0]], path="extension", max_bucket_gb=200e3 / 2**30)  # lm_head (196 kB) just fits
    assert result["buckets"] >= 6
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[0])


QKV_BIASES = tuple(f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv")


@pytest.mark.parametrize("drop, named", [
    ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.k_proj.weight"),  # one part of qkv_proj
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"),        # a whole layer
    # The reload keeps biases live and its metadata lists only weights: these passed unnoticed.
    ("model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.k_proj.bias"),
    ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.q_proj.bias"),
    (QKV_BIASES, "model.layers.0.self_attn.qkv_proj.bias"),
])
def test_a_missing_tensor_fails_naming_it_and_the_server_keeps_serving(server, tiny_model, tmp_path, drop, named):
    push(server, [tiny_model.weights[0]], path="extension")
    broken = broken_copy(tiny_model.weights[1], tmp_path / "broken.safetensors", drop=drop)
    with pytest.raises(RemoteWorkerError, match=f"nothing arrived for {named}"):
        push(server, [broken], path="extension")
    _assert_serving_and_recovers(server, tiny_model)


@pytest.mark.parametrize("tensor", [
    "model.layers.0.self_attn.k_proj.weight",  # transposed: same numel, wrong shape
    "model.layers.1.mlp.down_proj.weight",     # transposed
    "lm_head.weight",
])
def test_a_tensor_with_a_wrong_shape_fails_naming_it_and_the_server_keeps_serving(server, tiny_model, tmp_path,
                                                                                   tensor):
    broken = broken_copy(tiny_model.weights[1], tmp_path / "broken.safetensors", reshape=tensor)
    with pytest.raises(RemoteWorkerError, match=f"vLLM rejected the tensor .*'{tensor}'"):
        push(server, [broken], path="extension")
    _assert_serving_and_recovers(server, tiny_model)


def _assert_serving_and_recovers(server, model):
    assert server.alive() and server.client.healthy()
    assert all(len(c) == MAX_TOKENS for c in completions(server, model))  # still answers
    push(server, [model.weights[0]], path="extension")
    assert completions(server, model) == model.reference(model.weights[0])


def _header(path):
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_the_readme_requester_resets_the_prefix_cache(server, tiny_model):
    """README: ``ps.update(name, lambda handles: request_inference_to_update(url, dict(handles)))``."""
    url = f"{server.endpoint}/collective_rpc"
    push(server, [tiny_model.weights[0]], path="extension",
         req_func=lambda handles: request_inference_to_update(url, dict(handles)))
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[0])
    # The prompts' KV blocks are cached now; the README's call must not let them survive.
    push(server, [tiny_model.weights[1]], path="extension",
         req_func=lambda handles: request_inference_to_update(url, dict(handles)))
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[1])


def test_without_the_prefix_cache_reset_cached_prompts_answer_from_the_old_weights(server, tiny_model):
    """Why the requester resets: the same switch with the reset left out gives wrong output."""
    url = f"{server.endpoint}/collective_rpc"
    push(server, [tiny_model.weights[0]], path="extension")
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[0])
    push(server, [tiny_model.weights[1]], path="extension",
         req_func=lambda handles: request_inference_to_update(url, dict(handles), reset_prefix_cache=False))
    stale = completions(server, tiny_model)
    assert stale[2] != tiny_model.reference(tiny_model.weights[1])[2], \
        "the 200-token prompt answered from the new weights although its old KV blocks stayed cached"
    server.client.ensure_prefix_cache_reset()
    assert completions(server, tiny_model) == tiny_model.reference(tiny_model.weights[1])


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
def test_each_pause_mode_updates_exactly_and_leaves_the_server_resumed(server, tiny_model, mode):
    for weights in tiny_model.weights:
        push(server, [weights], path="extension", pause=mode)
        assert server.client.last_report.seconds.keys() >= {"pause", "update", "reset_prefix_cache", "resume"}
        assert not server.client.is_paused()
        assert completions(server, tiny_model) == tiny_model.reference(weights)


def test_a_failed_update_with_pause_wait_raises_the_worker_error_and_resumes(server, tiny_model, tmp_path):
    tensor = "model.layers.1.mlp.up_proj.weight"
    broken = broken_copy(tiny_model.weights[1], tmp_path / "broken.safetensors", drop=tensor)
    for _ in range(2):   # the second failure goes out on the connection the first 500 left behind
        with pytest.raises(RemoteWorkerError, match=f"nothing arrived for {tensor}") as info:
            push(server, [broken], path="extension", pause="wait")
        assert "resume" not in "".join(getattr(info.value, "__notes__", []))
        assert not server.client.is_paused()
    _assert_serving_and_recovers(server, tiny_model)
