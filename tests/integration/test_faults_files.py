"""Corrupt and hostile safetensors files handed to register_checkpoint(files=...) in a real PS world.

Every defect is a CheckpointFormatError that names the file (and the tensor when there is
one); the source file is byte-identical afterwards and still exists, also when it sits in
/dev/shm and in-place registration with ``unlink_inplace_files=True`` was asked for; nothing
is left registered; and the same name then registers a genuine file and updates the engines.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
import uuid

import pytest
import torch

from ckpt_core.checkpoint.safetensors import write_file
from support.asserts import report_case
from support.data import fresh_tensors, want_digests
from support.engine import EngineFront
from support.world import PsWorld

MiB = 1 << 20


def st(header, data: bytes = b"", *, declared: int | None = None) -> bytes:
    """Hand-made safetensors bytes: u64 header length (or ``declared``), header, data."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h) if declared is None else declared) + h + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


DATA = bytes(range(1, 65))       # 64 non-zero bytes

# case id -> (file bytes, or a callable(path) writing the file; words the message must contain; tensor named)
CASES = {
    "truncated in the data": (st({"w": entry("F32", [16], 0, 64)}, DATA[:40]), ["truncated"], "w"),
    "truncated in the length prefix": (b"\x10\x00\x00\x00", ["shorter than the 8-byte"], None),
    "header length beyond the file": (st({"w": entry("F32", [4], 0, 16)}, DATA[:16], declared=4096),
                                      ["runs past the end of the file"], None),
    "header length zero": (st(b"", DATA, declared=0), ["header length is 0"], None),
    "header not JSON": (st(b'{"w": {"dtype": "F32", "shape": [4], ', DATA), ["not JSON"], None),
    "header not UTF-8": (st(b'{"w\xff\xfe": 1}', DATA), ["not UTF-8"], None),
    "header a JSON list": (st(b"[1, 2, 3]", DATA), ["not an object"], None),
    "duplicate key in one header": (st(b'{"w": ' + json.dumps(entry("F32", [4], 0, 16)).encode() + b', "w": '
                                       + json.dumps(entry("F32", [4], 16, 32)).encode() + b"}", DATA),
                                    ["duplicate key 'w'"], None),
    "unknown dtype": (st({"w": entry("F128", [4], 0, 16)}, DATA), ["unknown dtype 'F128'"], "w"),
    "unsupported dtype": (st({"w": entry("F4", [4], 0, 2)}, DATA[:2]), ["dtype 'F4'", "unsupported"], "w"),
    "offsets out of range": (st({"w": entry("F32", [1 << 38], 0, 1 << 40)}, DATA), ["past the end"], "w"),
    "negative offset": (st({"w": entry("F32", [4], -16, 0)}, DATA), ["non-negative"], "w"),
    "offsets reversed": (st({"w": entry("F32", [0], 16, 0)}, DATA), ["begin 16 > end 0"], "w"),
    "overlapping tensors": (st({"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 8, 24)}, DATA),
                            ["overlap tensor 'a'"], "b"),
    "a gap between tensors": (st({"a": entry("F32", [4], 0, 16), "b": entry("F32", [4], 32, 48)}, DATA[:48]),
                              ["gap of 16 bytes", "safetensors format requires"], "b"),
    "bytes after the last tensor": (st({"w": entry("F32", [4], 0, 16)}, DATA),
                                    ["48 bytes of the data area", "belong to no tensor"], None),
    "bytes not matching shape x dtype": (st({"w": entry("F32", [4], 0, 12)}, DATA), ["needs 16"], "w"),
    "metadata not a string map": (st({"__metadata__": {"step": 7}, "w": entry("F32", [4], 0, 16)}, DATA),
                                  ["__metadata__"], None),
    "100 MB header declared": (st({"w": entry("F32", [4], 0, 16)}, DATA, declared=100 * MiB),
                               ["exceeds the limit"], None),
    # a real 100 MB header: the file is that long (sparse), the prefix says so; refused before reading it
    "100 MB header in a 100 MB file": (lambda p: _sparse_header_file(p, 100 * MiB), ["exceeds the limit"], None),
}


def _sparse_header_file(path: str, n: int) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b'{"w": ')
        f.truncate(8 + n + 16)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MiB), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def world():
    front = EngineFront("cpu", 2)
    ps = PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)})
    shm = f"/dev/shm/ckpt-test-faults-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    try:
        yield ps, front, shm, torch.Generator().manual_seed(2024)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        ps.close()
        front.close()


def folder(where: str, tmp_path, shm: str) -> str:
    return shm if where == "shm" else str(tmp_path)


def register_on_rank0(ps: PsWorld, name: str, files: list[str], where: str):
    kwargs = {"files": files}
    if where == "shm":                      # in place, and the caller even asked to unlink on success
        kwargs.update(use_inplace_pin_memory=True, unlink_inplace_files=True)
    return ps.all("register", (name, kwargs), ranks=[0])[0]


def assert_genuine_update_delivers(ps: PsWorld, front: EngineFront, name: str, base: str, gen) -> None:
    """After the failure, the same name registers a genuine file (rank 0) + tensors (rank 1) and updates."""
    layout = {"good.a": ((64, 33), torch.bfloat16), "good.b": ((1000,), torch.float32),
              "good.c": ((7, 5), torch.float8_e4m3fn)}
    good, other = fresh_tensors(layout, gen), fresh_tensors({"good.r1": ((2048,), torch.float16)}, gen)
    path = os.path.join(base, f"good-{uuid.uuid4().hex[:6]}.safetensors")
    write_file(path, good)
    got = ps.all("register", per_rank={0: (name, {"files": [path]}), 1: (name, {"named_tensors": other})})
    assert all(o.ok for o in got.values()), got
    assert all(o.ok for o in ps.all("gather", name).values())
    got = ps.update(name, front, 30)
    assert all(o.ok for o in got.values()), got
    want = want_digests(good, other)
    for i in range(2):
        assert {n: front.digests(i)[n] for n in want} == want
    assert all(o.ok for o in ps.all("unregister", (name, {})).values())
    os.unlink(path)


@pytest.mark.parametrize("where", ["disk", "shm"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_corrupt_file_is_refused_naming_it_and_left_untouched(world, tmp_path, case, where):
    ps, front, shm, gen = world
    content, words, tensor = CASES[case]
    path = os.path.join(folder(where, tmp_path, shm), f"bad-{uuid.uuid4().hex[:6]}.safetensors")
    if callable(content):
        content(path)
    else:
        with open(path, "wb") as f:
            f.write(content)
    before = sha256(path)
    name = f"bad-{where}"
    t0 = time.monotonic()
    got = register_on_rank0(ps, name, [path], where)
    dt = time.monotonic() - t0
    try:
        assert not got.ok and got.error == "CheckpointFormatError", got
        assert f"file {path!r}" in got.message, got
        for w in words:
            assert w in got.message, got
        if tensor is not None:
            assert f"tensor {tensor!r}" in got.message, got
        assert os.path.exists(path) and sha256(path) == before, "the source file was changed or removed"
        assert name not in ps.all("checkpoints", ranks=[0])[0].value, "a refused checkpoint stays registered"
        report_case(f"safetensors ({where}): {case}", f"CheckpointFormatError: {got.message[:80]}", dt)
        assert_genuine_update_delivers(ps, front, name, folder(where, tmp_path, shm), gen)
    finally:
        os.unlink(path)


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_the_same_tensor_in_two_files_of_one_rank_is_refused_naming_both(world, tmp_path, where):
    ps, front, shm, gen = world
    base = folder(where, tmp_path, shm)
    a, b = (os.path.join(base, f"dup{i}-{uuid.uuid4().hex[:6]}.safetensors") for i in range(2))
    write_file(a, fresh_tensors({"x": ((16,), torch.float32), "shared": ((8,), torch.bfloat16)}, gen))
    write_file(b, fresh_tensors({"y": ((16,), torch.float32), "shared": ((8,), torch.bfloat16)}, gen))
    before = {p: sha256(p) for p in (a, b)}
    got = register_on_rank0(ps, "dup", [a, b], where)
    try:
        assert not got.ok and got.error == "CheckpointFormatError", got
        assert "tensor 'shared'" in got.message and a in got.message and b in got.message, got
        assert {p: sha256(p) for p in (a, b) if os.path.exists(p)} == before, "a source file was changed or removed"
        report_case(f"safetensors ({where}): same tensor in two files of rank 0", "CheckpointFormatError", got.seconds)
        assert_genuine_update_delivers(ps, front, "dup", base, gen)
    finally:
        for p in (a, b):
            os.unlink(p)


def test_the_same_tensor_on_two_ranks_is_refused_at_gather_on_every_rank(world, tmp_path):
    ps, front, shm, gen = world
    paths = {}
    for r in range(2):
        paths[r] = str(tmp_path / f"rank{r}.safetensors")
        write_file(paths[r], fresh_tensors({f"own{r}": ((32,), torch.float16), "both": ((4,), torch.float32)}, gen))
    before = {r: sha256(p) for r, p in paths.items()}
    assert all(o.ok for o in ps.all("register", per_rank={r: ("ranks", {"files": [paths[r]]}) for r in range(2)}).values())
    t0 = time.monotonic()
    got = ps.all("gather", "ranks")
    dt = time.monotonic() - t0
    for r, o in got.items():
        assert not o.ok and o.error == "CheckpointFormatError", (r, o)
        assert "tensor 'both'" in o.message and "rank 0" in o.message and "rank 1" in o.message, (r, o)
    assert {r: sha256(p) for r, p in paths.items()} == before
    report_case("safetensors: same tensor on rank 0 and rank 1", "CheckpointFormatError at gather_metas, every rank", dt)
    # updating the refused checkpoint is misuse (its metas were never gathered), the world still works
    upd = ps.update("ranks", front, 10)
    assert all(not o.ok and o.error == "ConfigError" for o in upd.values()), upd
    assert all(o.ok for o in ps.all("unregister", ("ranks", {})).values())
    assert_genuine_update_delivers(ps, front, "ranks", str(tmp_path), gen)


def test_a_missing_file_is_a_typed_error_naming_it(world, tmp_path):
    ps, front, shm, gen = world
    path = str(tmp_path / "missing.safetensors")
    got = register_on_rank0(ps, "missing", [path], "disk")
    assert not got.ok and path in got.message, got
    report_case("safetensors: file does not exist", f"{got.error}", got.seconds)
    assert got.error == "ConfigError", got


def test_an_in_place_file_truncated_after_registration_fails_the_update_without_killing_the_ps(tmp_path):
    front = EngineFront("cpu", 2)
    shm = f"/dev/shm/ckpt-test-trunc-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    gen = torch.Generator().manual_seed(5)
    try:
        with PsWorld("cpu", 2, init={"max_bucket_gb": (16 << 10) / (1 << 30)}) as ps:
            paths = {r: os.path.join(shm, f"rank{r}.safetensors") for r in range(2)}
            for r, p in paths.items():
                write_file(p, fresh_tensors({f"t{r}.{i}": ((4096,), torch.float32) for i in range(4)}, gen))
            assert all(o.ok for o in ps.all("register", per_rank={r: ("A", {"files": [paths[r]]})
                                                                 for r in range(2)}).values())
            assert all(o.ok for o in ps.all("gather", "A").values())
            prefix = ps.all("ipc_prefix", ranks=[0])[0].value
            os.truncate(paths[1], 100)              # someone else shrinks the file under the live map
            got = ps.update("A", front, 10)
            report_case("in-place /dev/shm file truncated after registration",
                        f"rank 1: {got[1].error}; rank 0: {got[0].error}", got[0].seconds)
            assert ps.procs[1].is_alive(), "the PS rank died (SIGBUS)"
            # every rank fails with a typed error naming the shrunk file (CheckpointFormatError on its owner;
            # the others learn it through the status exchange), and the world stays usable
            assert all(not o.ok and o.error in ("CheckpointFormatError", "RemoteWorkerError") and paths[1] in o.message
                       for o in got.values()), got
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        front.close()
        for n in os.listdir("/dev/shm"):            # the IPC buffer of a rank that died, if it did
            if "prefix" in locals() and n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")
