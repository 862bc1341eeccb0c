"""The hello's plan is encoded once by the PS and validated once per plan by the worker."""

import json

import pytest

from ckpt_core.wire import protocol as proto
from ckpt_core.errors import ProtocolError

BUCKETS = [[("a", "BF16", (4, 4), 0), ("b", "F32", (3,), 256)], [("c", "F8_E4M3", (10,), 0)]]


def hello(digest=None, *, slot_bytes=1024, plan=BUCKETS, update="u-1"):
    text, d = proto.plan_fragment(plan)
    frame = proto.encode_hello(update, device_kind="cpu", buffer={"kind": "cpu", "nbytes": 4096},
                               slot_bytes=slot_bytes, num_slots=4, plan_json=text, plan_digest=digest or d)
    return proto.decode(frame, expect=("hello",))


def test_the_spliced_frame_is_the_same_message_as_a_plainly_encoded_one():
    msg = hello()
    plain = json.loads(proto.encode("hello", "u-1", **proto.hello_fields("cpu", {"kind": "cpu", "nbytes": 4096},
                                                                        1024, 4, BUCKETS)))
    assert {k: v for k, v in msg.items() if k != "plan_digest"} == plain


def test_a_plan_is_validated_once_and_then_taken_from_the_cache():
    proto._plan_cache.clear()
    first = proto.parse_hello(hello())
    msg = hello()
    msg["buckets"] = "not even a list"      # the cached, already validated plan is used
    again = proto.parse_hello(msg)
    assert again.buckets == first.buckets and [t.name for t in first.buckets[0]] == ["a", "b"]


def test_the_cache_is_keyed_by_slot_size_so_offsets_are_revalidated_for_smaller_slots():
    proto._plan_cache.clear()
    proto.parse_hello(hello(slot_bytes=1024))
    with pytest.raises(ProtocolError, match="outside a slot"):
        proto.parse_hello(hello(slot_bytes=64, plan=BUCKETS))


def test_an_invalid_plan_is_never_cached():
    proto._plan_cache.clear()
    bad = [[("a", "BF16", (4, 4), 4096)]]
    for _ in range(2):
        with pytest.raises(ProtocolError):
            proto.parse_hello(hello(plan=bad, slot_bytes=1024))
    assert not proto._plan_cache
