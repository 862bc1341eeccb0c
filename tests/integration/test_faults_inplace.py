"""In-place /dev/shm checkpoints with files this process may not write or read (issue 14, defect 3).

Permissions only bind an unprivileged process, so each case runs ``build_checkpoint`` (what
``register_checkpoint`` calls) in a child process that drops to an unprivileged user after its
imports when the suite runs as root. The promises: a read-only file is mapped read-only and
delivers its exact bytes; ``unlink_inplace_files=True`` deletes the files only once the whole
registration succeeded, never when a later file fails; every failure is a ``CkptError``.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.e2e_cases import ShmDir
from support.data import digest, fresh_tensors
from support.inplace_cases import register_as_unprivileged, write_owned


@pytest.fixture
def shm():
    d = ShmDir()
    os.chmod(d.path, 0o777)   # the unprivileged child deletes files in it
    yield d
    d.close()


def test_a_read_only_shm_file_is_mapped_read_only_and_unlinked_only_after_success(shm):
    gen = torch.Generator().manual_seed(3)
    a = fresh_tensors({"a.w": ((1000,), torch.bfloat16)}, gen)
    b = fresh_tensors({"b.w": ((77, 3), torch.float32), "b.v": ((5,), torch.float16)}, gen)
    files = [write_owned(shm, "a.safetensors", a, 0o644), write_owned(shm, "b.safetensors", b, 0o444)]
    got = register_as_unprivileged(files, unlink=True)
    assert got["ok"], got
    assert got["in_place"] == [True, True], "in-place registration needs no write access"
    assert got["digests"] == {n: digest(t) for n, t in {**a, **b}.items()}
    assert got["exist"] == [False, False], "unlink_inplace_files=True deletes the files after a success"


def test_a_later_unreadable_file_fails_the_registration_and_deletes_nothing(shm):
    gen = torch.Generator().manual_seed(4)
    files = [write_owned(shm, "a.safetensors", fresh_tensors({"a": ((64,), torch.float32)}, gen), 0o644),
             write_owned(shm, "b.safetensors", fresh_tensors({"b": ((64,), torch.float32)}, gen), 0o000)]
    got = register_as_unprivileged(files, unlink=True)
    assert not got["ok"] and got["error"] == "ConfigError", got
    assert "b.safetensors" in got["message"] and "Permission denied" in got["message"], got
    assert got["exist"] == [True, True], "a failed registration must not delete any file"


def test_files_are_kept_without_unlink_inplace_files(shm):
    gen = torch.Generator().manual_seed(5)
    files = [write_owned(shm, "a.safetensors", fresh_tensors({"a": ((64,), torch.float32)}, gen), 0o444)]
    got = register_as_unprivileged(files, unlink=False)
    assert got["ok"] and got["exist"] == [True], got


def test_files_a_kind_must_copy_are_deleted_too_after_success(shm):
    """A kind that pins host memory but cannot pin a file where it lies (like NPUs) copies the
    /dev/shm files; with unlink_inplace_files=True they go after the success like mapped ones."""
    from ckpt_core.checkpoint.sources import build_checkpoint
    from ckpt_core.devices.cpu import CpuBackend

    class CopyingBackend(CpuBackend):
        pins_host_memory, pins_in_place = True, False

    gen = torch.Generator().manual_seed(6)
    a = fresh_tensors({"a.w": ((300,), torch.bfloat16)}, gen)
    path = shm.write("a.safetensors", a)
    ckpt = build_checkpoint("c", CopyingBackend(), files=[path], unlink_inplace_files=True)
    try:
        assert [r.source_check for r in ckpt.regions.values()] == [None], "copied, not mapped"
        assert {m.name: digest(ckpt.host_tensor(m)) for m in ckpt.metas} == {n: digest(t) for n, t in a.items()}
        assert not os.path.exists(path)
    finally:
        ckpt.release()
