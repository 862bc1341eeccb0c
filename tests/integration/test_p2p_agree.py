"""Issue 21, items 1, 3, 4 and 9: what every rank of an update must agree on, P2P and broadcast.

* an owner whose share is only 0-byte tensors serves P2P updates, and its metas load anywhere;
  any local failure of a target travels through the status agreement (item 1);
* close() during a P2P update stops it on every rank at once, naming close() (item 3);
* load_metas validates a document once, for every path, and installs nothing of a bad one (item 4);
* ranks naming different checkpoints, gathering different metas or speaking different wires are
  one typed error on every rank before a byte moves (item 9).

Real PS processes (gloo), real engine workers, Mooncake's TCP transport on loopback. The
collective timeout is long (300 s): a rank left waiting in a collective shows as a harness
timeout, never as a slow pass.
"""

from __future__ import annotations

import os

import pytest
import torch

from support.asserts import assert_every_rank_failed
from support.data import fresh_tensors, want_digests
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.p2p_cases import JOINERS, OWNERS, SMALL, all_ok, call

pytest.importorskip("mooncake.engine", reason="Mooncake (the p2p extra) is not installed: "
                    "scripts/test.sh installs mooncake-transfer-engine-non-cuda and libibverbs1")

COLLECTIVE_TIMEOUT_S = 300.0
SLOW = {"PS_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
PROMPT_S = 60.0     # generous ceiling: a refusal or failure comes long before the collective timeout


@pytest.fixture(scope="module")
def owners():
    """2 owner ranks (127.0.0.2) and an engine of 2 workers beside them."""
    w = PsWorld("cpu", 2, init=SMALL, env={**OWNERS, **SLOW})
    front = EngineFront("cpu", 2)
    try:
        yield w, front, FreshCheckpoints(w, seed=2121, per_rank=8)
    finally:
        w.close()
        front.close()


@pytest.fixture(scope="module")
def joiner():
    """A joiner world of another size: 1 rank (127.0.0.3) and its engine's one worker."""
    w = PsWorld("cpu", 1, init=SMALL, env={**JOINERS, **SLOW})
    front = EngineFront("cpu", 1)
    try:
        yield w, front
    finally:
        w.close()
        front.close()


def holds(front: EngineFront, want: dict[str, str]) -> None:
    for i in range(len(front.procs)):
        held = front.digests(i)
        assert {n: held.get(n) for n in want} == want, f"engine worker {i} does not hold what it should"


def assert_prompt(got: dict) -> None:
    slowest = max(o.seconds for o in got.values())
    assert slowest < PROMPT_S, f"no rank may wait for the collective timeout ({slowest:.1f} s)"


def registered(w: PsWorld, ranks) -> dict[int, int]:
    """Memory each rank registers with Mooncake: its served checkpoints' regions (a staging
    buffer only while an update runs); quarantined buffers must be none."""
    info = all_ok(call(w, "p2p_info", ranks=ranks))
    assert all(o.value["quarantined"] == 0 for o in info.values()), info
    return {r: o.value["registered"] for r, o in info.items()}


def assert_nothing_left(w: PsWorld, before: dict[int, int]) -> None:
    """No staging buffer stayed registered with Mooncake after the update, none is quarantined."""
    assert registered(w, list(before)) == before, "a staging buffer stayed registered"


def metas_doc(w: PsWorld) -> dict:
    return all_ok(w.all("get_metas", ranks=[0]))[0].value


def known(w: PsWorld) -> dict[int, set]:
    return {r: set(o.value["checkpoints"]) for r, o in all_ok(w.all("get_metas")).items()}


# -- item 1: a share of 0-byte tensors; local failures go through the agreement ---------------------
def test_an_owner_whose_share_is_only_zero_byte_tensors_serves_p2p_and_its_metas_load_elsewhere(owners, joiner):
    w, front, _ = owners
    gen = torch.Generator().manual_seed(21)
    data0 = fresh_tensors({"w0": ((30000,), torch.bfloat16), "w1": ((50, 70), torch.float32)}, gen)
    zeros = {"z1": torch.empty(0), "z2": torch.empty(3, 0, dtype=torch.float16)}
    all_ok(w.all("register", per_rank={0: ("zero", {"named_tensors": data0}), 1: ("zero", {"named_tensors": zeros})}))
    all_ok(w.all("gather", "zero"))
    want = want_digests(data0, zeros)
    served = registered(w, [0, 1])
    got = call(w, "p2p_update", "zero", front.address, 30, [0, 1])
    assert all(o.ok for o in got.values()), got       # before: KeyError on a target, the other rank waited
    holds(front, want)
    assert_nothing_left(w, served)
    jw, jfront = joiner
    all_ok(call(jw, "load_metas", metas_doc(w)))      # before: "lies outside the region its owner registered"
    all_ok(call(jw, "p2p_update", "zero", jfront.address, 30, [0]))
    holds(jfront, want)
    assert_nothing_left(jw, {0: 0})
    all_ok(w.all("unregister", ("zero", {})))


def test_a_local_failure_inside_a_targets_read_fails_every_rank_through_the_agreement(owners):
    w, front, ckpts = owners
    first, want = ckpts.new("before")
    all_ok(call(w, "p2p_update", first, front.address, 30, [0, 1]))
    name, want2 = ckpts.new("broken-read")
    served = registered(w, [0, 1])
    all_ok(call(w, "break_next_read", ranks=[1]))
    posted = len(front.requests)
    got = call(w, "p2p_update", name, front.address, 30, [0, 1])
    assert_every_rank_failed(got, "TransportError", "rank 1", "RuntimeError: injected")
    assert_prompt(got)
    assert len(front.requests) == posted + 1
    holds(front, want)                                # the engines kept the previous weights
    assert_nothing_left(w, served)
    all_ok(call(w, "p2p_update", name, front.address, 30, [0, 1]))
    holds(front, want2)                               # the world stays usable, bit-exact
    ckpts.drop(first)
    ckpts.drop(name)


# -- item 3: close() during a P2P update -------------------------------------------------------------
@pytest.mark.parametrize("who", ["target", "bystander"])
def test_close_during_a_p2p_update_stops_it_on_every_rank_naming_close_then_frees(who, tmp_path):
    """``target``: ranks=[0, 1], rank 1 closed; ``bystander``: ranks=[1], rank 0 (outside) closed."""
    from support.ps_fault_cases import act_mid_update
    ranks, victim = ([0, 1], 1) if who == "target" else ([1], 0)
    front = EngineFront("cpu", len(ranks), devices=ranks)
    try:
        with PsWorld("cpu", 2, init=SMALL, env={**OWNERS, **SLOW}) as w:
            ckpts = FreshCheckpoints(w, seed=33, per_rank=8)
            first, want = ckpts.new("before")
            all_ok(call(w, "p2p_update", first, front.address, 30, ranks))
            name, _ = ckpts.new("closing")
            prefix = all_ok(w.all("ipc_prefix", ranks=[victim]))[victim].value
            got = act_mid_update(w, front, name, tmp_path, victim, "close", ranks=ranks)
            # before: close() blocked PS_COLLECTIVE_TIMEOUT_S + 5 s, the update ran on to its deadline
            assert got[victim]["action"] == "ok" and got[victim]["order"] == ["update ended", "close returned"], got
            for r in range(2):
                assert got[r]["update"].startswith("RemoteWorkerError"), got
                assert f"close() was called on rank {victim}" in got[r]["update"], got
            holds(front, want)
            again = w.all("update", (name, None, 10, None), ranks=[victim])[victim]
            assert not again.ok and again.error == "ClosedError", again
            left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix + f"{victim}-")]
            assert not left, f"the closed rank left IPC buffers mapped: {left}"
    finally:
        front.close()


# -- item 4: one validation of metas for every path, all or nothing ----------------------------------
def _tampered(doc: dict, name: str, fault: str) -> dict:
    """Checkpoint ``name`` of ``doc`` as checkpoint "bad", with one fault in one tensor row."""
    import copy
    ck = copy.deepcopy(doc["checkpoints"][name])
    rows = ck["owners"][0]["tensors"]
    i = next(k for k, t in enumerate(rows) if t[1] == "F32")
    t = rows[i]
    if fault == "f16-with-itemsize-4":
        t[1] = "F16"                      # shape x 4 == nbytes still holds: only the dtype code lies
    elif fault == "unknown-dtype":
        t[1] = "Q3"
    elif fault == "shape-vs-bytes":
        t[3] += 4
    elif fault == "outside-region":
        t[6] = ck["owners"][0]["p2p"]["regions"][str(t[5])][1]
    return {**doc, "checkpoints": {"fine": doc["checkpoints"][name], "bad": ck}}


FAULTS = {"f16-with-itemsize-4": "'F16' with itemsize 4", "unknown-dtype": "'Q3'",
          "shape-vs-bytes": "bytes", "outside-region": "outside the region"}


@pytest.mark.parametrize("size", ["same-size", "other-size"])
def test_load_metas_refuses_a_bad_document_whole_on_every_path_and_installs_nothing(owners, joiner, size):
    w, front, ckpts = owners
    name, want = ckpts.new("source")
    doc = metas_doc(w)
    into, into_front, ranks = (w, front, [0, 1]) if size == "same-size" else (*joiner, [0])
    before = known(into)
    for fault, needle in FAULTS.items():
        got = call(into, "load_metas", _tampered(doc, name, fault))
        assert_every_rank_failed(got, "ConfigError", needle)
        assert known(into) == before, f"{fault}: a refused document installed metas"
    posted = len(into_front.requests)
    got = call(into, "p2p_update", "bad", into_front.address, 30, ranks)
    assert_every_rank_failed(got, "ConfigError", "'bad'")   # before: float16 views of float32 bytes, "ok"
    assert len(into_front.requests) == posted
    all_ok(call(into, "load_metas", {**doc, "checkpoints": {"fine": doc["checkpoints"][name]}}))
    all_ok(call(into, "p2p_update", "fine", into_front.address, 30, ranks))
    holds(into_front, want)
    ckpts.drop(name)


# -- item 9: one update, one checkpoint; every collective call agrees --------------------------------
def _each(w: PsWorld, cmd: str, per_rank: dict) -> dict:
    return w.collect(w.send(cmd, per_rank=per_rank), timeout=120)


def test_ranks_naming_two_checkpoints_of_one_layout_are_refused_on_every_rank_before_a_byte_moves(owners):
    w, front, ckpts = owners
    (s1, want1), (s2, want2) = ckpts.new("step"), ckpts.new("step")
    all_ok(w.update(s1, front))
    posted = len(front.requests)
    got = _each(w, "update", {0: (s1, front.address, 30, None), 1: (s2, front.address, 30, None)})
    assert_every_rank_failed(got, "ConfigError", "disagree on the checkpoint", repr(s1), repr(s2))
    got = _each(w, "call", {r: ("support.p2p_cases", "p2p_update", (n, front.address, 30, [0, 1]))
                            for r, n in enumerate((s1, s2))})
    assert_every_rank_failed(got, "ConfigError", "disagree on the checkpoint", repr(s1), repr(s2))
    assert_prompt(got)
    assert len(front.requests) == posted, "refused before anything moved: no engine was asked"
    holds(front, want1)
    all_ok(w.update(s2, front))
    holds(front, want2)
    ckpts.drop(s1)
    ckpts.drop(s2)


def test_gather_metas_of_different_checkpoints_on_different_ranks_is_refused_and_installs_nothing(owners):
    w, front, ckpts = owners
    (s1, _), (s2, want2) = ckpts.new("step"), ckpts.new("step")
    got = _each(w, "gather", {0: s1, 1: s2})
    assert_every_rank_failed(got, "ConfigError", "disagree on the checkpoint", repr(s1), repr(s2))
    all_ok(w.update(s2, front))                       # its gathered metas were left alone
    holds(front, want2)
    ckpts.drop(s1)
    ckpts.drop(s2)


def test_ranks_speaking_different_engine_wires_are_refused_on_every_rank(owners):
    w, front, ckpts = owners
    name, want = ckpts.new("wire")
    all_ok(call(w, "set_wire", "stock", ranks=[1]))
    try:
        posted = len(front.requests)
        got = w.update(name, front, 30)
        assert_every_rank_failed(got, "ConfigError", "disagree on the engine wire", "'stock'", "'native'")
        got = call(w, "p2p_update", name, front.address, 30, [0, 1])
        assert_every_rank_failed(got, "ConfigError", "disagree on the engine wire")
        assert_prompt(got)
        assert len(front.requests) == posted
    finally:
        all_ok(call(w, "set_wire", "native", ranks=[1]))
    all_ok(call(w, "p2p_update", name, front.address, 30, [0, 1]))
    holds(front, want)
    ckpts.drop(name)
