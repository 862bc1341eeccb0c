"""A trainer whose devices are not the engine's: its ranks own the weights, the engine's PS world pulls them.

A real vLLM-CPU server runs with the ``ckpt`` backend and managed PS ranks (``CKPT_ENGINE_SERVE=tcp:...``,
a bearer token) on 127.0.0.1. Two trainer ranks, separate processes with their own gloo world on
127.0.0.2 (their Mooncake stores publish 127.0.0.2: another host, as far as addresses go; Mooncake runs
over TCP here), call vLLM's ``WeightTransferTrainerFactory.trainer_init(CkptTrainerInitInfo(
p2p_services=[...]), client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))`` and
``send_weights()`` after each of three training steps: the engine's PS world loads their metas and
pulls the bytes from their host memory. After every step every parameter, buffer and derived kernel
tensor of the engine equals a cold load of the trainer's weights, and greedy output equals Hugging
Face's. Then trainer rank 1 is SIGKILLed after publishing its metas, before the engine's PS world read
from it: the sender gets the engine side's typed error within the round's timeout, every tensor of the
engine is the last step's or the failed round's (no bucket that was not read is loaded), and a new
trainer world's round into the same engine (and PS world) works. A second test feeds a TP 2 engine,
whose PS world of two ranks pulls each round (both are targets).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.managed_ps import ManagedPs
from vllm_support.fixtures import launch_server, ready, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import ALLOWED_TO_DIFFER, cold_load, differences, tp_server_args
from vllm_support.server import REPO, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
TRAINER = REPO / "tests" / "integration" / "vllm_support" / "rl_trainer.py"
TRAINER_HOST = "127.0.0.2"   # the trainer's "host": its rendezvous and its Mooncake stores
TIMEOUT_S = 60               # each round's bound on the trainer


def mooncake_shim(out: Path) -> str:
    """A folder holding only this venv's Mooncake build (the vLLM venv has none; same Python, 3.11), for
    PYTHONPATH: the engine's managed PS ranks read P2P with it and the trainer's owners serve with it."""
    mooncake = pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                                   "scripts/test.sh installs mooncake-transfer-engine-non-cuda")
    package = Path(mooncake.__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    for src in [package, *package.parent.glob("mooncake_transfer_engine*.libs")]:
        (out / src.name).symlink_to(src)
    return str(out)


def start_engine(python: str, model, where: Path, tp: int = 1):
    """A server (TP ``tp``) whose managed PS ranks serve on TCP: (server, services, token, shim)."""
    shim = mooncake_shim(where / "shim")
    token = secrets.token_hex(16)
    extra = tp_server_args(tp)
    env = {"CKPT_SERVICE_TOKEN": token, "PYTHONPATH": shim, **extra.pop("env", {})}
    # the service's and the store's ports, picked at each launch (again if another process took one)
    managed = ManagedPs(f"tcp:127.0.0.1:{{port}},log={where}/ps-{{rank}}.log", ranks=tp)
    server = launch_server(python, model, where, extension=True, backend="ckpt", env=env, managed=managed, **extra)
    try:
        ready(server)
        services = managed.services()   # local rank i on PORT + i
        _wait_healthy(services, token, where / "ps-0.log")
    except BaseException:
        server.stop()
        raise
    return server, services, token, shim


@pytest.fixture(scope="module")
def engine(vllm_python, tiny_model, tmp_path_factory):
    server = start_engine(vllm_python, tiny_model, tmp_path_factory.mktemp("p2p-engine"))
    try:
        yield server
    finally:
        server[0].stop()


def _wait_healthy(services: list[str], token: str, log: Path, timeout: float = 120.0) -> None:
    from ckpt_core.client import ServiceWorld

    deadline = time.monotonic() + timeout
    with ServiceWorld(services, token=token, timeout=10) as world:
        while (problems := world.problems()) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert not problems, f"the managed PS is not healthy: {problems}\n{log.read_text()[-3000:] if log.exists() else ''}"


def run_trainers(python: str, model, server, services, token, shim, out: Path, phases: list[str], *, ranks: int,
                 seed: int) -> tuple[list[dict], list[subprocess.CompletedProcess]]:
    """rl_trainer.py on ``ranks`` trainer processes (their own gloo world on TRAINER_HOST); rank 0's JSON lines."""
    out.mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), shim)), "MASTER_ADDR": TRAINER_HOST,
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks), "PS_P2P_HOST": TRAINER_HOST,
            "CKPT_SERVICE_TOKEN": token, "PS_COLLECTIVE_TIMEOUT_S": "120"}
    cmd = [python, str(TRAINER), "--model", str(model.dir), "--weights", str(model.weights[0]), "--url",
           server.endpoint, "--out", str(out), "--prompts", json.dumps(model.prompts), "--phases", ",".join(phases),
           "--timeout", str(TIMEOUT_S), "--seed", str(seed), "--p2p-services", json.dumps(services)]
    procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    runs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            pytest.fail(f"a trainer rank hung:\n{stderr[-4000:]}\n{server.log_tail(30)}")
        runs.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    for r, run in enumerate(runs):
        print(f"--- trainer rank {r} (exit {run.returncode}) ---\n{run.stderr[-2500:]}", file=sys.stderr)
    assert runs[0].returncode == 0, f"trainer rank 0 failed ({runs[0].returncode}):\n{runs[0].stderr[-6000:]}\n" \
                                    f"{server.log_tail(30)}"
    return [json.loads(x) for x in runs[0].stdout.splitlines() if x.startswith("{")], runs


def test_trainer_ranks_on_another_host_are_pulled_by_the_engines_ps_world_and_each_step_equals_a_cold_load(
        engine, tiny_model, vllm_python, tmp_path):
    server, services, token, shim = engine
    lines, runs = run_trainers(vllm_python, tiny_model, server, services, token, shim, tmp_path / "a",
                               ["send", "send", "send", "kill-owner"], ranks=2, seed=tiny_model.seed)
    steps, killed = lines[:3], lines[3]
    assert [s["phase"] for s in steps] == ["send"] * 3 and killed["phase"] == "kill-owner", lines

    # The owner is gone: the engine side's typed error, on the sender, within the round's bound.
    assert runs[1].returncode == -9, "trainer rank 1 was to SIGKILL itself"
    assert killed["typed"] and killed["error"] in ("TransportError", "UpdateTimeoutError"), killed
    assert "owner rank 1" in killed["message"] and TRAINER_HOST in killed["message"], killed["message"]
    assert killed["seconds"] < TIMEOUT_S + 30, killed["seconds"]

    # The engine's PS world read the owners' stores at the trainer's address, and holds no checkpoint of its own.
    metas, status = _get(services[0], token, "/v1/metas"), _get(services[0], token, "/v1/status")
    owners = [o for c in metas["checkpoints"].values() for o in c["owners"]]
    assert [o["rank"] for o in owners] == [0, 1] and all(o["p2p"]["host"] == TRAINER_HOST for o in owners), owners
    assert status["checkpoints"] == [] and status["healthy"], status

    # A new trainer world (one rank, other weights) into the same engine and PS world: the next round works.
    again, _ = run_trainers(vllm_python, tiny_model, server, services, token, shim, tmp_path / "b", ["send"],
                            ranks=1, seed=tiny_model.seed + 1)
    renamed = Path(again[0]["file"]).rename(tmp_path / "b" / "world-b-step-1.safetensors")   # the cold load's
    steps.append({**again[0], "file": str(renamed)})   # folders are named by file stem: a/step-1 is taken
    files = [Path(s["file"]) for s in steps]
    cold = cold_load(vllm_python, tiny_model.dir, [*files, Path(killed["file"])])["digests"]
    tiny_model.references(*files)
    # The failed pull loaded no bucket it could not read: every tensor of the engine was step 3's or the
    # killed round's (layers whose buckets all arrived were reloaded; the rest kept their weights). A
    # layer's probe (its kernel's output) is not one tensor: vLLM's layerwise reload keeps a bias live and
    # processes the layer once its weights arrived, so with the bias in the bucket that was never read the
    # probe is of new weights and the old bias, each of them step 3's or the killed round's (checked here).
    strays = [f"rank {r}: {n}" for r, (got, old, new) in enumerate(zip(killed["digests"], steps[2]["digests"],
                                                                       cold[killed["file"]]))
              for n in got if n not in ALLOWED_TO_DIFFER and not n.endswith(".<probe>")
              and got[n] not in (old.get(n), new.get(n))]
    assert not strays, f"after the failed pull, tensors that are neither step 3's nor the killed round's: {strays}"
    for step, file in zip(steps, files):
        differ = differences(step["digests"], cold[str(file)])
        assert not differ, f"after {file.name}, {len(differ)} tensor(s) differ from a cold load:\n" + \
            "\n".join(differ[:40])
        assert step["tokens"] == tiny_model.reference(file), f"greedy output after {file} differs from HF"
        assert step["result"]["bytes"] == file.stat().st_size - _header_bytes(file)
    assert len({json.dumps(s["digests"], sort_keys=True) for s in steps}) == 4, "each step changed the weights"
    print("send_weights seconds per step:", [round(s["seconds"], 3) for s in steps])


@pytest.mark.skipif(os.environ.get("CKPT_VLLM_PARITY") != "all",
                    reason="a second TP 2 server for the suite's time budget: the extended real-vLLM set "
                           "(CKPT_VLLM_PARITY=all) runs it")
def test_one_trainer_rank_feeds_a_tp2_engine_whose_two_ps_ranks_pull_and_each_step_equals_a_tp2_cold_load(
        tiny_model, vllm_python, tmp_path):
    # The engine's PS world has two ranks (one per worker), both targets of the P2P update: one reads each
    # bucket from the trainer's store, both broadcast it to their workers.
    server, services, token, shim = start_engine(vllm_python, tiny_model, tmp_path / "engine", tp=2)
    try:
        steps, _ = run_trainers(vllm_python, tiny_model, server, services, token, shim, tmp_path / "a",
                                ["send", "send"], ranks=1, seed=tiny_model.seed + 2)
        files = [Path(s["file"]) for s in steps]
        cold = cold_load(vllm_python, tiny_model.dir, files, 2)["digests"]
        tiny_model.references(*files)
        for step, file in zip(steps, files):
            differ = differences(step["digests"], cold[str(file)])
            assert len(step["digests"]) == 2 and not differ, \
                f"after {file.name}, {len(differ)} tensor(s) differ from a TP 2 cold load:\n" + "\n".join(differ[:40])
            assert step["tokens"] == tiny_model.reference(file), f"greedy output after {file} differs from HF"
        assert steps[0]["digests"] != steps[1]["digests"]
        status = [_get(s, token, "/v1/status") for s in services]
        assert [(st["rank"], st["world_size"]) for st in status] == [(0, 2), (1, 2)], status
    finally:
        server.stop()


def _get(service: str, token: str, path: str) -> dict:
    import httpx

    answer = httpx.get(f"{service}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
