"""The delta's fused Triton kernels (``ckpt_core/delta/_kernels.py``) against the torch ops they replace:
lin64's row sums and the apply's gather-and-scatter, bit for bit, and the kernels actually run."""

import pytest
import torch

from ckpt_core.delta import _kernels
from ckpt_core.delta.encode import Decoded, apply_decoded, as_words, undo_decoded
from ckpt_core.delta.lin64 import CHUNK, ROW, lin64

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def triton_on_cuda(monkeypatch):
    monkeypatch.setenv("CKPT_DELTA_TRITON", "1")   # off by default (docs/deltas.md: slower end to end)
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if _kernels.kernels(torch.device("cuda")) is None:
        pytest.skip("Triton does not import here: the torch ops are the only path")
    yield
    assert not _kernels._STATE["failed"], "a kernel failed and the torch ops took over"


def _bytes(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("n", [8 * ROW * 3 + 5, 8 * CHUNK + 8 * ROW + 3, 8 * ROW - 8, 16 * ROW + 4, 8])
def test_the_fused_row_sums_give_the_torch_ops_and_the_hosts_digest(n, monkeypatch):
    """At row and chunk borders, with a zero-padded last word, on an aligned and a misaligned view."""
    raw = _bytes(n + 8, seed=n).cuda()
    for view in (raw[:n], raw[3: n + 3]):
        fused = lin64(view)
        monkeypatch.setenv("CKPT_DELTA_TRITON", "0")
        assert lin64(view) == fused == lin64(view.cpu())   # torch ops on the device; numpy on the host
        monkeypatch.setenv("CKPT_DELTA_TRITON", "1")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float64], ids=str)
def test_the_fused_swap_writes_what_the_torch_ops_write_and_returns_the_old_values(dtype, monkeypatch):
    n = 1_000_003
    gen = torch.Generator().manual_seed(7)
    size = torch.empty(0, dtype=dtype).element_size()
    base = _bytes(n * size, seed=11).view(dtype).cuda()
    pos = torch.randperm(n, generator=gen)[: n // 37].sort().values.cuda()
    values = _bytes(pos.numel() * size, seed=13).view(dtype).cuda()
    word = as_words(base).dtype   # what decode gives: the item size's integers (uint8 for 1 byte)
    d = Decoded("idx", dtype, (n,), pos.numel(), "lin64:0", pos, values.view(word))
    got, want = base.clone(), base.clone()
    old = apply_decoded(got, d)
    monkeypatch.setenv("CKPT_DELTA_TRITON", "0")
    old_torch = apply_decoded(want, d)
    monkeypatch.setenv("CKPT_DELTA_TRITON", "1")
    assert torch.equal(got.view(word), want.view(word)) and torch.equal(old, old_torch)
    assert torch.equal(got.view(word)[pos], values.view(word))
    undo_decoded(got, d, old)
    assert torch.equal(got.view(word), base.view(word))
    assert _kernels.scatter_swap(base.clone().view(word), pos, values.view(word)) is not None, "the kernel did not run"
