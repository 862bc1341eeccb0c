"""The versioned JSON metas document: round trip, validation before install, foreign files."""

import copy
import json
import pickle

import pytest

from ckpt_core.p2p import metas as _metas
from ckpt_core.p2p.metas import Peer
from ckpt_core.planning.buckets import TensorMeta
from ckpt_core.errors import ConfigError

METAS = {"ck": [[TensorMeta("a", "BF16", (4, 8), 64, 2, 0, 0), TensorMeta("b", "F32", (3,), 12, 4, 0, 64)],
                [TensorMeta("c", "F8_E4M3", (0,), 0, 1, 1, 0)]]}
PEERS = {"ck": [Peer("10.0.0.2:15001", "10.0.0.2", "mlx5_0", {0: (1 << 20, 4096)}, (8192, "ab" * 16)),
                Peer("10.0.0.3:15002", "10.0.0.3", None, {1: (2 << 20, 4096)})]}


def doc():
    return _metas.dump(METAS, PEERS)


def test_a_document_round_trips_through_json_and_a_file(tmp_path):
    d = json.loads(json.dumps(doc()))
    parsed = _metas.parse(d)
    assert parsed["ck"].metas == METAS["ck"] and parsed["ck"].peers == PEERS["ck"]
    _metas.save(tmp_path / "m.json", doc())
    assert _metas.parse(_metas.read(tmp_path / "m.json"))["ck"].peers == PEERS["ck"]
    assert _metas.to_legacy(parsed)["ck"][0][0] == {"name": "a", "dtype": "BF16", "shape": [4, 8], "nbytes": 64,
                                                    "itemsize": 2, "base": 0, "base_offset": 0}


def _broken(path, value):
    d = copy.deepcopy(doc())
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


OWNER = ["checkpoints", "ck", "owners", 0]


@pytest.mark.parametrize("path, value, needle", [
    (["format"], "checkpoint-engine", "foreign format"),
    (["version"], 3, "version 3"),
    (["version"], True, "version True"),
    (["checkpoints"], [], "'checkpoints' must be an object"),
    (["checkpoints", "ck", "owners"], [], "non-empty 'owners'"),
    (OWNER + ["rank"], 1, "must be {'rank': 0"),
    (OWNER + ["p2p", "address"], "nohost", "'host:port'"),
    (OWNER + ["p2p", "address"], "h:port", "port"),
    (OWNER + ["p2p", "regions"], {"0": [0, 10]}, "pointer"),
    (OWNER + ["p2p", "regions"], {"x": [1, 10]}, "region id"),
    (OWNER + ["tensors", 0, 3], 65, "65 bytes do not match shape"),
    (OWNER + ["tensors", 1, 1], "F16", "dtype code 'F16' with itemsize 4"),   # shape x 4 still == nbytes
    (OWNER + ["tensors", 1, 1], "Q3", "dtype code 'Q3'"),
    (OWNER + ["tensors", 0, 2], [4, -8], "shape"),
    (OWNER + ["tensors", 0, 6], 4090, "outside the region"),
    (OWNER + ["tensors", 0, 5], 7, "outside the region 7"),
    (OWNER + ["tensors", 0, 4], True, "itemsize"),
    (OWNER + ["tensors", 1, 0], "a", "listed by two owners"),
    (OWNER + ["tensors", 0], ["a", "BF16"], "must be [name"),
    (OWNER + ["p2p", "stamp"], [8192, "xyz"], "stamp must be"),
    (OWNER + ["p2p", "stamp"], [0, "ab" * 16], "stamp pointer"),
])
def test_a_malformed_document_is_a_config_error_naming_the_fault(path, value, needle):
    with pytest.raises(ConfigError, match=None) as info:
        _metas.parse(_broken(path, value))
    assert needle in str(info.value)


def test_a_pickled_or_non_json_or_unversioned_file_is_refused_without_unpickling(tmp_path):
    marker = tmp_path / "unpickled"
    from support.wire import PickleBomb
    (tmp_path / "p.pkl").write_bytes(pickle.dumps(PickleBomb(str(marker))))
    with pytest.raises(ConfigError, match="pickled"):
        _metas.read(tmp_path / "p.pkl")
    assert not marker.exists()
    (tmp_path / "old.json").write_text(json.dumps({"ck": [[]]}))
    with pytest.raises(ConfigError, match="no 'format'"):
        _metas.read(tmp_path / "old.json")
    with pytest.raises(ConfigError, match="cannot read"):
        _metas.read(tmp_path / "missing.json")


def test_a_zero_byte_tensor_needs_no_region_its_owner_serves():
    """An owner serves no region of 0 bytes: its 0-byte tensors name a region no peer lists."""
    d = _broken(["checkpoints", "ck", "owners", 1, "p2p", "regions"], {})
    assert _metas.parse(d)["ck"].metas[1] == METAS["ck"][1]


def test_the_unversioned_dicts_go_through_the_same_validation():
    from ckpt_core.transfer.prechecks import parse_metas
    legacy = _metas.to_legacy(_metas.parse(doc()))
    assert parse_metas(legacy, 2)["ck"] == METAS["ck"]
    legacy["ck"][0][1]["dtype"] = "F16"
    with pytest.raises(ConfigError, match="dtype code 'F16' with itemsize 4"):
        parse_metas(legacy, 2)
