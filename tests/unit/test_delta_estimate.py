"""The planner's delta estimate (``planning/delta_estimate.py``) against the real encoder, and
``ckpt-engine plan --delta-density``."""

import json
import math

import pytest
import torch

from ckpt_core import cli
from ckpt_core.delta.encode import encode_tensor
from ckpt_core.errors import ConfigError
from ckpt_core.planning.capacity import ModelSpec, Topology, predict
from ckpt_core.planning.delta_estimate import DeltaCalibration, changed_tensor_fraction, payload_fraction, predict_delta


def _changed_at(density: float, numel: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(numel, generator=g).to(dtype)
    mask = torch.rand(numel, generator=g) < density
    new = old.clone()
    # a different value at each chosen position (a bit flip of the lowest bit of the integer view)
    words = new.view(torch.int16) if dtype.itemsize == 2 else new.view(torch.int32)
    words[mask] ^= 1
    return new, old


@pytest.mark.parametrize("density", [0.001, 0.02, 0.05, 0.1, 0.3, 0.9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_estimated_payload_is_what_the_encoder_makes_at_random_positions(density, dtype):
    numel = 1 << 20
    new, old = _changed_at(density, numel, dtype, seed=int(density * 1000))
    payload, info = encode_tensor(new, old)
    real = payload.numel() / (numel * new.element_size())
    estimate, encoding = payload_fraction(density, new.element_size(), numel)
    assert encoding == info["encoding"]
    # the estimate leaves out the header and the padding; the count is binomial around d * n
    assert real == pytest.approx(estimate, rel=0.03, abs=2e-4)


def test_very_sparse_large_tensors_need_positions_not_gaps():
    # a gap of 2**16 elements or more is expected: gap16 cannot be chosen, idx can
    assert payload_fraction(1e-5, 2, 1e8)[1] == "idx"
    assert payload_fraction(1e-3, 2, 1e8)[1] == "gap16"
    assert payload_fraction(0.99, 2, 1e6) == (1.0, "whole")


def test_changed_tensors_follow_the_density():
    assert changed_tensor_fraction(0.0, 1e6) == 0.0
    assert changed_tensor_fraction(1.0, 10) == 1.0
    assert changed_tensor_fraction(0.02, 4096) == pytest.approx(1.0)
    assert changed_tensor_fraction(0.02, 10) == pytest.approx(1 - 0.98 ** 10)
    # norms of 4 elements at 1e-4: most do not change, and send nothing
    assert changed_tensor_fraction(1e-4, 4) < 1e-3


def test_a_delta_prediction_moves_the_payload_through_the_full_updates_stages():
    full = predict(ModelSpec(16 << 30, 451, 1 << 30), Topology(devices_per_node=1, h2d_gbps=55.4))
    fast = DeltaCalibration(apply_gbps=1000.0, digest_gbps=1000.0)
    d = predict_delta(full, 0.02, cal=fast)
    assert d["encoding"] == "gap16" and d["payload_fraction"] == pytest.approx(0.04, rel=1e-3)
    assert d["stages_s"]["h2d"] == pytest.approx(full["stages_s"]["h2d"] * 0.04, rel=1e-3)
    assert d["pays_off"] and d["update_s"] < full["update_s"]
    # the host rates measured today: the post-apply check of every changed tensor dominates
    slow = predict_delta(full, 0.02)
    assert slow["bottleneck"] in ("apply", "check") and not slow["pays_off"]
    assert slow["calibration"]["source"].startswith("benchmarks/results/")
    # nothing changed: nothing moves
    none = predict_delta(full, 0.0, cal=fast)
    assert none["payload_bytes"] == 0 and none["stages_s"]["check"] == 0


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan])
def test_an_absurd_density_is_refused(bad):
    full = predict(ModelSpec(1 << 30, 10, 1 << 27), Topology(devices_per_node=1))
    with pytest.raises(ConfigError, match="density"):
        predict_delta(full, bad)


def test_plan_prints_and_emits_the_delta_beside_the_full_update(capsys):
    assert cli.main(["--json", "plan", "--size-gib", "16", "--tensors", "451", "--devices", "1",
                     "--delta-density", "0.02", "--delta-apply-gb-per-s", "900",
                     "--delta-check-gb-per-s", "900"]) == 0
    doc = json.loads(capsys.readouterr().out)
    d = doc["with_delta"]
    assert d["density"] == 0.02 and d["full_update_s"] == doc["update_s"] and d["pays_off"]
    assert d["calibration"]["apply_gbps"] == 900 and d["calibration"]["digest_gbps"] == 900
    assert cli.main(["plan", "--size-gib", "16", "--tensors", "451", "--devices", "1", "--delta-density", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "delta at 50 % changed elements (bitmap)" in out and "does not pay off" in out
    with pytest.raises(SystemExit) as exc:   # argparse: a usage error, exit code 2, naming the bound
        cli.main(["plan", "--size-gib", "16", "--tensors", "451", "--delta-density", "2"])
    assert exc.value.code == 2 and "must be <= 1" in capsys.readouterr().err
