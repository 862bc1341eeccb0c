"""examples/p2p_join.py, run as written: two owner ranks under torchrun serve a checkpoint on one
simulated host, a separate joining world on another pulls it over Mooncake's real TCP transport,
and every joining rank's engine holds exactly the checkpoint's tensors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                    "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")
from support.data import FAULT_DTYPES, fresh_tensor  # noqa: E402
from support.torchrun import run_torchrun, start_torchrun  # noqa: E402
from ckpt_core.checkpoint.safetensors import write_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "p2p_join.py"


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                NCCL_IB_DISABLE="1", PS_MAX_BUCKET_SIZE_GB="0.0001", **extra)   # TCP; ~100 KiB buckets


@pytest.mark.slow
@pytest.mark.parametrize("joiners", [1, 2])
def test_a_joining_world_pulls_the_owners_checkpoint_bit_exact(tmp_path, joiners):
    sys.path.insert(0, str(EXAMPLE.parent))
    from p2p_join import digest
    gen = torch.Generator().manual_seed(2604 + joiners)
    ckpt, weights = tmp_path / "step-7", {}
    ckpt.mkdir()
    for f in range(4):
        ts = {f"l{f}.t{i}": fresh_tensor((1500 + 277 * i,), FAULT_DTYPES[(f + i) % 4], gen) for i in range(5)}
        write_file(ckpt / f"model-{f:05d}.safetensors", ts)
        weights.update(ts)
    metas = tmp_path / "metas.json"
    owners = start_torchrun([EXAMPLE, "serve", "--checkpoint-path", ckpt, "--metas", metas, "--device", "cpu",
                             "--serve-s", "300"], nproc=2, out=tmp_path / "owners.log",
                            env=_env(PS_P2P_HOST="127.0.0.2"), cwd=ROOT, start_new_session=True)
    try:
        deadline, said = time.monotonic() + 120, lambda: '"serving"' in (tmp_path / "owners.log").read_text()
        while not said() and owners.poll() is None and time.monotonic() < deadline:   # printed once the metas are written
            time.sleep(0.2)
        assert said() and metas.exists(), \
            f"owners are not serving ({owners.poll()}):\n{(tmp_path / 'owners.log').read_text()[-4000:]}"
        p = run_torchrun([EXAMPLE, "join", "--metas", metas, "--device", "cpu", "--timeout", "120"], nproc=joiners,
                         env=_env(PS_P2P_HOST="127.0.0.3"), timeout=240, cwd=ROOT)
        assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-5000:]}"
        lines = sorted((json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")), key=lambda x: x["rank"])
        assert [x["rank"] for x in lines] == list(range(joiners)), p.stdout
        want = digest(weights)
        for x in lines:
            assert x["checkpoint"] == "current" and x["tensors"] == len(weights), x
            assert x["bytes"] == sum(t.numel() * t.element_size() for t in weights.values()), x
            assert x["digest"] == want, f"rank {x['rank']}'s engine differs from the checkpoint"
        assert owners.poll() is None, "the owners keep serving after a joiner pulled"
    finally:
        os.killpg(owners.pid, signal.SIGTERM)
        try:
            owners.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(owners.pid, signal.SIGKILL)
            owners.wait(10)
