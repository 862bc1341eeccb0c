"""Our safetensors reader rejects every malformed file with figures and reads valid ones bit-exact."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_core.checkpoint import hf_dir
from ckpt_core.checkpoint import safetensors as st
from ckpt_core.errors import CheckpointFormatError


def _file_bytes(header: dict | bytes, data: bytes = b"", *, declared: int | None = None) -> bytes:
    """Hand-made file: u64 LE length, the header (JSON-encoded unless raw bytes), the data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if declared is None else declared) + text + data


def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so comparisons are bit-exact (NaNs, -0.0, float8 included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_tensors() -> dict[str, torch.Tensor]:
    return {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "fp16": torch.randn(7).to(torch.float16),
        "fp32": torch.randn(2, 3, 4),
        "fp8": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "i64": torch.randint(-(2**62), 2**62, (5,), dtype=torch.int64),
        "mask": torch.randint(0, 2, (9,)).bool(),
        "scalar": torch.randn(()),
        "empty": torch.empty(0, 3, dtype=torch.float16),
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert torch.equal(_as_bytes(g), _as_bytes(w)), name


F32x2 = bytes(8)  # data for one F32[2] entry at [0, 8)

CORRUPT = [
    # (id, file bytes, message fragment, tensor named by the error)
    ("shorter-than-prefix", b"\x01\x02\x03", "file is 3 bytes, shorter than the 8-byte", None),
    ("header-length-zero", _file_bytes(b"", b"{}"), "header length is 0", None),
    ("header-past-eof", _file_bytes(b"{}", declared=100),
     "the header length its first 8 bytes declare runs past the end of the file (10 bytes)", None),
    ("header-over-limit-wins-over-eof", _file_bytes(b"{}", declared=100 * 2**20),
     "the header length its first 8 bytes declare exceeds the limit 67108864 bytes", None),
    ("not-utf8", _file_bytes(b'{"w\xff": 1}'), "header is not UTF-8", None),
    ("not-json", _file_bytes(b'{"w": '), "header is not JSON", None),
    ("json-list", _file_bytes(b"[1, 2]"), "header is a JSON list, not an object", None),
    ("entry-not-object", _file_bytes({"w": [1]}), "header entry is a JSON list", "w"),
    ("missing-key", _file_bytes({"w": {"dtype": "F32", "shape": [2]}}, F32x2),
     "expected ['data_offsets', 'dtype', 'shape']", "w"),
    ("unknown-key", _file_bytes({"w": {**_entry(), "order": "big"}}, F32x2),
     "['data_offsets', 'dtype', 'order', 'shape']", "w"),
    ("dtype-not-str", _file_bytes({"w": _entry(dtype=4)}, F32x2), "dtype is 4, not a string", "w"),
    ("unknown-dtype", _file_bytes({"w": _entry(dtype="F128")}, F32x2),
     "unknown dtype 'F128'; known: F64, F32, F16, BF16", "w"),
    ("shape-not-list", _file_bytes({"w": {**_entry(), "shape": 2}}, F32x2),
     "shape 2 is not a list of non-negative integers", "w"),
    ("shape-negative", _file_bytes({"w": _entry(shape=(-2,))}, F32x2), "shape [-2]", "w"),
    ("shape-bool", _file_bytes({"w": _entry(shape=(True, 2))}, F32x2), "shape [True, 2]", "w"),
    ("shape-float", _file_bytes({"w": _entry(shape=(2.0,))}, F32x2), "shape [2.0]", "w"),
    ("offsets-one-int", _file_bytes({"w": _entry(offsets=(0,))}, F32x2),
     "data_offsets [0] is not a list of two non-negative integers", "w"),
    ("offsets-strings", _file_bytes({"w": _entry(offsets=("0", "8"))}, F32x2),
     "data_offsets ['0', '8']", "w"),
    ("offsets-negative", _file_bytes({"w": _entry(offsets=(-8, 0))}, F32x2),
     "data_offsets [-8, 0]", "w"),
    ("metadata-not-dict", _file_bytes({"__metadata__": "fp8"}), "__metadata__ must map", None),
    ("metadata-int-value", _file_bytes({"__metadata__": {"step": 10}}),
     "__metadata__ must map strings to strings, got {'step': 10}", None),
    ("metadata-null", _file_bytes({"__metadata__": None}), "__metadata__ must map", None),
    ("begin-after-end", _file_bytes({"w": _entry(offsets=(8, 0))}, F32x2),
     "data_offsets begin 8 > end 0", "w"),
    ("end-past-data", _file_bytes({"w": _entry(offsets=(0, 8))}, bytes(6)),
     "tensor bytes [0, 8) run past the end of the data area (6 bytes)", "w"),
    ("size-mismatch", _file_bytes({"w": _entry(shape=(3,), offsets=(0, 8))}, F32x2),
     "data_offsets span 8 bytes but F32[3] needs 12", "w"),
    ("overlap", _file_bytes({"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(4, 12))}, bytes(12)),
     "bytes [", "b"),
    ("overlap-contained", _file_bytes(
        {"big": _entry(shape=(4,), offsets=(0, 16)), "small": _entry(dtype="F16", offsets=(4, 8))},
        bytes(16)), "overlap tensor 'big'", "small"),
    ("duplicate-name", _file_bytes(
        b'{"w": ' + json.dumps(_entry()).encode() + b', "w": ' + json.dumps(_entry()).encode()
        + b"}", F32x2), "duplicate key 'w' in the JSON header", None),
    ("duplicate-metadata-key", _file_bytes(b'{"__metadata__": {"k": "a", "k": "b"}}'),
     "duplicate key 'k'", None),
    ("empty-name", _file_bytes({"": _entry()}, F32x2), "tensor name is empty", None),
]


@pytest.mark.parametrize("blob,fragment,tensor", [c[1:] for c in CORRUPT],
                         ids=[c[0] for c in CORRUPT])
def test_a_corrupt_file_is_rejected_with_a_message_that_names_the_problem(
        tmp_path, blob, fragment, tensor):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointFormatError) as info:
        st.read_header(path)
    assert fragment in str(info.value)
    assert info.value.path == str(path)
    assert info.value.tensor == tensor
    # The pure core gives the same verdict on the same bytes.
    with pytest.raises(CheckpointFormatError) as pure:
        st.parse_header_bytes(blob, file_size=len(blob))
    assert fragment in str(pure.value)


def test_third_party_errors_are_translated_and_chained(tmp_path):
    blob = _file_bytes(b'{"w": ')
    with pytest.raises(CheckpointFormatError) as info:
        st.parse_header_bytes(blob, file_size=len(blob))
    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def test_an_oversized_declared_header_is_refused_before_it_is_read(tmp_path):
    # A sparse file really holds the 100 MB the prefix declares; had the reader read and
    # parsed it, the error would be about JSON, not the limit.
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100 * 2**20))
        f.truncate(8 + 100 * 2**20)
    with pytest.raises(CheckpointFormatError,
                       match="the header length its first 8 bytes declare exceeds the limit 67108864 bytes"):
        st.read_header(path)


def test_the_header_limit_can_be_set_per_call(tmp_path):
    path = tmp_path / "small.safetensors"
    path.write_bytes(_file_bytes({"w": _entry()}, F32x2))
    with pytest.raises(CheckpointFormatError, match=r"exceeds the limit 16 bytes"):
        st.read_header(path, max_header_bytes=16)
    assert [e.name for e in st.read_header(path, max_header_bytes=1024).tensors] == ["w"]


def test_a_truncated_copy_names_the_tensor_whose_bytes_run_past_the_end(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(_random_tensors(), str(good))
    last = st.read_header(good).tensors[-1]  # sorted by start: the last one to lose bytes
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(CheckpointFormatError, match="run past the end of the data area") as info:
        st.read_header(cut)
    assert info.value.tensor == last.name


def test_files_from_the_safetensors_package_parse_and_load_bit_exact(tmp_path):
    want = _random_tensors()
    path = tmp_path / "ref.safetensors"
    save_file(want, str(path), metadata={"format": "pt", "step": "7"})

    header = st.read_header(path)
    assert header.metadata == {"format": "pt", "step": "7"}
    assert header.file_size == os.path.getsize(path)
    assert [e.start for e in header.tensors] == sorted(e.start for e in header.tensors)
    for e in header.tensors:
        assert (e.dtype, e.shape) == (want[e.name].dtype, tuple(want[e.name].shape))
        assert e.nbytes == want[e.name].numel() * want[e.name].element_size()

    _assert_same(st.read_tensors(path, header), want)
    mm, mapped = st.map_tensors(path, header)
    _assert_same(mapped, want)
    del mapped
    mm.close()


def test_parse_header_bytes_needs_only_the_header_prefix(tmp_path):
    path = tmp_path / "ref.safetensors"
    save_file(_random_tensors(), str(path))
    blob = path.read_bytes()
    whole = st.parse_header_bytes(blob, file_size=len(blob))
    (n,) = struct.unpack("<Q", blob[:8])
    prefix_only = st.parse_header_bytes(memoryview(blob)[: 8 + n], file_size=len(blob))
    assert whole.tensors == prefix_only.tensors and whole.data_offset == 8 + n
    with pytest.raises(CheckpointFormatError, match=f"buffer holds {8 + n - 1} bytes"):
        st.parse_header_bytes(blob[: 8 + n - 1], file_size=len(blob))


def test_our_writer_round_trips_through_the_safetensors_package(tmp_path):
    want = _random_tensors()
    ours = tmp_path / "ours.safetensors"
    st.write_file(ours, want, metadata={"format": "pt"})
    _assert_same(load_file(str(ours)), want)
    _assert_same(st.read_tensors(ours), want)
    assert st.read_header(ours).metadata == {"format": "pt"}
    assert st.read_header(ours).data_offset % 8 == 0
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_our_writer_lays_data_out_contiguously_in_name_order(tmp_path):
    path = tmp_path / "ordered.safetensors"
    st.write_file(path, {"b": torch.randn(3), "a": torch.randn(2), "c": torch.randn(0)})
    header = st.read_header(path)
    assert [(e.name, e.start - header.data_offset, e.end - header.data_offset)
            for e in header.tensors] == [("a", 0, 8), ("b", 8, 20), ("c", 20, 20)]
    assert header.file_size == header.data_offset + 20


def test_misaligned_tensors_still_map_bit_exact(tmp_path):
    # Name order puts 3 bytes of "a" before "b", so "b" starts at an odd offset.
    want = {"a": torch.randint(0, 256, (3,), dtype=torch.uint8), "b": torch.randn(5)}
    path = tmp_path / "odd.safetensors"
    st.write_file(path, want)
    assert (st.read_header(path).tensors[1].start % 4) != 0
    mm, mapped = st.map_tensors(path)
    _assert_same(mapped, want)
    del mapped
    mm.close()


# The safetensors package's layout rule, case by case: what it accepts we accept, what it rejects we reject.
LAYOUTS = [
    ("contiguous", {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(8, 16))}, 16, True),
    ("zero-length at the end", {"w": _entry(offsets=(0, 8)), "e": _entry(shape=(0,), offsets=(8, 8))}, 8, True),
    ("zero-length first", {"e": _entry(shape=(0,), offsets=(0, 0)), "w": _entry(offsets=(0, 8))}, 8, True),
    ("only a zero-length tensor", {"e": _entry(shape=(0,), offsets=(0, 0))}, 0, True),
    ("no tensors, no data", {}, 0, True),
    ("gap between tensors", {"a": _entry(offsets=(0, 8)), "b": _entry(offsets=(12, 20))}, 20, False),
    ("gap before the first", {"a": _entry(offsets=(4, 12))}, 12, False),
    ("bytes after the last", {"a": _entry(offsets=(0, 8))}, 12, False),
    ("no tensors but data", {}, 4, False),
    ("zero-length inside another", {"w": _entry(offsets=(0, 8)), "e": _entry(shape=(0,), offsets=(4, 4))}, 8, False),
    ("zero-length beyond the data", {"e": _entry(shape=(0,), offsets=(3, 3))}, 3, False),
]


@pytest.mark.parametrize("header, data_size, valid", [c[1:] for c in LAYOUTS], ids=[c[0] for c in LAYOUTS])
def test_the_data_area_must_be_tiled_exactly_as_the_safetensors_package_requires(header, data_size, valid):
    from safetensors.torch import load
    blob = _file_bytes(header, bytes(data_size))
    try:
        load(blob)
        theirs = True
    except Exception:
        theirs = False
    assert theirs == valid, "the table must say what the installed safetensors package does"
    if valid:
        st.parse_header_bytes(blob, file_size=len(blob))
    else:
        with pytest.raises(CheckpointFormatError, match="safetensors format requires"):
            st.parse_header_bytes(blob, file_size=len(blob))


def test_a_deeply_nested_header_is_a_format_error_not_a_recursion_error():
    blob = _file_bytes(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    with pytest.raises(CheckpointFormatError, match="nested") as info:
        st.parse_header_bytes(blob, file_size=len(blob))
    assert isinstance(info.value.__cause__, RecursionError)


def _hf_dir(tmp_path, index: dict | None, shards: dict[str, dict[str, torch.Tensor]]):
    for name, tensors in shards.items():
        st.write_file(tmp_path / name, tensors)
    if index is not None:
        (tmp_path / hf_dir.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return str(tmp_path)


def test_an_index_that_matches_its_shards_lists_them(tmp_path):
    d = _hf_dir(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors"},
                {"s1.safetensors": {"a": torch.randn(3)}, "s2.safetensors": {"b": torch.randn(2)}})
    files = hf_dir.checkpoint_files(d)
    assert files == [os.path.join(d, "s1.safetensors"), os.path.join(d, "s2.safetensors")]
    hf_dir.check_index(hf_dir.read_index(d), [st.read_header(f) for f in files], os.path.join(d, hf_dir.INDEX_NAME))


@pytest.mark.parametrize("entry, needle", [
    ("../outside.safetensors", "outside the checkpoint directory"),
    ("/etc/passwd", "outside the checkpoint directory"),
    ("sub/../../outside.safetensors", "outside the checkpoint directory"),
    ("link.safetensors", "symlink that resolves outside"),
    ("absent.safetensors", "does not exist"),
    (7, "not a non-empty string"),
])
def test_an_index_entry_outside_the_directory_or_missing_is_refused_before_it_is_opened(tmp_path, entry, needle):
    outside = tmp_path / "outside.safetensors"
    st.write_file(outside, {"a": torch.randn(2)})
    d = tmp_path / "model"
    d.mkdir()
    os.symlink(outside, d / "link.safetensors")
    _hf_dir(d, {"a": entry}, {})
    with pytest.raises(CheckpointFormatError, match=needle):
        hf_dir.checkpoint_files(str(d))


def test_a_directory_without_an_index_refuses_a_shard_that_links_outside(tmp_path):
    outside = tmp_path / "outside.safetensors"
    st.write_file(outside, {"a": torch.randn(2)})
    d = tmp_path / "model"
    d.mkdir()
    os.symlink(outside, d / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match="symlink that resolves outside"):
        hf_dir.checkpoint_files(str(d))


def test_a_hub_cache_snapshot_whose_files_link_into_its_blobs_is_accepted(tmp_path):
    blobs, snap = tmp_path / "models--x" / "blobs", tmp_path / "models--x" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    st.write_file(blobs / "f00d", {"a": torch.randn(2)})
    os.symlink("../../blobs/f00d", snap / "model.safetensors")
    assert hf_dir.checkpoint_files(str(snap)) == [str(snap / "model.safetensors")]


@pytest.mark.parametrize("index, needle", [
    ({"a": "s1.safetensors", "b": "s2.safetensors", "c": "s2.safetensors", "z": "s1.safetensors"},
     "which does not hold it"),
    ({"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}, "but it is in 's2.safetensors'"),
    ({"a": "s1.safetensors", "b": "s2.safetensors"}, "not in the index's weight_map"),
])
def test_an_index_that_disagrees_with_its_shards_is_a_format_error(tmp_path, index, needle):
    d = _hf_dir(tmp_path, index, {"s1.safetensors": {"a": torch.randn(3)},
                                  "s2.safetensors": {"b": torch.randn(2), "c": torch.randn(4)}})
    files = hf_dir.checkpoint_files(d)
    with pytest.raises(CheckpointFormatError, match=needle):
        hf_dir.check_index(hf_dir.read_index(d), [st.read_header(f) for f in files], os.path.join(d, hf_dir.INDEX_NAME))


def test_the_map_cannot_be_closed_while_views_are_alive(tmp_path):
    path = tmp_path / "x.safetensors"
    st.write_file(path, {"w": torch.randn(4)})
    mm, mapped = st.map_tensors(path)
    with pytest.raises(BufferError):
        mm.close()  # closing would leave the tensors pointing at unmapped memory
    del mapped
    mm.close()


def test_a_writable_map_writes_through_to_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    st.write_file(path, {"w": torch.randn(4)})
    new = torch.randn(4)
    mm, mapped = st.map_tensors(path, writable=True)
    mapped["w"].copy_(new)
    del mapped
    mm.flush()
    mm.close()
    _assert_same(st.read_tensors(path), {"w": new})


def test_a_file_that_changed_size_since_its_header_was_read_is_rejected(tmp_path):
    path = tmp_path / "x.safetensors"
    st.write_file(path, {"w": torch.randn(4)})
    header = st.read_header(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 4)
    for load in (st.read_tensors, st.map_tensors):
        with pytest.raises(CheckpointFormatError, match=r"file is \d+ bytes but its header"):
            load(path, header)


def test_dtype_tables_are_inverse_and_cover_the_safetensors_codes():
    assert {c: DT for DT, c in st.DTYPE_CODES.items()} == st.DTYPES
    assert {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
            "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"} <= st.DTYPES.keys()
    assert st.DTYPES["F8_E4M3"] is torch.float8_e4m3fn


@pytest.mark.parametrize("tensors,metadata,fragment", [
    ({"w": torch.randn(2).to(torch.complex128)}, None, "cannot store torch.complex128"),
    ({"w": [1.0, 2.0]}, None, "cannot store list"),
    ({"": torch.randn(2)}, None, "invalid tensor name ''"),
    ({"__metadata__": torch.randn(2)}, None, "invalid tensor name '__metadata__'"),
    ({"w": torch.randn(2)}, {"step": 3}, "__metadata__ must map strings to strings"),
], ids=["complex", "not-a-tensor", "empty-name", "reserved-name", "metadata-int"])
def test_the_writer_refuses_what_safetensors_cannot_hold(tmp_path, tensors, metadata, fragment):
    path = tmp_path / "w.safetensors"
    with pytest.raises(CheckpointFormatError) as info:
        st.write_file(path, tensors, metadata)
    assert fragment in str(info.value)
    assert not os.listdir(tmp_path)


def test_the_module_exports_exactly_the_documented_api():
    assert sorted(st.__all__) == sorted([
        "DTYPES", "DTYPE_CODES", "WIRE_DTYPES", "WIRE_CODES", "UNSUPPORTED_CODES", "MAX_HEADER_BYTES", "TensorEntry", "SafetensorsHeader",
        "read_header", "parse_header_bytes", "map_tensors", "read_tensors", "write_file"])
    assert sorted(hf_dir.__all__) == sorted(["INDEX_NAME", "checkpoint_files", "read_index", "check_index"])
    assert st.MAX_HEADER_BYTES == 64 * 1024 * 1024


def test_a_read_that_hits_the_end_of_the_file_early_names_the_tensor(tmp_path):
    # read_tensors only gets here if the file shrinks between the size check and the read.
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(5))
    with open(path, "rb", buffering=0) as f, pytest.raises(
            CheckpointFormatError, match="file ended after 3 of 8 bytes at offset 2") as info:
        st._read_into(f, 2, bytearray(8), str(path), "w")
    assert info.value.tensor == "w"


@pytest.mark.parametrize("code", sorted(st.DTYPES))
def test_every_dtype_code_matches_the_safetensors_package(tmp_path, code):
    # Random bytes reinterpreted: every bit pattern is a valid payload for a byte-exact check.
    dtype = st.DTYPES[code]
    raw = torch.randint(0, 256, (6 * dtype.itemsize,), dtype=torch.uint8)
    want = {"t": raw.view(dtype).reshape(2, 3) if dtype is not torch.bool else raw.bool()[:6]}
    path = tmp_path / "one.safetensors"
    save_file(want, str(path))
    assert st.read_header(path).tensors[0].dtype == dtype
    _assert_same(st.read_tensors(path), want)


def test_mx_scales_complex64_and_fnuz_float8_files_are_read_not_called_corrupt():
    assert st.DTYPES["F8_E8M0"] is torch.float8_e8m0fnu and st.DTYPES["C64"] is torch.complex64
    assert st.DTYPES["F8_E4M3FNUZ"] is torch.float8_e4m3fnuz and st.DTYPES["F8_E5M2FNUZ"] is torch.float8_e5m2fnuz


@pytest.mark.parametrize("code", sorted(st.UNSUPPORTED_CODES))
def test_a_valid_code_we_cannot_carry_is_called_unsupported_not_unknown(tmp_path, code):
    header = json.dumps({"w": {"dtype": code, "shape": [2], "data_offsets": [0, 1]}}).encode()
    path = tmp_path / "sub-byte.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x11")
    with pytest.raises(CheckpointFormatError, match="unsupported") as info:
        st.read_header(path)
    assert "unknown" not in str(info.value) and info.value.tensor == "w"


def test_wire_codes_extend_the_file_codes_with_torch_only_dtypes():
    assert {c: dt for dt, c in st.WIRE_CODES.items()} == st.WIRE_DTYPES
    assert st.DTYPES.items() <= st.WIRE_DTYPES.items()
    assert {torch.complex128, torch.complex32, torch.float4_e2m1fn_x2} <= st.WIRE_CODES.keys()
    assert not set(st.WIRE_DTYPES) & set(st.UNSUPPORTED_CODES)
