"""A bucket's position check (``delta/_bucket_checks.positions_bad``) flags exactly the lists a
one-by-one check flags: out of ``[0, numel)`` at either end, or not strictly increasing anywhere."""

import pytest
import torch

from ckpt_core.delta._bucket_checks import gap_positions, position_bad, positions_bad
from ckpt_core.delta.encode import decode, decode_many, encode_tensor


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


def _gap_bytes(gaps: list[int], offset: int = 0) -> torch.Tensor:
    raw = torch.tensor(gaps, dtype=torch.int32).to(torch.uint16).view(torch.uint8)
    if offset:   # the same bytes at an odd offset of their storage (a payload's section may be)
        raw = torch.cat([torch.zeros(offset, dtype=torch.uint8), raw])[offset:]
    return raw


@pytest.mark.parametrize("seed", range(6))
def test_a_bucket_s_gap_lists_decode_together_as_each_alone(seed):
    gen = torch.Generator().manual_seed(seed)
    lists = []
    for i in range(int(torch.randint(2, 9, (1,), generator=gen))):
        n = int(torch.randint(0, 40, (1,), generator=gen)) if i % 3 else int(torch.randint(1, 40, (1,), generator=gen))
        lists.append(torch.randint(1, 65536, (n,), generator=gen).tolist())
    raws = [_gap_bytes(g, offset=i % 2) for i, g in enumerate(lists)]
    got = gap_positions(raws)
    assert [p.dtype for p in got] == [torch.int64] * len(lists)
    for g, p in zip(lists, got):
        want, at = [], 0
        for x in g:
            at += x
            want.append(at)
        assert p.tolist() == want


def test_a_gap_dropped_in_one_list_shifts_that_list_only():
    lists = [[3, 1, 4], [1, 5, 9, 2], [6, 5]]
    raws = [_gap_bytes(g) for g in lists]
    base = [p.tolist() for p in gap_positions(raws)]
    raws[1] = _gap_bytes([1, 9, 2])
    after = [p.tolist() for p in gap_positions(raws)]
    assert after[0] == base[0] and after[2] == base[2] and after[1] == [1, 10, 12]


def test_decode_many_of_gap16_payloads_equals_each_decoded_alone():
    gen = torch.Generator().manual_seed(7)
    payloads = []
    for i, numel in enumerate([4096, 333, 70_000, 5000]):
        base = torch.randint(-2**15, 2**15, (numel,), dtype=torch.int16, generator=gen).view(torch.bfloat16)
        new = base.clone()
        new.view(torch.int16)[torch.randperm(numel, generator=gen)[: max(1, numel // 50)]] ^= 1
        payload, info = encode_tensor(new, base, force="gap16")
        payloads.append((f"t{i}", payload))
    many = decode_many(payloads)
    for (name, payload), d in zip(payloads, many):
        alone = decode(payload, name)
        assert d.encoding == "gap16" and torch.equal(d.positions, alone.positions)
        assert torch.equal(d.values, alone.values)
