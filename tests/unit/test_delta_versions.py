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
    assert "fold them into one: fold_delta('D', base='A')" in text
    assert "update 'D' whole" in advice(bases, "D", None) and "A -> B -> C -> D" in advice(bases, "D", None)
    assert "update 'D' whole" in advice(bases, "D", "Z") and "from 'A'" not in advice(bases, "D", "Z")
    assert advice({}, "D", "A").startswith("update 'D' whole")


def test_the_version_a_refusing_worker_holds_is_read_from_its_message():
    msg = "update failed: rank 1: DeltaBaseError: this worker holds 'step-7', not the base 'step-8' of ..."
    assert worker_holds(msg) == "step-7"
    assert worker_holds("... this worker holds None, not the base 'B' ...") is None
    assert worker_holds("an unrelated failure") is None


def _view(cands=None, default=None, holds=None, target=True, loaded=False):
    from ckpt_core.delta.choose import view
    return view("C", {b: [c, not loaded, loaded] for b, c in (cands or {}).items()}, default, holds, target)


def test_the_delta_whose_base_the_engines_hold_is_chosen_alike_on_every_rank():
    from ckpt_core.delta.choose import choose
    both = {"B": "C@delta", "A": "C@delta:A"}
    known = {"B": "A", "C": "B"}
    # engines that hold A take the fold, B the registered delta; unknown: the registered delta
    assert choose([_view(both, "B", "A")] * 2, "C", p2p=False, known=known) == ("A", "C@delta:A")
    assert choose([_view(both, "B", "B")] * 2, "C", p2p=False, known=known) == ("B", "C@delta")
    assert choose([_view(both, "B", None)] * 2, "C", p2p=False, known=known) == ("B", "C@delta")
    # P2P: only the targets' records count; every rank read the fold from the owners' metas
    views = [_view(both, "B", None, target=False, loaded=True), _view(both, "B", "A", loaded=True)]
    assert choose(views, "C", p2p=True, known=known) == ("A", "C@delta:A")
    # the same views without loaded metas on a broadcast: refused, as a companion no rank serves
    with pytest.raises(DeltaBaseError, match="every rank must serve it"):
        choose(views, "C", p2p=False, known=known)


def test_a_delta_no_rank_can_serve_from_what_the_engines_hold_is_refused_with_the_advice():
    from ckpt_core.delta.choose import choose
    known = {"B": "A", "C": "B"}
    only = {"B": "C@delta"}
    with pytest.raises(DeltaBaseError, match=r"applies to 'B', but rank 0 last made 'A' live.*'B', then 'C'"
                                             r".*fold_delta\('C', base='A'\)"):
        choose([_view(only, "B", "A")] * 2, "C", p2p=False, known=known)
    # one rank folded, the other did not
    with pytest.raises(DeltaBaseError, match=r"rank\(s\) \[1\] have no delta of 'C' from 'A'.*fold_delta"):
        choose([_view({"B": "C@delta", "A": "C@delta:A"}, "B", "A"), _view(only, "B", "A")], "C", p2p=False,
               known=known)
    # the targets' engines hold different versions
    with pytest.raises(DeltaBaseError, match="hold different versions"):
        choose([_view(only, "B", "A"), _view(only, "B", "B")], "C", p2p=False, known=known)
    # no base on some rank, or ranks disagreeing on it
    with pytest.raises(DeltaBaseError, match="not registered with a base on rank\\(s\\) \\[1\\]"):
        choose([_view(only, "B"), _view()], "C", p2p=False, known=known)
    with pytest.raises(DeltaBaseError, match="ranks disagree on the base of 'C' \\(rank 0 'B', rank 1 'A'\\)"):
        choose([_view(only, "B", "A"), _view({"A": "C@delta"}, "A")], "C", p2p=True, known=known)


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
        run_delta_update(state, "sB", lambda handles: None, True, prepare=lambda: ("sA", "sB@delta"),
                         update=_worker_refused(text), bases=lambda: {"sB": "sA"})
    result = run_delta_update(state, "sB", lambda handles: None, "fallback", prepare=lambda: ("sA", "sB@delta"),
                              update=_worker_refused(text), bases=lambda: {"sB": "sA"})
    assert "fallback" in result["delta"]


def test_an_apply_that_failed_is_not_taken_for_a_base_refusal():
    from ckpt_core.delta.versions import run_delta_update
    from ckpt_core.errors import RemoteWorkerError

    with pytest.raises(RemoteWorkerError, match="post-apply digest"):
        run_delta_update(DeltaVersions(rank=0, world=1), "sB", lambda handles: None, "fallback",
                         prepare=lambda: ("sA", "sB@delta"),
                         update=_worker_refused("[rank 0] 'w' does not match its post-apply digest; undone"),
                         bases=lambda: {"sB": "sA"})
