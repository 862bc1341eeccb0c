"""Managed mode: an engine worker starts its PS rank serving on a Unix socket; the controller only
talks to the service; the PS never outlives the worker (its stop hook, or the worker SIGKILLed
together with its whole process tree, as vLLM does at shutdown) and leaves no socket and no
/dev/shm buffer behind."""

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
from support.data import FAULT_DTYPES, fresh_tensor, want_digests  # noqa: E402
from support.ports import free_port  # noqa: E402
from support.procs import process_gone  # noqa: E402
from support.service_world import ROOT, HttpEngineFront, wait_healthy  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402
from ckpt_core.errors import ConfigError  # noqa: E402
from ckpt_core.engines.managed import WATCH_S, log_path_of, parse_serve_spec, start_managed  # noqa: E402

# A stand-in for an engine worker's lifecycle hooks: start the PS child, report its pid, stop it on SIGTERM.
WORKER = r"""
import json, signal, sys, time
from ckpt_core.engines.managed import start_managed
rank, world, port, spec, log = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
m = start_managed(spec, rank=rank, world_size=world, local_rank=rank, device="cpu", master_port=port,
                  extra_args=["--keep-device-buffers", "--max-bucket-gib", "0.00005"], log_path=log)
def shutdown(*_):
    print(json.dumps({"stopped_cleanly": m.stop()}), flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, shutdown)
print(json.dumps({"child": m.pid, "uds": m.uds}), flush=True)
while True:
    time.sleep(1)
"""


def _descendants(pid: int) -> list[int]:
    kids = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(p))
            except OSError:
                continue
    return kids + [d for k in kids for d in _descendants(k)]


def _buffers_of(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("ckpt-") and f"-p{pid}n" in n]


def test_the_serving_spec_is_a_unix_socket_or_a_tcp_address():
    assert parse_serve_spec("uds:/run/ps-{rank}.sock") == "/run/ps-{rank}.sock"
    assert parse_serve_spec("tcp:0.0.0.0:19730,allow-dir=/ckpt,log=/var/log/ps-{rank}.log") == "0.0.0.0:19730"
    assert log_path_of("uds:/run/ps-{rank}.sock", 1, 1) == "/run/ps-1.sock.log"
    assert log_path_of("tcp:10.0.0.5:19730,log=/var/log/ps-{rank}.log", 3, 3) == "/var/log/ps-3.log"
    assert log_path_of("tcp:10.0.0.5:19730", 0, 0) is None
    for bad in ("tcp:0.0.0.0", "tcp:0.0.0.0:http", "tcp::80", "uds:", "/run/x.sock", "uds:/x,color=red"):
        with pytest.raises(ConfigError, match="uds:PATH|tcp:HOST:PORT|not one of"):
            parse_serve_spec(bad)


def test_managed_ps_ranks_serve_updates_and_die_with_their_worker(tmp_path):
    port, spec = free_port(), "uds:" + str(tmp_path / "ps-{rank}.sock") + f",allow-dir={tmp_path}"
    env = dict(os.environ, PYTHONPATH=ROOT)
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), "2", str(port), spec, str(tmp_path / f"ps{r}.log")],
                                env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    front = HttpEngineFront(2)
    clients = []
    try:
        info = [json.loads(w.stdout.readline()) for w in workers]
        children = [i["child"] for i in info]
        for r, i in enumerate(info):
            assert i["uds"] == str(tmp_path / f"ps-{r}.sock")
            c = httpx.Client(transport=httpx.HTTPTransport(uds=i["uds"]), base_url="http://ps", timeout=120)
            clients.append(c)
        deadline = time.monotonic() + 120
        while not all(os.path.exists(i["uds"]) for i in info):
            assert time.monotonic() < deadline, [open(tmp_path / f"ps{r}.log").read()[-2000:] for r in range(2)]
            time.sleep(0.1)
        for r, c in enumerate(clients):
            wait_healthy(c, None, str(tmp_path / f"ps{r}.log"))

        gen, data = torch.Generator().manual_seed(5), {}
        for r, c in enumerate(clients):
            ts = {f"m{r}.{i}": fresh_tensor((700 + i,), FAULT_DTYPES[i % 4], gen) for i in range(6)}
            write_file(str(tmp_path / f"m{r}.safetensors"), ts)
            data.update(ts)
            assert c.post("/v1/checkpoints/m/files", json={"files": [str(tmp_path / f"m{r}.safetensors")]}).status_code == 200
        _both(clients, "/v1/checkpoints/m/gather-metas", [{}, {}])
        _both(clients, "/v1/checkpoints/m/update", [{"update_url": front.url, "timeout": 60}, {"timeout": 60}])
        held = {**front.engine.digests(0), **front.engine.digests(1)}
        assert held == want_digests(data)
        assert all(_buffers_of(pid) for pid in children), "kept device (/dev/shm) buffers exist while serving"

        tree = _descendants(workers[0].pid)
        for pid in [workers[0].pid, *tree]:                # the worker and its whole tree, no cleanup
            os.kill(pid, signal.SIGKILL)
        workers[0].wait(10)
        assert children[0] not in tree, "the PS is not in its worker's process tree"
        assert process_gone(children[0]), "the PS child outlived its SIGKILLed worker"
        workers[1].send_signal(signal.SIGTERM)             # the engine worker shuts down: its hook stops the PS
        assert json.loads(workers[1].stdout.readline()) == {"stopped_cleanly": True}
        assert process_gone(children[1])
        for pid, i in zip(children, info):
            assert not _buffers_of(pid), f"/dev/shm buffers of PS pid {pid} are left behind"
            assert not os.path.exists(i["uds"]), "the socket file is removed"
    finally:
        for c in clients:
            c.close()
        front.close()
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait(10)


def _both(clients, path, body):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda cb: cb[0].post(path, json=cb[1]), zip(clients, body)))
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]


def test_a_managed_ps_that_cannot_serve_its_store_is_logged_by_its_worker_at_once_with_the_cause(tmp_path, caplog):
    """Another process holds the store port: the PS exits as it starts, and the engine worker (which
    keeps serving without it) logs an error naming the rank, the phase and the PS's own last words,
    the port and EADDRINUSE, instead of leaving a controller to wait on a socket that never appears."""
    spec = "uds:" + str(tmp_path / "ps-{rank}.sock")
    log = tmp_path / "ps-0.log"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        caplog.set_level(logging.INFO, logger="ckpt_core")
        m = start_managed(spec, rank=0, world_size=1, local_rank=0, device="cpu", master_port=port,
                          log_path=str(log))
        try:
            assert m.exited.wait(120), f"the watch did not see the PS exit:\n{log.read_text()[-2000:]}"
        finally:
            m.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0] == f"[managed ps rank 0] phase=serve {m.failure}"
    assert f"pid {m.pid}" in m.failure and "no PS rank 0" in m.failure and str(log) in m.failure
    assert re.search(rf"ckpt-engine serve: TransportError: rank 0: cannot reach the rendezvous store at "
                     rf"127\.0\.0\.1:{port}: .*Address already in use", m.failure), m.failure
    assert process_gone(m.pid) and not os.path.exists(tmp_path / "ps-0.sock")


def test_a_managed_ps_stopped_by_its_worker_is_not_reported_as_failed(tmp_path, caplog):
    spec = "uds:" + str(tmp_path / "ps-{rank}.sock")
    caplog.set_level(logging.INFO, logger="ckpt_core")
    m = start_managed(spec, rank=0, world_size=1, local_rank=0, device="cpu", master_port=free_port(),
                      log_path=str(tmp_path / "ps-0.log"))
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "ps-0.sock")), base_url="http://ps")
        with client:
            wait_healthy(client, None, str(tmp_path / "ps-0.log"))
    finally:
        assert m.stop()
    time.sleep(3 * WATCH_S)   # the watch's next look, had it not been told of the stop
    assert not m.exited.is_set() and m.failure is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
