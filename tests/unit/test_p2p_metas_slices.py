"""Box digests in the metas document (version 2): round trip, all-or-nothing validation, and a
joining world's look-up of a plan's box digests (``p2p/slices.published_boxes``)."""

import copy
import json

import pytest

from ckpt_core.errors import ConfigError
from ckpt_core.p2p import metas as _metas
from ckpt_core.p2p.metas import Peer
from ckpt_core.p2p.slices import box_key, published_boxes, read_boxes
from ckpt_core.planning.buckets import TensorMeta
from ckpt_core.planning.slices import SliceKey, split_plan

PLAN = split_plan(SliceKey("m", "tp=2", "test"), {"a": ("BF16", (4, 8), 2), "b": ("F32", (3,), 4)}, 2, {"a": 1, "b": None})
METAS = {"ck": [[TensorMeta("a", "BF16", (4, 8), 64, 2, 0, 0)], [TensorMeta("b", "F32", (3,), 12, 4, 1, 0)]]}
BOXES = {"a": {box_key(b): f"{i:032x}" for i, b in enumerate(read_boxes(PLAN)["a"])}}


def peers(slices=None):
    return {"ck": [Peer("10.0.0.2:15001", "10.0.0.2", None, {0: (1 << 20, 4096)}, digests={"a": "0" * 32},
                        slices=slices),
                   Peer("10.0.0.3:15002", "10.0.0.3", None, {1: (2 << 20, 4096)}, digests={"b": "1" * 32})]}


def doc(slices=None):
    return json.loads(json.dumps(_metas.dump(METAS, peers(slices))))


def test_box_digests_make_a_version_2_document_that_round_trips_and_one_without_stays_version_1():
    assert doc()["version"] == 1 and "slices" not in doc()["checkpoints"]["ck"]["owners"][0]["p2p"]
    d = doc({PLAN.digest: BOXES})
    assert d["version"] == 2
    parsed = _metas.parse(d)["ck"]
    assert parsed.peers == peers({PLAN.digest: BOXES})["ck"] and parsed.metas == METAS["ck"]
    assert len(BOXES["a"]) == 2, "engine ranks 0 and 1 read one box of columns each"


OWNER = ["checkpoints", "ck", "owners", 0, "p2p", "slices"]


def _broken(path, value):
    d = copy.deepcopy(doc({PLAN.digest: BOXES}))
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return d


KEY0 = box_key(read_boxes(PLAN)["a"][0])


@pytest.mark.parametrize("path, value, needle", [
    (OWNER, [], "slices must map"),
    (OWNER, {}, "slices must map"),
    (OWNER, {"xyz": BOXES}, "plan 'xyz'"),
    (OWNER + [PLAN.digest], {"a": {}}, "tensor 'a'"),
    (OWNER + [PLAN.digest, "a", KEY0], "zz" * 16, "box"),
    (OWNER + [PLAN.digest, "a"], {"[[1,0]]": "0" * 32}, "box '[[1,0]]'"),
    (OWNER + [PLAN.digest, "a"], {"not json": "0" * 32}, "box 'not json'"),
    (OWNER + [PLAN.digest, "a"], {"[[1,0,-2]]": "0" * 32}, "box"),
    (OWNER + [PLAN.digest, "a"], {"[[1,4,8]]": "0" * 32}, "lies outside tensor 'a'"),
    (OWNER + [PLAN.digest, "a"], {"[[2,0,1]]": "0" * 32}, "lies outside tensor 'a'"),
    (OWNER + [PLAN.digest], {"b": {KEY0: "0" * 32}}, "tensor 'b', which this owner does not list"),
    (["version"], 1, "needs a version 2 document"),
])
def test_a_malformed_box_digest_section_is_a_config_error_and_nothing_is_parsed(path, value, needle):
    with pytest.raises(ConfigError) as info:
        _metas.parse(_broken(path, value))
    assert needle in str(info.value)


def test_a_joiner_takes_each_owners_box_digests_of_the_plan_or_refuses_naming_the_fix():
    src = _metas.parse(doc({PLAN.digest: BOXES}))["ck"]
    assert published_boxes("ck", src, PLAN) == [BOXES, None], "owner 1 holds only 'b', read whole: it needs none"
    for unpublished in (doc(), doc({"f" * 40: BOXES})):
        with pytest.raises(ConfigError, match=r"owner rank 0 published none for slice plan .*save_metas\(path, "
                                              r"slices=plan\)"):
            published_boxes("ck", _metas.parse(unpublished)["ck"], PLAN)
    partial = {PLAN.digest: {"a": dict(list(BOXES["a"].items())[:1])}}
    with pytest.raises(ConfigError, match=r"\(1 box\(es\)"):
        published_boxes("ck", _metas.parse(doc(partial))["ck"], PLAN)
