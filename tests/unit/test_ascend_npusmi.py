"""The NPU device key: npu-smi proc-mem parsing, chip lookup by pid, ASCEND_RT_VISIBLE_DEVICES."""

import os
import shutil
from pathlib import Path

import pytest

from ckpt_ascend import _npusmi
from ckpt_ascend._npusmi import find_chip, parse_proc_mem, visible_devices
from ckpt_core.errors import ConfigError
from fakes import npu_board
from fakes.ascend_env import board_env

DATA = Path(__file__).resolve().parents[1] / "data" / "npu_smi"


def sample(name: str) -> str:
    return (DATA / name).read_text()


def test_a_single_chip_board_lists_its_processes_on_chip_0_even_with_an_empty_process_name():
    got = parse_proc_mem(sample("a2_single_chip.txt"))
    assert (got.npu_id, got.chip_count) == (3, 1)
    assert got.pids == {0: [48211, 482]}
    assert got.chips_of(482) == [0]


def test_a_dual_chip_board_assigns_each_process_to_the_chip_line_that_follows_it():
    got = parse_proc_mem(sample("a3_dual_chip.txt"))
    assert (got.npu_id, got.chip_count) == (4, 2)
    assert got.pids == {0: [48211], 1: [48307, 4830]}
    assert got.chips_of(48307) == [1] and got.chips_of(48211) == [0]


def test_pids_match_exactly_not_as_substrings():
    got = parse_proc_mem(sample("a3_dual_chip.txt"))
    assert got.chips_of(483) == [] and got.chips_of(4830) == [1] and got.chips_of(8211) == []


def test_an_idle_npu_parses_with_no_processes():
    assert parse_proc_mem(sample("idle.txt")).pids == {0: []}


@pytest.mark.parametrize("text, needle", [
    ("This device does not support querying proc-mem.\n", "does not report per-process memory"),
    ("NPU ID : ?\n%%% driver error %%%\n", "cannot parse"),
    ("", "no 'NPU ID' and 'Chip Count' lines"),
    ("        NPU ID : 1\n        Chip Count : 1\n        Process id:7  Process name:x  Process memory(MB):1\n",
     "not followed by a 'Chip ID' line"),
    ("        NPU ID : 1\n        Chip Count : 1\n        Chip ID : 3\n", "do not fit"),
])
def test_output_that_cannot_be_read_is_a_config_error_quoting_it(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_proc_mem(text)


def test_the_fake_npu_smi_prints_the_documented_format_byte_for_byte():
    procs = {0: [(48211, "python3", 3127)], 1: [(48307, "python3", 3127), (4830, "python3", 3127)]}
    assert npu_board.render_proc_mem(4, 2, procs) == sample("a3_dual_chip.txt")
    assert npu_board.render_proc_mem(0, 1, {}) == sample("idle.txt")


@pytest.mark.parametrize("raw, want", [("", None), ("3", [3]), ("6,7, 2", [6, 7, 2])])
def test_visible_devices_map_logical_indices_to_physical_chips(monkeypatch, raw, want):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", raw)
    assert visible_devices() == want


@pytest.mark.parametrize("raw", ["a,b", "1,1", "-1"])
def test_bad_visible_devices_are_a_config_error(monkeypatch, raw):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", raw)
    with pytest.raises(ConfigError, match="ASCEND_RT_VISIBLE_DEVICES"):
        visible_devices()


@pytest.fixture
def board(tmp_path, monkeypatch):
    """A fake board (2 NPUs of 2 chips) on which this test process can 'open' chips."""
    def make(npu_ids=(0, 1), chips=2, **kw):
        for k, v in board_env(tmp_path / "board", list(npu_ids), chips, **kw).items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr(_npusmi, "_keys", {})
    return make


def test_the_chip_is_npu_id_times_chip_count_plus_chip_id(board):
    board(npu_ids=[0, 1, 2], chips=2)
    npu_board.record_open(os.getpid(), 5)            # NPU 2, chip 1
    npu_board.record_open(os.getpid() + 1, 4)        # a neighbour on NPU 2, chip 0
    assert find_chip(os.getpid()) == 5
    assert find_chip(os.getpid() + 1) == 4


def test_the_key_follows_the_process_not_its_logical_index(board, monkeypatch):
    board(npu_ids=[0, 1], chips=2)
    npu_board.record_open(os.getpid(), 3)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "3")
    key = _npusmi.device_key(0)
    assert key == f"NPU-{_npusmi.host_ip()}-3"
    monkeypatch.setattr(_npusmi, "_keys", {})
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")   # same chip seen as logical index 3 elsewhere
    assert _npusmi.device_key(3) == key


def test_a_process_on_two_chips_is_told_apart_by_the_visible_devices_hint(board):
    board(npu_ids=[0, 1], chips=2)
    npu_board.record_open(os.getpid(), 0)
    npu_board.record_open(os.getpid(), 2)
    assert find_chip(os.getpid(), hint=2) == 2
    with pytest.raises(ConfigError, match=r"uses NPU chips \[0, 2\]"):
        find_chip(os.getpid(), hint=1)


def test_a_process_on_no_chip_is_a_config_error_that_says_what_to_do(board):
    board()
    with pytest.raises(ConfigError, match="uses no NPU.*set_device.*--pid=host"):
        find_chip(os.getpid())


def test_npu_smi_missing_from_path_is_a_config_error(board, monkeypatch, tmp_path):
    board()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert shutil.which("npu-smi") is None
    with pytest.raises(ConfigError, match="npu-smi is not on PATH"):
        _npusmi.device_key(0)


@pytest.mark.parametrize("mode, needle", [("garbled", "cannot parse"), ("unsupported", "does not report")])
def test_unreadable_npu_smi_output_is_a_config_error(board, mode, needle):
    board(proc_mem=mode)
    npu_board.record_open(os.getpid(), 0)
    with pytest.raises(ConfigError, match=needle):
        find_chip(os.getpid())


def test_visible_devices_outside_the_index_is_a_config_error(board, monkeypatch):
    board()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    with pytest.raises(ConfigError, match="device index 1 is outside"):
        _npusmi.device_key(1)


def test_a_hung_npu_smi_is_a_config_error_within_the_lookup_deadline(board, monkeypatch, tmp_path):
    board()
    hung = tmp_path / "bin"
    hung.mkdir()
    (hung / "npu-smi").write_text("#!/bin/sh\nexec sleep 30\n")
    (hung / "npu-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{hung}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(_npusmi, "NPU_SMI_TIMEOUT_S", 1.0)
    with pytest.raises(ConfigError, match="did not answer"):
        find_chip(os.getpid())
