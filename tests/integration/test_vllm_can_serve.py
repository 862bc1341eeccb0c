"""What this machine's vLLM cannot serve skips a test with vLLM's reason; any other failure fails it.

``vllm_support.can_serve.served_here`` asks vLLM itself (a cold load without ckpt-engine) once per
format and machine and caches the answer. Only failures that name a missing kernel, instruction set
or primitive of the machine's vLLM build turn into a skip: a checkpoint the test wrote wrong must
still fail the test, or the probe would hide our defects. These tests read answers from the cache
(no vLLM needed); ``test_vllm_quant_parity`` runs the real probe.
"""

import json

import pytest

from vllm_support import can_serve


@pytest.fixture
def answer(tmp_path, monkeypatch):
    """Put ``result`` in the cache for ``fmt`` as if vLLM had answered it on this machine."""
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path))
    python = str(tmp_path / "venv" / "bin" / "python")

    def put(fmt, result):
        cache = can_serve._cache_file(python, fmt)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(result))
        return can_serve.served_here(python, fmt, tmp_path / "model", tmp_path / "w.safetensors")
    return put


def test_a_format_vllm_serves_here_runs(answer):
    assert answer("gptq", {"served": True}) is None


@pytest.mark.parametrize("error, where", [
    ("AttributeError: '_OpNamespace' '_C' object has no attribute 'cpu_gemm_wna16'", "torch/_ops.py:1392 __getattr__"),
    ("ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons: "
     "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).", "vllm/kernels/linear:720"),
    ("RuntimeError: could not create a primitive", "vllm/model_executor/layers/quantization/utils.py:9 f"),
])
def test_a_kernel_this_cpu_lacks_is_a_skip_with_vllms_own_reason(answer, error, where):
    reason = answer("awq", {"served": False, "error": error, "where": where})
    assert reason is not None and error in reason and where in reason


def test_any_other_failure_of_vllm_fails_the_test_instead_of_skipping_it(answer):
    with pytest.raises(RuntimeError, match="not this CPU's.*KeyError: 'model.layers.0.mlp.qweight'"):
        answer("gptq", {"served": False, "error": "KeyError: 'model.layers.0.mlp.qweight'",
                        "where": "vllm/model_executor/models/llama.py:420 load_weights"})


def test_the_cached_answer_belongs_to_one_machine_format_and_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path))
    a = can_serve._cache_file("/v1/bin/python", "awq")
    assert a == can_serve._cache_file("/v1/bin/python", "awq")
    assert a != can_serve._cache_file("/v1/bin/python", "gptq")
    assert a != can_serve._cache_file("/v2/bin/python", "awq")
    monkeypatch.setattr(can_serve, "_cpu_flags", lambda: "fpu avx2 amx_tile")
    assert a != can_serve._cache_file("/v1/bin/python", "awq")


def test_vllm_killed_by_an_illegal_instruction_is_this_machines_and_skips(tmp_path, monkeypatch):
    """The probe runs vLLM alone; a SIGILL there is the CPU's (or its hypervisor's) instruction set."""
    import signal
    import subprocess

    monkeypatch.setenv("CKPT_CACHE_DIR", str(tmp_path))
    said = ("Fatal Python error: Illegal instruction\n\nCurrent thread 0x01 (most recent call first):\n"
            '  File "/v/torch/_ops.py", line 1158 in __call__\n'
            '  File "/v/vllm/model_executor/kernels/linear/int8.py", line 80 in apply_weights\n'
            '  File "/v/vllm/v1/worker/cpu_model_runner.py", line 40 in execute_model\n')
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -signal.SIGILL, "", said))
    reason = can_serve.served_here(str(tmp_path / "python"), "ct-w8a8", tmp_path / "model", tmp_path / "w.safetensors")
    assert reason is not None and "SIGILL" in reason and "int8.py\", line 80 in apply_weights" in reason
    # any other death of the probe still fails the test
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -signal.SIGSEGV, "", said))
    with pytest.raises(RuntimeError, match="died"):
        can_serve.served_here(str(tmp_path / "python"), "gptq", tmp_path / "model", tmp_path / "w.safetensors")
