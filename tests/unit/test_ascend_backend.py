"""The npu backend: entry-point discovery from the installed package, HCCL selection, NPU IPC, host memory.

Everything that needs (the fake) torch_npu runs in child processes: see tests/fakes/ascend_env.py.
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from ckpt_ascend import NpuBackend
from fakes.ascend_env import FAKES, ROOT, board_env, installed, run_py
from support.procs import pythonpath


DISCOVER = """
import json, sys
from importlib.metadata import entry_points
import ckpt_core
from ckpt_core.devices import available_kinds, default_kind, get_backend
out = {"entry_points": sorted((e.name, e.value) for e in entry_points(group="ckpt_core.devices")),
       "kinds": available_kinds(), "core": ckpt_core.__file__, "torch_npu_imported": "torch_npu" in sys.modules}
out["available"] = get_backend("npu").is_available()
out["default"] = default_kind()
out["class"] = type(get_backend("npu")).__module__ + "." + type(get_backend("npu")).__name__
out["collectives"] = get_backend("npu").collective_backend
print(json.dumps(out))
"""


def test_the_installed_package_adds_npu_through_its_entry_point_and_it_becomes_the_default(installed, tmp_path):
    env = board_env(tmp_path / "board", [0], 1)
    got = json.loads(run_py(DISCOVER, env, paths=[installed, FAKES]))
    assert got["core"].startswith(str(installed)), "ckpt_core must come from the installed copy"
    assert got["entry_points"] == [["npu", "ckpt_ascend:NpuBackend"]]
    assert got["kinds"] == ["cpu", "cuda", "npu"]
    assert got["class"] == "ckpt_ascend._backend.NpuBackend"
    assert got["available"] and got["default"] == "npu" and got["collectives"] == "hccl"


def test_without_torch_npu_the_npu_kind_is_listed_but_off_and_torch_npu_is_not_imported(installed, tmp_path):
    got = json.loads(run_py(DISCOVER, {}, paths=[installed]))
    assert "npu" in got["kinds"] and not got["available"] and got["default"] == "cpu"
    assert not got["torch_npu_imported"]


PS_ONE_RANK = """
import json, socket, torch.distributed as dist
from ckpt_core import ParameterServer
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
ps = ParameterServer(0, 1, master_addr="127.0.0.1", master_port=port)
print(json.dumps({"kind": ps.backend.kind, "key": ps.device_uuid, "default_pg": dist.get_backend(),
                  "data_pg": dist.get_backend(ps._coll.data_group), "ctrl_pg": dist.get_backend(ps._coll.ctrl_group)}))
ps.close()
"""


def test_a_parameter_server_on_an_npu_host_uses_hccl_and_keys_its_physical_chip(installed, tmp_path):
    env = board_env(tmp_path / "board", [0, 1], 2, visible="2")   # logical npu:0 is chip 2 (NPU 1, chip 0)
    got = json.loads(run_py(PS_ONE_RANK, env, paths=[ROOT, installed, FAKES]))
    assert got["kind"] == "npu" and got["default_pg"] == "hccl" and got["data_pg"] == "hccl"
    assert got["ctrl_pg"] == "gloo"
    assert got["key"].startswith("NPU-") and got["key"].endswith("-2")


@pytest.mark.parametrize("mode, path, needle", [
    ("ok", "/nonexistent", "npu-smi is not on PATH"),
    ("garbled", None, "cannot parse the output of"),
])
def test_a_parameter_server_without_a_readable_npu_smi_fails_with_config_error(installed, tmp_path, mode, path,
                                                                               needle):
    env = board_env(tmp_path / "board", [0], 1, proc_mem=mode)
    if path:
        env["PATH"] = path
    code = ("from ckpt_core import ParameterServer, ConfigError\n"
            "try:\n    ParameterServer(0, 1, device='npu', master_port=1)\n"
            "except ConfigError as e:\n    print('ConfigError:', e)\n")
    assert needle in run_py(code, env, paths=[ROOT, installed, FAKES])


def test_a_device_index_beyond_the_visible_chips_is_a_config_error_naming_them(installed, tmp_path):
    env = {**board_env(tmp_path / "board", [0, 1], 2, visible="2"), "LOCAL_RANK": "1"}
    code = ("from ckpt_core import ParameterServer, ConfigError\n"
            "try:\n    ParameterServer(0, 1, device='npu', master_port=1)\n"
            "except ConfigError as e:\n    print('ConfigError:', e)\n")
    out = run_py(code, env, paths=[ROOT, installed, FAKES])
    assert "ConfigError: cannot use npu:1 (ASCEND_RT_VISIBLE_DEVICES=[2])" in out


EXPORT = """
import json, sys, torch
from ckpt_ascend import NpuBackend
b = NpuBackend(); b.set_device(1)
buf = b.alloc_ipc(1 << 16, 1, "t")
data = torch.randint(1, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
buf.tensor.copy_(data)
print(json.dumps({"desc": buf.descriptor, "key": b.device_key(1), "sum": int(data.sum())}), flush=True)
sys.stdin.readline()   # keep the buffer alive until the test is done
"""

IMPORT = """
import json, sys, torch
from ckpt_ascend import NpuBackend
from ckpt_core.errors import TransportError
from torch_npu.multiprocessing import reductions
desc, index = json.loads(sys.argv[1]), int(sys.argv[2])
b = NpuBackend(); b.set_device(index)
try:
    t, _ = b.open_ipc(desc, index)
    out = {"sum": int(t.sum()), "n": t.numel()}
except TransportError as e:
    out = {"error": str(e)}
out.update(key=b.device_key(index), rebuilt_on=reductions.rebuilt_on)
print(json.dumps(out))
"""


def test_a_worker_maps_the_ps_buffer_on_its_own_index_even_when_visible_devices_differ(tmp_path):
    """PS sees chips 1,3 and uses npu:1 (chip 3); the worker sees only chip 3, as npu:0."""
    paths = [ROOT, FAKES]
    ps_env = board_env(tmp_path / "board", [0, 1], 2, visible="1,3")
    full = {**{k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}, **ps_env,
            "PYTHONPATH": pythonpath(*paths)}
    ps = subprocess.Popen([sys.executable, "-c", EXPORT], env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True, cwd=tempfile.gettempdir())
    try:
        exported = json.loads(ps.stdout.readline())
        desc = json.dumps(exported["desc"])
        same = {**ps_env, "ASCEND_RT_VISIBLE_DEVICES": "3"}
        got = json.loads(run_py(IMPORT.replace("sys.argv[1]", repr(desc)).replace("sys.argv[2]", "'0'"), same,
                                paths=paths))
        assert got["sum"] == exported["sum"] and got["n"] == 1 << 16
        assert got["rebuilt_on"] == [0], "argument 6 must be the worker's own index, not the PS's (1)"
        assert got["key"] == exported["key"], "both sides must compute one key for one chip"
        other = {**ps_env, "ASCEND_RT_VISIBLE_DEVICES": "1,3"}   # index 0 is chip 1 here: the wrong chip
        wrong = json.loads(run_py(IMPORT.replace("sys.argv[1]", repr(desc)).replace("sys.argv[2]", "'0'"), other,
                                  paths=paths))
        assert "cannot map the NPU IPC buffer on npu:0" in wrong["error"] and wrong["key"] != exported["key"]
    finally:
        ps.communicate("\n", timeout=60)


def test_a_malformed_descriptor_is_a_transport_error_before_torch_npu_sees_it(tmp_path):
    env = board_env(tmp_path / "board", [0], 1)
    code = textwrap.dedent("""
        from ckpt_ascend import NpuBackend
        from ckpt_core.errors import TransportError
        b = NpuBackend()
        for desc in ({}, {"kind": "npu", "handle": "!!", "nbytes": 1}, {"storage_class": "os.system"}):
            try:
                b.open_ipc(desc, 0)
            except TransportError as e:
                print("TransportError", e)
    """)
    out = run_py(code, env, paths=[ROOT, FAKES])
    assert out.count("TransportError malformed NPU IPC descriptor") == 3


def test_host_buffers_are_requested_pinned(monkeypatch):
    asked = {}
    real = torch.empty

    def empty(*a, **kw):
        asked.update(kw)
        return real(*a, **{k: v for k, v in kw.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "empty", empty)
    t = NpuBackend().empty_host(4096)
    assert asked.get("pin_memory") is True and t.numel() == 4096 and t.dtype == torch.uint8


def test_without_a_pinned_allocator_host_buffers_fall_back_to_pageable_memory_once_logged(caplog):
    b = NpuBackend()
    with caplog.at_level(logging.WARNING, "ckpt_ascend"):
        a, c = b.empty_host(8192), b.empty_host(8192)   # CPU-only torch has no pinned allocator
        b.pin(a)
    assert a.numel() == c.numel() == 8192
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cannot allocate pinned host memory" in warnings[0]


def test_pinning_in_place_is_not_possible_and_says_how_to_copy_instead(caplog):
    b = NpuBackend()
    region = torch.ones(8192, dtype=torch.uint8)
    with caplog.at_level(logging.WARNING, "ckpt_ascend"):
        pins = [b.pin(region[:4096]), b.pin(region[4096:])]
    for p in pins:
        p.release()
        p.release()   # idempotent
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "use_inplace_pin_memory=False" in warnings[0]


def test_a_dev_shm_checkpoint_is_copied_into_pinned_memory_not_mapped_pageable(tmp_path, caplog):
    """pins_in_place=False: the core copies in-place files (logged) instead of mapping them."""
    from safetensors.torch import save_file

    from ckpt_core.checkpoint.sources import build_checkpoint
    path = f"/dev/shm/ckpt-ascend-test-{os.getpid()}.safetensors"
    want = {"w": torch.randn(64, 32), "b": torch.arange(7, dtype=torch.int32)}
    save_file(want, path)
    try:
        with caplog.at_level(logging.INFO, "ckpt_core"):
            ckpt = build_checkpoint("c", NpuBackend(), files=[path], inplace=True)
        try:
            assert all(r.closer is None for r in ckpt.regions.values()), "a region maps the file in place"
            assert any("copying 1 /dev/shm file(s) into pinned memory" in r.getMessage() for r in caplog.records)
            for m in ckpt.metas:
                region = ckpt.regions[m.base].tensor
                got = region[m.base_offset:m.base_offset + m.nbytes].view(want[m.name].dtype).view(want[m.name].shape)
                assert torch.equal(got, want[m.name])
        finally:
            ckpt.release()
        assert os.path.exists(path), "the source file must stay"
    finally:
        os.unlink(path)
