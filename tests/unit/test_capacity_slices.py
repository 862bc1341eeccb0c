"""The capacity planner's prediction with slices: each rank receives 1/T of the sharded bytes plus
the replicated ones, and only those travel and reload; `ckpt-engine plan --slices-tp` shows both."""

import json

import pytest

from ckpt_core import cli
from ckpt_core.errors import ConfigError
from ckpt_core.planning.capacity import ModelSpec, Topology, predict

GiB = 1 << 30
MODEL = ModelSpec(16 * GiB, 344, 1 << 30)


def test_slices_cut_what_each_rank_receives_to_its_share_and_shorten_the_stages_that_move_it():
    topo = Topology(nodes=1, devices_per_node=8, device_free_gib=16)
    whole = predict(MODEL, topo)
    sliced = predict(MODEL, topo, slices_tp=8, sharded_fraction=0.98)
    assert whole["received_bytes_per_rank"] == MODEL.total_bytes and whole["slices"] is None
    assert sliced["received_bytes_per_rank"] == int(MODEL.total_bytes * (0.98 / 8 + 0.02))
    assert sliced["stages_s"]["broadcast"] < whole["stages_s"]["broadcast"] / 5
    assert sliced["stages_s"]["reload"] < whole["stages_s"]["reload"]
    assert sliced["stages_s"]["h2d"] == whole["stages_s"]["h2d"]   # every byte still leaves host memory once
    assert sliced["update_s"] <= whole["update_s"]
    same = predict(MODEL, topo, slices_tp=1)
    assert same["received_bytes_per_rank"] == MODEL.total_bytes


@pytest.mark.parametrize("kwargs", [{"slices_tp": 0}, {"slices_tp": 2, "sharded_fraction": 1.5},
                                    {"slices_tp": 2, "mode": "p2p"}])
def test_a_bad_slices_layout_is_a_config_error(kwargs):
    with pytest.raises(ConfigError, match="slices need"):
        predict(MODEL, Topology(), **kwargs)


def test_plan_with_slices_tp_predicts_both_updates(capsys):
    assert cli.main(["--json", "plan", "--size-gib", "16", "--tensors", "344", "--devices", "8",
                     "--slices-tp", "8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["with_slices"]["slices"] == {"tp": 8, "sharded_fraction": 0.98}
    assert doc["with_slices"]["received_bytes_per_rank"] < doc["received_bytes_per_rank"] / 5
    assert cli.main(["plan", "--size-gib", "16", "--tensors", "344", "--devices", "8", "--slices-tp", "8"]) == 0
    assert "with slices (TP 8, 0.98 of the bytes sharded): 2.28 GiB received per rank" in capsys.readouterr().out
