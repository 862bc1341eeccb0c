"""The PS side of deltas as plain data: the base a delta's manifests name (what a joining world learns
from loaded metas), the chain of registered deltas and the advice a refusal carries, the version a
refusing worker says it holds."""

import re

import pytest

from ckpt_core.delta.versions import (DeltaVersions, advice, base_of_manifests, chain_to, manifest_name,
                                      worker_holds)
from ckpt_core.errors import DeltaBaseError


def _names(base, version, ranks, world):
    return ["ckpt.delta:w"] + [manifest_name(base, version, r, world) for r in ranks]


def test_the_manifests_name_one_base_for_every_owner_rank():
    assert base_of_manifests(_names("A", "B", [0, 1], 2), "B") == "A"
    assert base_of_manifests(["w", "v"], "B") is None   # not a delta: no manifest


@pytest.mark.parametrize("names, needle", [
    (_names("A", "B", [0], 1) + _names("X", "B", [1], 2)[1:], "disagree"),   # two bases
    (_names("A", "B", [0], 2), "PS ranks [0] of 2"),                          # a rank's manifest missing
    (_names("A", "C", [0, 1], 2), "is of 'C'"),                               # another version's delta
])
def test_manifests_that_disagree_or_lack_a_rank_are_refused(names, needle):
    with pytest.raises(DeltaBaseError, match=re.escape(needle)):
        base_of_manifests(names, "B")


def test_the_chain_runs_from_the_oldest_known_base_and_stops_at_a_cycle():
    bases = {"B": "A", "C": "B", "D": "C"}
    assert chain_to(bases, "D") == ["A", "B", "C", "D"]
    assert chain_to(bases, "A") == ["A"]
    assert chain_to({"A": "B", "B": "A"}, "A") == ["B", "A"]


def test_the_advice_names_the_deltas_to_apply_in_order_or_the_whole_update():
    bases = {"B": "A", "C": "B", "D": "C"}
    text = advice(bases, "D", "A")
    assert "from 'A' to 'D' (A -> B -> C -> D)" in text and "'B', then 'C', then 'D'" in text
    assert "update 'D' whole" in advice(bases, "D", None) and "A -> B -> C -> D" in advice(bases, "D", None)
    assert "update 'D' whole" in advice(bases, "D", "Z") and "from 'A'" not in advice(bases, "D", "Z")
    assert advice({}, "D", "A").startswith("update 'D' whole")


def test_the_version_a_refusing_worker_holds_is_read_from_its_message():
    msg = "update failed: rank 1: DeltaBaseError: this worker holds 'step-7', not the base 'step-8' of ..."
    assert worker_holds(msg) == "step-7"
    assert worker_holds("... this worker holds None, not the base 'B' ...") is None
    assert worker_holds("an unrelated failure") is None


def test_the_ps_precheck_names_what_its_engines_hold_and_what_would_work():
    v = DeltaVersions(0, 1)
    v.bases.update({"B": "A", "C": "B"})
    v.made_live("A")
    with pytest.raises(DeltaBaseError, match=r"last made 'A' live.*'B', then 'C'"):
        v.precheck("C")
    v.precheck("B")
    v.precheck("C", holds="B")
    with pytest.raises(DeltaBaseError, match="not registered with a base"):
        v.precheck("A")


def _worker_refused(text: str):
    from ckpt_core.errors import RemoteWorkerError

    def update(name, req_func):
        if name.endswith("@delta"):
            raise RemoteWorkerError(text)
        return {"seconds": {"total": 0.1}}
    return update


@pytest.mark.parametrize("text", [
    # typed, over the worker's socket in the handshake
    "[rank 0] update failed during handshake: DeltaBaseError: this worker holds 'D', not the base 'sA' of the "
    "delta of 'sB': nothing was written (update it whole)",
    # the same refusal reaching the PS first as vLLM's /collective_rpc answer to req_func (HTTP 500, no type)
    "[rank 0] update failed during handshake: rank 0: req_func raised: {\"error\":{\"message\":\"Call to "
    "collective_rpc method failed: this worker holds 'D', not the base 'sA' of the delta of 'sB': nothing was "
    "written (update it whole)\",\"type\":\"InternalServerError\",\"code\":500}}",
])
def test_a_workers_base_refusal_is_a_delta_base_error_whichever_way_it_arrives(text):
    from ckpt_core.delta.versions import run_delta_update

    state = DeltaVersions(rank=0, world=1)
    with pytest.raises(DeltaBaseError, match="does not hold its base 'sA'.*this worker holds 'D'"):
        run_delta_update(state, "sB", lambda handles: None, True, prepare=lambda: "sA",
                         update=_worker_refused(text), bases=lambda: {"sB": "sA"})
    result = run_delta_update(state, "sB", lambda handles: None, "fallback", prepare=lambda: "sA",
                              update=_worker_refused(text), bases=lambda: {"sB": "sA"})
    assert "fallback" in result["delta"]


def test_an_apply_that_failed_is_not_taken_for_a_base_refusal():
    from ckpt_core.delta.versions import run_delta_update
    from ckpt_core.errors import RemoteWorkerError

    with pytest.raises(RemoteWorkerError, match="post-apply digest"):
        run_delta_update(DeltaVersions(rank=0, world=1), "sB", lambda handles: None, "fallback", prepare=lambda: "sA",
                         update=_worker_refused("[rank 0] 'w' does not match its post-apply digest; undone"),
                         bases=lambda: {"sB": "sA"})
