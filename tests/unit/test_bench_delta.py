"""The delta benchmark's version generator (benchmarks/_bench_delta.py): exactly the asked fraction of
elements changes, the same seed gives the same version, and every changed element's bytes differ."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))
from _bench_delta import changed_positions, host_bytes_needed, parse_density, perturb_  # noqa: E402


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.reshape(-1).view(ints) != b.reshape(-1).view(ints)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.1, 0.6, 1.0])
def test_exactly_the_asked_fraction_of_elements_changes(dtype, fraction):
    base = _random((257, 129), dtype, seed=int(fraction * 1e4))
    new = base.clone()
    n = perturb_(new, fraction, torch.Generator().manual_seed(7))
    want = round(fraction * base.numel())
    assert n == want
    assert int(_changed(base, new).sum()) == want   # bytes really differ at every reported position


def test_changed_values_move_by_one_ulp_and_stay_finite():
    base = _random((4096,), torch.bfloat16, seed=3) * 1e3
    new = base.clone()
    perturb_(new, 0.05, torch.Generator().manual_seed(1))
    mask = _changed(base, new)
    assert torch.isfinite(new.float()).all()
    diff = (new.float() - base.float())[mask].abs()
    ulp = torch.finfo(torch.bfloat16).eps * base.float()[mask].abs()   # at most one ulp of the value's binade
    assert (diff <= ulp).all() and (diff > 0).all()


def test_the_same_seed_gives_the_same_version_and_another_seed_another():
    base = _random((1000, 33), torch.bfloat16, seed=5)
    a, b, c = base.clone(), base.clone(), base.clone()
    perturb_(a, 0.02, torch.Generator().manual_seed(11))
    perturb_(b, 0.02, torch.Generator().manual_seed(11))
    perturb_(c, 0.02, torch.Generator().manual_seed(12))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))


def test_positions_are_distinct_sorted_and_in_range():
    pos = changed_positions(10_000, 0.3, torch.Generator().manual_seed(2))
    assert pos.numel() == 3000 and pos.unique().numel() == 3000
    assert bool((pos[1:] > pos[:-1]).all()) and int(pos[0]) >= 0 and int(pos[-1]) < 10_000
    assert changed_positions(10, 0.01, torch.Generator()).numel() == 0   # rounds to none


def test_measured_density_is_the_studys_and_bad_densities_are_refused():
    assert 0.015 < parse_density("measured") < 0.025   # lr 1e-6, steps 2-8: 1.87 % (docs/deltas.md)
    assert parse_density("0.02") == 0.02
    for bad in ("0", "-0.1", "1.5"):
        with pytest.raises(ValueError, match="delta-density"):
            parse_density(bad)


def test_the_host_memory_estimate_counts_every_copy_and_the_cpu_engine():
    assert host_bytes_needed(1 << 30, 1, "cuda") == 5 << 30
    assert host_bytes_needed(1 << 30, 2, "cpu") == 12 << 30
