"""P2P updates on CUDA: Mooncake reads from the owners' pinned host memory straight into the
targets' CUDA IPC buffers, then NCCL broadcasts inside the target group.

Needs Mooncake's CUDA build (``mooncake-transfer-engine-cuda13==0.3.14`` on the H200 image) and
2 GPUs. The transport is TCP on loopback (NCCL_IB_DISABLE=1 in the cases), like the CPU tests.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu


def need(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, this machine has {torch.cuda.device_count()}")
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Mooncake's CUDA build (mooncake-transfer-engine-cuda13) is not installed: {exc}")


@pytest.mark.parametrize("world", [1, 2])
def test_p2p_into_every_subset_of_cuda_targets_is_bit_exact(world):
    need(world)
    from support import p2p_cases as cases
    cases.case_every_subset("cuda", world)


@pytest.mark.parametrize("world", [1, 2])
def test_a_joiner_world_on_cuda_pulls_through_saved_metas(world, tmp_path):
    need(world)   # world 1: owner and joiner are two processes (two worlds) on the same GPU
    from support import p2p_cases as cases
    cases.case_joiner_world("cuda", world, tmp_path)


@pytest.mark.parametrize("mode", ["close", "abort"])
def test_p2p_target_groups_under_nccl_are_freed_by_close_and_abort(mode, monkeypatch):
    """Issue 14 defect 5's sibling on NCCL: 10 ParameterServers in a trainer's default group, each
    after a P2P update into rank 1's GPU, leave no group, fd or communicator memory behind."""
    need(2)
    from support.engine import EngineFront
    from support.p2p_cases import OWNERS
    from support.ps_fault_cases import assert_census_clean, group_census
    for key, value in OWNERS.items():
        monkeypatch.setenv(key, value)
    front = EngineFront("cuda", 1, devices=[1])
    try:
        got = group_census("cuda", 10, mode, p2p=front.address)
        assert len(front.requests) == 11, "every ParameterServer's P2P update reached rank 1's engine"
    finally:
        front.close()
    assert_census_clean(got, device_slack=64 << 20)


BENCH_TIMEOUT_S = 840   # 1 GiB (the default) takes a few minutes at most; the run is cut short before pytest's limit


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_the_p2p_benchmark_into_gpu_memory_against_a_plain_mooncake_read(tmp_path):
    """Figures for the issue's note: P2P update throughput into the GPUs (2, or 1 on a one-GPU
    machine: one owner, one reader) vs Mooncake's TCP read ceiling.

    ``CKPT_P2P_BENCH_GIB`` (default 1) sets the size. The benchmark prints a line per phase, so a
    run cut short by the timeout still shows which phase it was in, and at what rate.
    """
    need(1)
    n = str(min(2, torch.cuda.device_count()))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = os.path.join(os.environ.get("CKPT_BENCH_OUT", str(tmp_path)), "p2p_gpu.json")
    gib = os.environ.get("CKPT_P2P_BENCH_GIB", "1")
    from support.procs import pythonpath
    env = {**os.environ, "PYTHONPATH": pythonpath(root), "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}
    cmd = [sys.executable, os.path.join(root, "benchmarks", "p2p_bench.py"), "--device", "cuda",
           "--gib", gib, "--readers", n, "--owners", n, "--repeats", "3", "--out", str(out)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        progress = "\n".join(x for x in text.splitlines() if x.startswith("[p2p_bench"))
        pytest.fail(f"the {gib} GiB benchmark did not finish within {BENCH_TIMEOUT_S} s; its progress:\n{progress}")
    progress = [x for x in proc.stdout.splitlines() if x.startswith("[p2p_bench")]
    print("\n".join(progress))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout.strip().splitlines()[-1])
    with open(out) as f:
        rep = json.load(f)
    assert rep["verified"] and rep["ratio"] > 0
