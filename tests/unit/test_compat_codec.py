"""The compat codec's pure parts: reply decoding (never unpickling), wire names, frames it encodes."""

from __future__ import annotations

import pickle
import pickletools

import pytest
import torch

import ckpt_sglang
from ckpt_core.wire.stock import (MAX_REPLY_BYTES, WIRES, abort_frame, bucket_frame, check_wire, decode_reply,
                               wire_handles)
from ckpt_core.planning.buckets import Bucket, Placement, TensorMeta
from ckpt_core.errors import ConfigError, ProtocolError


def test_an_empty_reply_is_success_and_text_is_the_workers_traceback():
    assert decode_reply(b"") == ""
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\n\tValueError: ü\r\n"
    assert decode_reply(tb.encode()) == tb


@pytest.mark.parametrize("frame, needle", [
    (pickle.dumps(ValueError("x")), "not unpickled"),
    (b"\xff\xfe\x00garbage", "neither empty nor UTF-8 text"),
    (b"abc\x00def", "not printable"),
    (b"\x1b[31mred", "not printable"),
    (b"x" * (MAX_REPLY_BYTES + 1), "exceeds the limit"),
])
def test_anything_else_is_a_protocol_error(frame, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode_reply(frame)


def test_wires_are_checked_and_stock_handles_use_the_stock_socket_names():
    assert set(WIRES) == {"native", "stock", "stock-0.3"}
    with pytest.raises(ConfigError, match="wire must be one of"):
        check_wire("pickle")
    keys = ["GPU-a", "GPU-b"]
    assert wire_handles("stock", "r1-0", keys) == [("GPU-a", "ipc://@checkpoint-engine-GPU-a-r1-0.sock"),
                                                   ("GPU-b", "ipc://@checkpoint-engine-GPU-b-r1-0.sock")]
    assert wire_handles("native", "r1-0", keys) == [("GPU-a", "ipc://@ckpt-r1-0-0"), ("GPU-b", "ipc://@ckpt-r1-0-1")]


def test_a_bucket_frame_carries_absolute_offsets_torch_dtypes_and_sizes():
    metas = [TensorMeta("a", "BF16", (2, 3), 12, 2, 0, 0), TensorMeta("b", "F32", (4,), 16, 4, 0, 256)]
    bucket = Bucket(owner=0, placements=[Placement(metas[0], 0), Placement(metas[1], 256)], nbytes=272)
    # our own frame, decoded here only to check what the stock worker will read
    items = pickle.loads(bucket_frame(bucket, base=4096))
    assert items == [{"name": "a", "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "offset": 4096},
                     {"name": "b", "dtype": torch.float32, "shape": torch.Size([4]), "offset": 4352}]
    # made once per planned bucket and slot (plans are cached), not per update: no per-tensor pickling
    assert bucket_frame(bucket, base=4096) is bucket_frame(bucket, base=4096)
    assert pickle.loads(bucket_frame(bucket, base=0))[1]["offset"] == 256


def test_the_abort_frame_is_a_runtime_error_carrying_the_reason():
    ops = [(op.name, arg) for op, arg, _ in pickletools.genops(abort_frame("rank 1: boom"))]
    assert ("SHORT_BINUNICODE", "RuntimeError") in ops
    assert any(isinstance(arg, str) and "rank 1: boom" in arg for _, arg in ops)


def test_ckpt_sglang_exports_its_requester_and_its_mode_names_only():
    """The package's public names: the requester, its report, and the mode names a driver's
    argparse offers (examples/sglang_update.py); nothing of the wire or the launcher."""
    assert ckpt_sglang.__all__ == ["SglangClient", "UpdateReport", "BUSY_MODES", "PAUSE_MODES",
                                   "COMMIT_PAUSE_MODES"]
    assert all(isinstance(getattr(ckpt_sglang, n), tuple) for n in ckpt_sglang.__all__[2:])
