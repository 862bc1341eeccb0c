"""The worker's batched views of a bucket (``wire/views.py``, issue 38): a bucket's tensors grouped once
per plan into progressions of one dtype and shape, each viewed with one ``as_strided`` and ``unbind``,
are exactly the views the per-tensor route makes, in the plan's order, for any dtype, shape and slot."""

import json
import math
import random

import pytest
import torch

from ckpt_core.checkpoint.safetensors import WIRE_DTYPES
from ckpt_core.wire import protocol as proto
from ckpt_core.wire.views import Views, plan_views

CODES = ["BF16", "F32", "F16", "U8", "I64", "BOOL", "F8_E4M3", "F64", "I16"]


def random_bucket(rng: random.Random, slot_bytes: int) -> list:
    """[name, dtype, shape, offset] entries as a planner packs them: kinds that repeat at one step
    (experts' gate/up/down interleaved), odd sizes, scalars, empty tensors, unaligned gaps."""
    kinds = []
    for _ in range(rng.randint(1, 4)):
        code = rng.choice(CODES)
        shape = rng.choice([(), (0,), (rng.randint(1, 9),), (rng.randint(1, 5), rng.randint(1, 7)), (2, 3, 5)])
        kinds.append((code, shape))
    entries, at = [], rng.randrange(0, 64)
    for e in range(rng.randint(1, 12)):
        for k, (code, shape) in enumerate(kinds):
            if rng.random() < 0.15:
                continue   # an expert without this kind: the progression breaks there
            size = WIRE_DTYPES[code].itemsize
            at = -(-at // size) * size
            entries.append([f"e{e}.k{k}", code, list(shape), at])
            at += math.prod(shape) * size + rng.choice([0, 0, 0, 2, 8, 256])
    assert at <= slot_bytes
    return entries


def per_tensor(buf: torch.Tensor, base: int, tensors) -> list:
    """The per-tensor route: each tensor's bytes viewed as dtype and shape."""
    return [(t.name, buf[base + t.offset: base + t.offset + t.nbytes].view(WIRE_DTYPES[t.dtype]).view(t.shape))
            for t in tensors]


def same_views(got, want) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), name
        if b.numel():
            assert a.data_ptr() == b.data_ptr(), name
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("seed", range(40))
def test_batched_views_are_the_per_tensor_views_in_the_plan_order(seed):
    rng = random.Random(seed)
    slot = 1 << 14
    entries = random_bucket(rng, slot)
    tensors = tuple(proto._tensor(e, slot) for e in entries)
    raw = torch.randint(0, 256, (3 * slot + 16,), dtype=torch.uint8)
    lead = rng.choice([0, 0, 1, 3, 8])   # a buffer whose start is not aligned to every dtype takes the byte route
    buf = raw[lead: lead + 3 * slot]
    how = plan_views(tensors)
    assert sum(g.n for g in how.groups) == len(tensors)
    for base in (0, slot, 2 * slot, slot + rng.choice([0, 1, 2, 4])):
        try:
            want = per_tensor(buf, base, tensors)
        except RuntimeError as exc:   # misaligned for a dtype: the batched route fails alike, not otherwise
            with pytest.raises(RuntimeError, match="must be divisible by"):
                Views(buf).bucket(base, tensors, how)
            assert "must be divisible by" in str(exc)
            continue
        same_views(Views(buf).bucket(base, tensors, how), want)


def test_a_layer_of_experts_is_one_group_per_kind_and_writes_land_where_the_tensor_is():
    entries, at = [], 0
    for e in range(40):
        for kind, shape in (("gate", [8, 16]), ("up", [8, 16]), ("down", [16, 8])):
            entries.append([f"experts.{e}.{kind}", "BF16", shape, at])
            at += 256
    entries.append(["norm", "F32", [7], at])
    tensors = tuple(proto._tensor(e, 1 << 16) for e in entries)
    how = plan_views(tensors)
    assert [(g.code, g.shape, g.n) for g in how.groups] == [("BF16", (8, 16), 40), ("BF16", (8, 16), 40),
                                                            ("BF16", (16, 8), 40), ("F32", (7,), 1)]
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    got = Views(buf).bucket(0, tensors, how)
    same_views(got, per_tensor(buf, 0, tensors))
    dict(got)["experts.17.up"].fill_(1.0)
    ones = torch.ones(8, 16, dtype=torch.bfloat16).view(torch.uint8).reshape(-1)
    assert torch.equal(buf[(17 * 3 + 1) * 256: (17 * 3 + 1) * 256 + 256], ones) and int(buf.count_nonzero()) == 256


def hello(entries, slot=1 << 14):
    text, digest = proto.plan_fragment([[(n, d, tuple(s), o) for n, d, s, o in entries]])
    head, plan = proto.encode_hello("u-1", device_kind="cpu", buffer={"kind": "cpu", "nbytes": slot}, slot_bytes=slot,
                                    num_slots=1, plan_json=text, plan_digest=digest)
    return proto.parse_hello(json.loads(head), plan)


def test_the_views_are_planned_once_per_plan_and_a_changed_plan_gets_its_own():
    proto._plan_cache.clear()
    a = [["w", "BF16", [4, 4], 0], ["v", "BF16", [4, 4], 32]]
    first, again = hello(a), hello(a)
    assert again.views is first.views and again.views[0].names == ("w", "v")
    changed = hello([["w", "BF16", [2, 8], 0], ["v", "BF16", [4, 4], 64]])   # the checkpoint changed: another plan
    assert changed.views is not first.views
    assert [(g.shape, g.element) for g in changed.views[0].groups] == [((2, 8), 0), ((4, 4), 32)]
    buf = torch.randint(0, 256, (1 << 14,), dtype=torch.uint8)
    same_views(Views(buf).bucket(0, changed.buckets[0], changed.views[0]), per_tensor(buf, 0, changed.buckets[0]))
