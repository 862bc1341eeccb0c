"""The capacity planner's prediction with slices: each rank receives 1/T of the sharded bytes plus
the replicated ones, and only those travel and reload; `ckpt-engine plan --slices-tp` shows both."""

import json

import pytest

from ckpt_core import cli
from ckpt_core.errors import ConfigError
from ckpt_core.planning.capacity import ModelSpec, Topology, predict
from ckpt_core.planning.slice_estimate import SliceLoad, from_fraction

GiB = 1 << 30
MODEL = ModelSpec(16 * GiB, 344, 1 << 30)


def fraction(tp: int, sharded: float = 0.98) -> SliceLoad:
    return from_fraction(MODEL.total_bytes, MODEL.tensors, tp, sharded)


def test_slices_cut_what_each_rank_receives_to_its_share_and_shorten_the_stages_that_move_it():
    topo = Topology(nodes=1, devices_per_node=8, device_free_gib=16)
    whole = predict(MODEL, topo)
    sliced = predict(MODEL, topo, slices=fraction(8, 0.98))
    assert whole["received_bytes_per_rank"] == MODEL.total_bytes and whole["slices"] is None
    assert sliced["received_bytes_per_rank"] == int(MODEL.total_bytes * (0.98 / 8 + 0.02))
    assert sliced["stages_s"]["broadcast"] < whole["stages_s"]["broadcast"] / 5
    assert sliced["stages_s"]["reload"] < whole["stages_s"]["reload"]
    assert sliced["stages_s"]["h2d"] == whole["stages_s"]["h2d"]   # every byte still leaves host memory once
    assert sliced["update_s"] <= whole["update_s"]
    same = predict(MODEL, topo, slices=fraction(1))
    assert same["received_bytes_per_rank"] == MODEL.total_bytes


@pytest.mark.parametrize("tp, sharded, needle", [(0, 0.98, "slices need"), (2, 1.5, "slices need"),
                                                 (3, 0.98, "not a multiple of the engine's 3")])
def test_a_bad_slices_layout_is_a_config_error(tp, sharded, needle):
    with pytest.raises(ConfigError, match=needle):
        predict(MODEL, Topology(), slices=fraction(tp, sharded))


def test_plan_with_slices_tp_predicts_both_updates(capsys):
    assert cli.main(["--json", "plan", "--size-gib", "16", "--tensors", "344", "--devices", "8",
                     "--slices-tp", "8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    load = doc["with_slices"]["slices"]
    assert load["tp"] == 8 and load["source"] == "0.98 of the bytes sharded" and len(set(load["received_bytes"])) == 1
    assert doc["with_slices"]["received_bytes_per_rank"] < doc["received_bytes_per_rank"] / 5
    assert cli.main(["plan", "--size-gib", "16", "--tensors", "344", "--devices", "8", "--slices-tp", "8"]) == 0
    assert "with slices (TP 8, 0.98 of the bytes sharded): 2.28 GiB received per rank" in capsys.readouterr().out


def test_a_sliced_p2p_update_still_reads_every_byte_but_broadcasts_only_what_every_rank_reads_whole():
    topo = Topology(nodes=1, devices_per_node=8, device_free_gib=16)
    whole = predict(MODEL, topo, mode="p2p")
    sliced = predict(MODEL, topo, mode="p2p", slices=fraction(8, 0.9))
    assert sliced["stages_s"]["p2p"] == whole["stages_s"]["p2p"]
    assert sliced["stages_s"]["broadcast"] == pytest.approx(whole["stages_s"]["broadcast"] * 0.1, rel=1e-3)
    assert sliced["stages_s"]["reload"] < whole["stages_s"]["reload"]


def test_fewer_tensors_per_rank_under_expert_parallelism_cost_less_reload_than_the_same_bytes_in_all_tensors():
    topo = Topology(nodes=1, devices_per_node=2, device_free_gib=16)
    half = MODEL.total_bytes // 2
    tp = predict(MODEL, topo, slices=SliceLoad(2, (half, half), (344, 344), 0, "test"))
    ep = predict(MODEL, topo, slices=SliceLoad(2, (half, half), (200, 200), 0, "test", ep=True))
    assert ep["stages_s"]["reload"] < tp["stages_s"]["reload"] and ep["stages_s"]["broadcast"] == tp["stages_s"]["broadcast"]


def test_a_slower_engine_reload_makes_the_whole_update_reload_bound_and_slices_shorten_it_most(capsys):
    argv = ["--json", "plan", "--size-gib", "64", "--tensors", "700", "--devices", "8", "--slices-tp", "8"]
    assert cli.main(argv) == 0
    fast = json.loads(capsys.readouterr().out)
    assert cli.main([*argv, "--reload-gb-per-s", "125"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert fast["bottleneck"] == "h2d" and slow["bottleneck"] == "reload"
    assert slow["calibration"]["reload_gbps"] == 125 and fast["calibration"]["reload_gbps"] == 2125
    gain = lambda doc: doc["update_s"] / doc["with_slices"]["update_s"]   # noqa: E731
    assert gain(slow) > 1.2 > 1.1 > gain(fast)


def test_a_sliced_stage_holds_only_each_workers_slices_and_may_then_fit_in_device_memory():
    topo = Topology(nodes=1, devices_per_node=8, device_free_gib=10)
    whole = predict(MODEL, topo)["staging"]
    sliced = predict(MODEL, topo, slices=fraction(8, 0.98))["staging"]
    assert whole["bytes_per_worker"] == MODEL.total_bytes and not whole["fits_device"]
    assert sliced["bytes_per_worker"] == int(MODEL.total_bytes * (0.98 / 8 + 0.02)) and sliced["fits_device"]
    assert sliced["commit_s"] < whole["commit_s"]
