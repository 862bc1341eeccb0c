"""The wire codec: what goes in comes out, and every malformed frame is a ProtocolError."""

from __future__ import annotations

import json
import pickle

import pytest

from ckpt_core.wire import protocol as proto
from ckpt_core.errors import ProtocolError
from support.wire import hello_fields

UPDATE = "run-7"
SLOT = 4096


def frame(**fields) -> bytes:
    return json.dumps(fields).encode()


def hello_msg(**over) -> dict:
    fields = hello_fields("cpu", {"kind": "cpu", "path": "/dev/shm/ckpt-x", "nbytes": 2 * SLOT}, SLOT, 2,
                                [[("a", "BF16", (4, 8), 0), ("b", "F32", (3,), 64)], [("c", "F8_E4M3", (), 0)]])
    msg = json.loads(proto.encode("hello", UPDATE, **fields))
    msg.update(over)
    return msg


# ------------------------------------------------------------------ round trips
def test_every_kind_round_trips_through_encode_and_decode():
    for kind, fields in [("hello", {"device_kind": "cpu"}), ("bucket", {"index": 3, "slot": 1}),
                         ("end", {"keep_buffer": True}), ("abort", {"reason": "rank 1: boom ü"}),
                         ("ready", {}), ("done", {"index": 0}), ("finished", {}),
                         ("error", {"index": -1, "traceback": "Traceback...\n  line"})]:
        msg = proto.decode(proto.encode(kind, UPDATE, **fields), expect=(kind,), update=UPDATE)
        assert msg == {"v": proto.VERSION, "kind": kind, "update": UPDATE, **fields}


def test_a_hello_round_trips_into_a_validated_plan():
    h = proto.parse_hello(proto.decode(proto.encode("hello", UPDATE, **{k: v for k, v in hello_msg().items()
                                                                       if k not in ("v", "kind", "update")}),
                                       expect=("hello",)))
    assert (h.update, h.device_kind, h.slot_bytes, h.num_slots) == (UPDATE, "cpu", SLOT, 2)
    assert h.buckets[0] == (proto.WireTensor("a", "BF16", (4, 8), 0, 64), proto.WireTensor("b", "F32", (3,), 64, 12))
    assert h.buckets[1] == (proto.WireTensor("c", "F8_E4M3", (), 0, 1),)
    assert proto.parse_bucket({"index": 1, "slot": 1}, h) == (1, 1)


def test_a_hello_names_whose_slices_it_carries_also_when_its_plan_was_cached():
    """The slice plan and engine rank a PS routed travel outside the buckets' wire plan: a cached plan
    (same digest) never lends a hello another update's routing."""
    args = dict(device_kind="cpu", buffer={"kind": "cpu", "path": "/dev/shm/x", "nbytes": SLOT}, slot_bytes=SLOT,
                num_slots=1, plan_json='[[["a","F32",[4],0]]]', plan_digest="plan-cache-slices")
    def parsed(routed):
        head, plan = proto.encode_hello(UPDATE, **args, slices=routed)
        return proto.parse_hello(proto.decode(head, expect=("hello",)), plan)

    hellos = [parsed(routed) for routed in (("ab" * 20, 1), ("ab" * 20, 0), None)]
    assert [h.slices for h in hellos] == [("ab" * 20, 1), ("ab" * 20, 0), None]
    assert hellos[0].buckets == hellos[2].buckets == (((proto.WireTensor("a", "F32", (4,), 0, 16)),),)


def test_decode_without_an_update_id_accepts_any_update():
    assert proto.decode(proto.encode("ready", "other"), expect=("ready",))["update"] == "other"


def test_the_update_id_of_a_refused_frame_is_recovered_when_it_has_one():
    assert proto.update_id_of(frame(v=99, kind="hello", update="u-9")) == "u-9"
    for bad in (b"\xff", b"[]", frame(v=1, update=5), b"[" * 100000):
        assert proto.update_id_of(bad) is None


# ------------------------------------------------------------------ decode rejections
@pytest.mark.parametrize("raw, words", [
    (b"\xff\xfe\x00garbage", "not UTF-8 JSON"),
    (b"{not json", "not UTF-8 JSON"),
    (b"", "not UTF-8 JSON"),
    (b"[" * 100000 + b"]" * 100000, "not UTF-8 JSON"),        # nesting that would blow the parser's stack
    (pickle.dumps({"v": 1, "kind": "hello"}), "not UTF-8 JSON"),
    (b"[1, 2]", "JSON list"),
    (b'"hello"', "JSON str"),
    (b"null", "JSON NoneType"),
    (frame(kind="hello", update=UPDATE), "version None"),
    (frame(v=2, kind="hello", update=UPDATE), "version 2"),
    (frame(v="1", kind="hello", update=UPDATE), "version '1'"),
    (frame(v=True, kind="hello", update=UPDATE), "version True"),
    (frame(v=1.0, kind="hello", update=UPDATE), "version 1.0"),
    (frame(v=1, update=UPDATE), "kind None"),
    (frame(v=1, kind="bucket", update=UPDATE), "kind 'bucket'"),
    (frame(v=1, kind=["hello"], update=UPDATE), "kind ['hello']"),
    (frame(v=1, kind="hello"), "no update id"),
    (frame(v=1, kind="hello", update=7), "no update id"),
])
def test_decode_refuses(raw, words):
    with pytest.raises(ProtocolError, match=words.replace("[", r"\[").replace("(", r"\(")):
        proto.decode(raw, expect=("hello",))


def test_decode_refuses_another_updates_message():
    with pytest.raises(ProtocolError, match="belongs to update 'old'"):
        proto.decode(proto.encode("bucket", "old", index=0, slot=0), expect=("bucket",), update=UPDATE)


def test_decode_refuses_a_frame_over_the_size_limit(monkeypatch):
    monkeypatch.setattr(proto, "MAX_FRAME_BYTES", 64)
    with pytest.raises(ProtocolError, match="exceeds the limit of 64"):
        proto.decode(proto.encode("abort", UPDATE, reason="x" * 100), expect=("abort",))


# ------------------------------------------------------------------ parse_hello rejections
@pytest.mark.parametrize("over, words", [
    ({"update": ""}, "no update id"),
    ({"update": None}, "no update id"),
    ({"device_kind": None}, "lacks device_kind or buffer"),
    ({"device_kind": 3}, "lacks device_kind or buffer"),
    ({"buffer": "/dev/shm/x"}, "lacks device_kind or buffer"),
    ({"num_slots": 0}, "'num_slots' = 0"),
    ({"num_slots": 1025}, "'num_slots' = 1025"),
    ({"num_slots": True}, "'num_slots' = True"),
    ({"num_slots": "2"}, "'num_slots' = '2'"),
    ({"slot_bytes": 0}, "'slot_bytes' = 0"),
    ({"slot_bytes": -4096}, "'slot_bytes' = -4096"),
    ({"slot_bytes": 1.5}, "'slot_bytes' = 1.5"),
    ({"buffer": {"nbytes": SLOT}}, "cannot hold 2 slots"),
    ({"buffer": {}}, "buffer of None bytes"),
    ({"buffer": {"nbytes": True}, "slot_bytes": 1, "num_slots": 1, "buckets": []}, "buffer of True bytes"),
    ({"buckets": {"0": []}}, "buckets is not a list"),
    ({"buckets": [["a", "BF16", [1], 0]]}, "not \\[name, dtype, shape, offset\\]"),
    ({"buckets": ["a"]}, "bucket is not a list"),
    ({"buckets": [[["a", "BF16", [1]]]]}, "not \\[name, dtype, shape, offset\\]"),
    ({"buckets": [[["", "BF16", [1], 0]]]}, "not a non-empty string"),
    ({"buckets": [[[7, "BF16", [1], 0]]]}, "not a non-empty string"),
    ({"buckets": [[["a", "Q4", [1], 0]]]}, "unknown dtype 'Q4'"),
    ({"buckets": [[["a", None, [1], 0]]]}, "unknown dtype None"),
    ({"buckets": [[["a", "BF16", 4, 0]]]}, "invalid shape"),
    ({"buckets": [[["a", "BF16", [-1], 0]]]}, "invalid shape"),
    ({"buckets": [[["a", "BF16", [2.0], 0]]]}, "invalid shape"),
    ({"buckets": [[["a", "BF16", [True], 0]]]}, "invalid shape"),
    ({"buckets": [[["a", "BF16", [1], -2]]]}, "outside a slot"),
    ({"buckets": [[["a", "BF16", [1], "0"]]]}, "outside a slot"),
    ({"buckets": [[["a", "BF16", [1], False]]]}, "outside a slot"),
    ({"buckets": [[["a", "BF16", [SLOT // 2], 2]]]}, "outside a slot"),       # one element past the end
    ({"buckets": [[["a", "F32", [1], SLOT]]]}, "outside a slot"),
    ({"buckets": [[["a", "F32", [1 << 62, 1 << 62], 0]]]}, "outside a slot"),
    ({"buckets": [[["a", "F32", [1], 2]]]}, "not aligned"),
    ({"slices": "ab12"}, "hello.slices"),
    ({"slices": {"plan": "ab12"}}, "hello.slices"),
    ({"slices": {"plan": "", "rank": 0}}, "hello.slices"),
    ({"slices": {"plan": "a" * 129, "rank": 0}}, "hello.slices"),
    ({"slices": {"plan": 7, "rank": 0}}, "hello.slices"),
    ({"slices": {"plan": "ab12", "rank": -1}}, "hello.slices"),
    ({"slices": {"plan": "ab12", "rank": True}}, "hello.slices"),
    ({"slices": {"plan": "ab12", "rank": 1.0}}, "hello.slices"),
    ({"slices": {"plan": "ab12", "rank": 0, "more": 1}}, "hello.slices"),
])
def test_parse_hello_refuses(over, words):
    with pytest.raises(ProtocolError, match=words):
        proto.parse_hello(hello_msg(**over))


def test_parse_hello_refuses_a_tensor_in_a_later_bucket_too():
    good = hello_msg()["buckets"][0]
    with pytest.raises(ProtocolError, match="'late'"):
        proto.parse_hello(hello_msg(buckets=[good, good, [["late", "F32", [SLOT], 0]]]))


# ------------------------------------------------------------------ parse_bucket rejections
@pytest.mark.parametrize("fields, words", [
    ({"slot": 0}, "'index' = None"),
    ({"index": 2, "slot": 0}, "'index' = 2"),           # two buckets: 0 and 1
    ({"index": -1, "slot": 0}, "'index' = -1"),
    ({"index": True, "slot": 0}, "'index' = True"),
    ({"index": "0", "slot": 0}, "'index' = '0'"),
    ({"index": 0}, "'slot' = None"),
    ({"index": 0, "slot": 2}, "'slot' = 2"),             # two slots: 0 and 1
    ({"index": 0, "slot": -1}, "'slot' = -1"),
    ({"index": 0, "slot": 0.0}, "'slot' = 0.0"),
])
def test_parse_bucket_refuses(fields, words):
    h = proto.parse_hello(hello_msg())
    with pytest.raises(ProtocolError, match=words):
        proto.parse_bucket(fields, h)
