"""A bucket's position check (``delta/_bucket_checks.positions_bad``) flags exactly the lists a
one-by-one check flags: out of ``[0, numel)`` at either end, or not strictly increasing anywhere."""

import pytest
import torch

from ckpt_core.delta._bucket_checks import position_bad, positions_bad


def _lists(gen: torch.Generator, k: int) -> list[tuple[torch.Tensor, int]]:
    out = []
    for _ in range(k):
        numel = int(torch.randint(1, 500, (1,), generator=gen))
        count = int(torch.randint(1, numel + 1, (1,), generator=gen))
        out.append((torch.randperm(numel, generator=gen)[:count].sort().values, numel))
    return out


def _spoil(spans, gen: torch.Generator, how: str) -> None:
    i = int(torch.randint(0, len(spans), (1,), generator=gen))
    pos, numel = spans[i]
    pos = pos.clone()
    if how == "negative":
        pos[0] = -1
    elif how == "past the end":
        pos[-1] = numel
    elif how == "far past":
        pos[-1] = numel + 10_000
    elif how == "repeated" and pos.numel() > 1:
        pos[1] = pos[0]
    elif how == "falling" and pos.numel() > 2:
        pos[1], pos[2] = pos[2].item(), pos[1].item()
    spans[i] = (pos, numel)


@pytest.mark.parametrize("how", ["none", "negative", "past the end", "far past", "repeated", "falling"])
@pytest.mark.parametrize("k", [1, 2, 7])
def test_the_bucket_check_agrees_with_the_check_of_each_list(how, k):
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed * 31 + k)
        spans = _lists(gen, k)
        if how != "none":
            _spoil(spans, gen, how)
        want = any(position_bad(pos, n) for pos, n in spans)
        assert bool(positions_bad(spans)) == want, (how, k, seed)


def test_a_list_that_starts_below_the_previous_lists_end_is_not_flagged():
    """The comparison across two lists' border does not count: each list rises on its own."""
    spans = [(torch.tensor([5, 9, 40]), 41), (torch.tensor([0, 1]), 2)]
    assert not bool(positions_bad(spans))
    assert bool(positions_bad([(torch.tensor([5, 9, 41]), 41), (torch.tensor([0, 1]), 2)]))
