"""Which payloads of a bucket the gap16 route takes when their targets overlap (``_gap_route.take``), in
process: one launch writes every target it takes at once, so a target that overlaps one taken goes the
usual way (tied names of one tensor, views into one storage), whatever the order; the search is per
target, not a scan of the ones taken (a MoE bucket has thousands)."""

import torch

from ckpt_core.delta import _gap_route
from ckpt_core.delta._kernels import disjoint


class _Kernels:
    word = {torch.int16: "i16", torch.int32: "i32"}


def _take(monkeypatch, storage: torch.Tensor, spans: list[tuple[int, int]]):
    """``take`` over payloads whose targets are ``storage[lo:hi]`` (the parse stubbed: only the targets
    matter here). Returns the indices taken and left."""
    monkeypatch.setattr(_gap_route, "kernels", lambda device, use="check": _Kernels())

    def parse(index, name, raw, head, target):
        return _gap_route.Item(index, name, target, raw, "", "", raw.data_ptr(), target.data_ptr(), torch.int16, 1,
                               target.numel(), raw.numel())
    monkeypatch.setattr(_gap_route, "parse", parse)
    views = {f"t{i}": storage[lo:hi] for i, (lo, hi) in enumerate(spans)}
    named = [(n, None, n, None) for n in views]
    raws = [torch.zeros(8, dtype=torch.uint8) for _ in views]
    route, rest = _gap_route.take(named, raws, [b""] * len(views), views.get)
    taken = [] if route is None else [it.index for it in route.items]
    return taken, rest


def test_a_target_overlapping_one_taken_goes_the_usual_way_in_any_order(monkeypatch):
    s = torch.zeros(100, dtype=torch.bfloat16)
    # 0: [10,20); 1: [30,40); 2: the same as 0 (a tied name); 3: straddles 0's end; 4: inside 1; 5: touches 0
    # and 1 without overlapping; 6: ends where 0 starts; 7: covers 0 and 1; 8: far off
    spans = [(10, 20), (30, 40), (10, 20), (15, 25), (32, 34), (20, 30), (0, 10), (5, 45), (60, 70)]
    taken, rest = _take(monkeypatch, s, spans)
    assert taken == [0, 1, 5, 6, 8] and rest == [2, 3, 4, 7]
    taken, rest = _take(monkeypatch, s, spans[::-1])   # the same ranges, last first
    # reversed: 0 (60,70) 1 (5,45) 2 (0,10) 3 (20,30) 4 (32,34) 5 (15,25) 6 (10,20) 7 (30,40) 8 (10,20)
    assert taken == [0, 1] and rest == [2, 3, 4, 5, 6, 7, 8]


def test_thousands_of_disjoint_targets_in_any_order_are_all_taken_and_one_overlap_among_them_is_not(monkeypatch):
    n = 6000
    s = torch.zeros(n * 4 + 8, dtype=torch.bfloat16)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    spans = [(4 * i, 4 * i + 4) for i in order]
    taken, rest = _take(monkeypatch, s, spans)
    assert taken == list(range(n)) and rest == []
    at = order.index(2500)
    spans.insert(at + 1, (4 * 2500 + 3, 4 * 2500 + 5))   # straddles the border of two taken ones
    spans.append((4 * n, 4 * n + 8))                      # past every one of them
    taken, rest = _take(monkeypatch, s, spans)
    assert rest == [at + 1] and len(taken) == n + 1


def test_disjoint_keeps_the_first_of_overlapping_ranges_and_the_order():
    assert disjoint([]) == ([], [])
    assert disjoint([(0, 10), (10, 20), (5, 6), (20, 20), (19, 21), (0, 10), (30, 40), (25, 31)]) == \
        ([0, 1, 3, 6], [2, 4, 5, 7])
