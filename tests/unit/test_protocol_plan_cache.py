"""The hello's plan is encoded once by the PS and validated once per plan by the worker."""

import json

import pytest

from ckpt_core.wire import protocol as proto
from ckpt_core.errors import ProtocolError
from support.wire import hello_fields

BUCKETS = [[("a", "BF16", (4, 4), 0), ("b", "F32", (3,), 256)], [("c", "F8_E4M3", (10,), 0)]]


def frames(digest=None, *, slot_bytes=1024, plan=BUCKETS, update="u-1"):
    text, d = proto.plan_fragment(plan)
    return proto.encode_hello(update, device_kind="cpu", buffer={"kind": "cpu", "nbytes": 4096},
                              slot_bytes=slot_bytes, num_slots=4, plan_json=text, plan_digest=digest or d)


def hello(digest=None, **kw):
    """(the hello's fields, its plan frame), as the worker reads them."""
    head, plan = frames(digest, **kw)
    return proto.decode(head, expect=("hello",)), plan


def test_the_two_frames_are_the_same_message_as_a_plainly_encoded_one():
    msg, plan = hello()
    plain = json.loads(proto.encode("hello", "u-1", **hello_fields("cpu", {"kind": "cpu", "nbytes": 4096},
                                                                        1024, 4, BUCKETS)))
    assert {**{k: v for k, v in msg.items() if k != "plan_digest"}, "buckets": json.loads(plan)} == plain


def test_a_plan_is_validated_once_and_then_taken_from_the_cache_without_decoding_it():
    proto._plan_cache.clear()
    first = proto.parse_hello(*hello())
    msg, _ = hello()
    again = proto.parse_hello(msg, b"not even JSON")   # the cached, already validated plan is used
    assert again.buckets == first.buckets and [t.name for t in first.buckets[0]] == ["a", "b"]


def test_a_plan_frame_that_is_not_json_is_refused_when_the_plan_is_new():
    proto._plan_cache.clear()
    msg, _ = hello()
    for bad in (b"not even JSON", b"\xff\xfe", b"[" * 100000):
        with pytest.raises(ProtocolError, match="plan frame is not UTF-8 JSON"):
            proto.parse_hello(msg, bad)
    with pytest.raises(ProtocolError, match="buckets is not a list"):
        proto.parse_hello(msg)                          # no plan at all


def test_a_plan_inline_in_a_one_frame_hello_is_still_read():
    proto._plan_cache.clear()
    msg, plan = hello()
    h = proto.parse_hello({**msg, "buckets": json.loads(plan)})
    assert [t.name for b in h.buckets for t in b] == ["a", "b", "c"]


def test_only_a_hello_may_carry_a_second_frame():
    proto.check_parts({"kind": "hello"}, [b"[]"])
    proto.check_parts({"kind": "bucket"}, [])
    with pytest.raises(ProtocolError, match="a bucket message of 2 frames"):
        proto.check_parts({"kind": "bucket"}, [b"x"])
    with pytest.raises(ProtocolError, match="a hello message of 3 frames"):
        proto.check_parts({"kind": "hello"}, [b"[]", b"x"])


def test_the_cache_is_keyed_by_slot_size_so_offsets_are_revalidated_for_smaller_slots():
    proto._plan_cache.clear()
    proto.parse_hello(*hello(slot_bytes=1024))
    with pytest.raises(ProtocolError, match="outside a slot"):
        proto.parse_hello(*hello(slot_bytes=64, plan=BUCKETS))


def test_an_invalid_plan_is_never_cached():
    proto._plan_cache.clear()
    bad = [[("a", "BF16", (4, 4), 4096)]]
    for _ in range(2):
        with pytest.raises(ProtocolError):
            proto.parse_hello(*hello(plan=bad, slot_bytes=1024))
    assert not proto._plan_cache
