"""Tensor parallelism 2 on a real vLLM-CPU server: the workers of an engine load all, or none.

A parameter server of one rank offers one ZeroMQ handle to an engine of two workers. Before the
fix, worker 0 loaded and finalized while worker 1 raised "no ZeroMQ handle": the two halves of
every layer came from different weights. Now every worker checks its handle and the workers
agree before any of them loads, on both paths, and the output stays what it was.
"""

import pytest

from ckpt_core.errors import RemoteWorkerError
from vllm_support.fixtures import MAX_TOKENS, push, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import tp_server_args

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
