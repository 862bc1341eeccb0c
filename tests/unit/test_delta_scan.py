"""The compiled pass of the registration's compare (``delta/_scan.py``): its positions and lin64 sums are
numpy's for every item size, length and block border; it is built once into the cache folder; without a
compiler, with a failing one, or with ``PS_DELTA_KERNEL=numpy`` there is none (the numpy path runs); a
``PS_DELTA_KERNEL`` of another value is a ConfigError."""

import logging
import shutil

import numpy as np
import pytest
import torch

from support.data import random_bits

from ckpt_core.delta import _scan
from ckpt_core.delta._changes import changed_positions
from ckpt_core.delta.encode import as_words
from ckpt_core.delta.lin64 import _host_ab, _sum_numpy, raw_of
from ckpt_core.errors import ConfigError

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No library loaded yet in this process, and an empty cache folder."""
    monkeypatch.setattr(_scan, "_loaded", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("PS_DELTA_KERNEL", raising=False)
    monkeypatch.delenv("CC", raising=False)
    return tmp_path


@needs_cc
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 7, 4095, _scan.BLOCK_WORDS * 2 + 3, 4096 * 9 + 5])
def test_scan_gives_numpys_positions_and_lin64_sum(fresh, dtype, numel):
    gen = torch.Generator().manual_seed(numel)
    old = random_bits((numel,), dtype, gen)
    new = old.clone()
    ints = new.view(torch.uint8).view(numel, -1)
    pos = torch.randperm(numel, generator=gen)[: max(1, numel // 37)]
    ints[pos, -1] ^= 0x40                       # a change in an item's last byte
    ints[numel - 1, 0] ^= 1                     # and the last item: a tail word
    flat = new.view(torch.uint8).view(-1)       # and single bits anywhere (an item's top bit alone included)
    at = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
    flat[at] ^= (1 << torch.randint(0, 8, at.shape, generator=gen)).to(torch.uint8)
    raw_new, raw_old = raw_of(new)[0].numpy(), raw_of(old)[0].numpy()
    ab = _host_ab(raw_new.size // 8)
    got, change, old_sum = _scan.scan(_scan.kernel(), raw_new, raw_old, new.element_size(), *ab)
    want = changed_positions(as_words(new).numpy(), as_words(old).numpy())
    assert got.dtype == np.int64 and np.array_equal(got, want)
    assert old_sum == _sum_numpy(raw_of(old)[0])
    assert (old_sum + change) % (1 << 64) == _sum_numpy(raw_of(new)[0])   # new's sum: old's plus the change
    # derived: the same positions and change, without old's sum (the caller knows it)
    got_d, change_d, none = _scan.scan(_scan.kernel(), raw_new, raw_old, new.element_size(), *ab, derive=True)
    assert np.array_equal(got_d, want) and change_d == change and none is None


@needs_cc
def test_the_library_is_built_once_into_the_cache_folder_and_loaded_from_it(fresh, monkeypatch):
    lib = _scan.kernel()
    built = list((fresh / "ckpt-engine" / "kernels").glob("delta_scan-*.so"))
    assert lib is not None and len(built) == 1
    assert _scan.kernel() is lib                        # once per process
    monkeypatch.setattr(_scan, "_loaded", {})
    monkeypatch.setattr(_scan.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    assert _scan.kernel() is not None                   # another process: loaded from the cache


def test_psdeltakernel_numpy_builds_nothing(fresh, monkeypatch):
    monkeypatch.setenv("PS_DELTA_KERNEL", "numpy")
    assert _scan.kernel() is None
    assert not (fresh / "ckpt-engine").exists()


def test_no_compiler_means_the_numpy_path(fresh, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-ckpt")
    assert _scan.kernel() is None


def test_a_failing_build_means_the_numpy_path_with_a_warning(fresh, monkeypatch, caplog):
    if shutil.which("false") is None:
        pytest.skip("no `false` command")
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger=_scan.__name__):
        assert _scan.kernel() is None
    assert "could not be built" in caplog.text and "numpy instead" in caplog.text
    assert not list((fresh / "ckpt-engine" / "kernels").glob("*.so"))


def test_another_psdeltakernel_is_a_config_error(fresh, monkeypatch):
    monkeypatch.setenv("PS_DELTA_KERNEL", "fast")
    with pytest.raises(ConfigError, match="PS_DELTA_KERNEL must be 'auto' or 'numpy', got 'fast'"):
        _scan.kernel()
