"""Staged updates into a tensor-parallel (TP 2) SGLang: its ranks stage, commit or refuse together.

Chain under test: a PS world of two rank processes (stock wire, CPU IPC buffers) <- the stock
checkpoint-engine worker loop in the receiver thread that ``ckpt_sglang.staging.load`` starts in
each of two SGLang scheduler processes, each with SGLang's own parallel state (gloo world of 2,
its real TP group), its ``SchedulerWeightUpdaterManager``, ``WeightUpdater`` and its TP shard of
SGLang's ``Qwen2ForCausalLM``; SGLang's HTTP app on rank 0 broadcasts every scheduler call to rank
1 as SGLang's scheduler does (sglang_support/tp.py). Our loader agrees over that TP group.
Reference: each rank's parameters after a cold load of the same checkpoint into a fresh shard.
Each rank's scheduler notes the weight calls it takes, and whether its session was open
(sglang_support/sessions.py); ``--without-sessions`` plays SGLang 0.5.17's routes on every rank.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from ckpt_core.engines.base import mixed_weight_version
from ckpt_core.errors import RemoteWorkerError
from ckpt_sglang import SglangClient
from support.world import PsWorld
from sglang_support.fixtures import ready_engine, write_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TP = 2
# buckets of ~100 KiB: the 0.4 MB model travels in several, through both slots of the ring
SMALL_BUCKETS = {"PS_MAX_BUCKET_SIZE_GB": str(100_000 / (1 << 30)), "PS_NUM_SLOTS": "2"}
BOTH = r"failed on TP rank\(s\) \[0, 1\]"   # the client names every rank whose reply was a failure
IN_SESSION = ["begin", "tensor (in session)", "end (in session)"]   # one call of our loaders, as a rank sees it


class Tp2:
    """The TP-2 engine, its client, the PS world feeding it and the checkpoints of this module."""

    def __init__(self, eng, root):
        self.eng = eng
        self.client = SglangClient(eng.url, timeout=60)
        self.ckpts = {seed: write_checkpoint(root / f"step-{seed}", seed=seed, shards=TP)[0] for seed in (1, 2)}
        self.cold = {seed: eng.cold_params(ckpt) for seed, ckpt in self.ckpts.items()}
        self.world = PsWorld("cpu", TP, init={"wire": "stock"}, env=SMALL_BUCKETS)
        for seed, ckpt in self.ckpts.items():   # each PS rank registers one of the two files
            files = {r: [str(ckpt / f"model-{r:05d}.safetensors")] for r in range(TP)}
            self._ok(self.world.all("register", per_rank={r: (f"s{seed}", {"files": files[r]}) for r in range(TP)}))
            self._ok(self.world.all("gather", f"s{seed}"))

    @staticmethod
    def _ok(outcomes) -> dict:
        assert all(o.ok for o in outcomes.values()), outcomes
        return outcomes

    def ps_update(self, seed: int, **kwargs) -> dict:
        """Every PS rank's outcome of an update of step ``seed`` (rank 0 posts to the server)."""
        args = (f"s{seed}", self.eng.url, 60, kwargs.get("stage"), kwargs.get("weight_version"), kwargs.get("via"))
        return self.world.all("call", ("sglang_support.ps_calls", "update", args), timeout=120)

    def stage(self, seed: int, version: str) -> None:
        self._ok(self.ps_update(seed, stage=version))

    def params(self) -> list[dict[str, str]]:
        return self.eng.rank_params()

    def states(self) -> list[dict]:
        return self.client.weight_versions()

    def close(self) -> None:
        self.world.close()
        self.client.close()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-tp2")
    with ready_engine(root, tp_size=TP) as eng:
        t = Tp2(eng, root)
        try:
            yield t
        finally:
            t.close()


def _shards_differ(cold: list[dict]) -> None:
    assert cold[0].keys() == cold[1].keys() and cold[0] != cold[1], "the two TP ranks hold different shards"


def _same_bytes(digests: list[dict], params: list[dict[str, str]]) -> bool:
    """``state_digests()`` (read by ``ckpt_sglang.probe.load`` in each rank's scheduler) against the
    engine's own digests of each rank's shard (``sha256|dtype|shape``)."""
    return len(digests) == len(params) and all(
        set(p) <= set(d["digests"]) and {n: d["digests"][n][2] for n in p} == {n: v.split("|")[0] for n, v in p.items()}
        for d, p in zip(digests, params))


def test_a_tp2_server_without_sessions_loads_on_every_rank_as_sglang_0_5_17_does(tmp_path_factory):
    """SGLang 0.5.17's route table at TP 2 (no /begin_weight_update): the plain update, a stage, its
    commit and the state digests load on every rank without a session; each rank's tensor route runs
    outside one (0.5.23's manager, underneath, refuses that on a rank whose updater has no session)."""
    root = tmp_path_factory.mktemp("sglang-tp2-no-sessions")
    with ready_engine(root, tp_size=TP, extra=("--without-sessions",)) as eng:
        t = Tp2(eng, root)
        try:
            t._ok(t.ps_update(1, weight_version="plain"))
            assert t.params() == t.cold[1]
            t.stage(2, "v2")
            assert t.params() == t.cold[1], "a stage changed the live model"
            t.client.commit("v2")
            digests = t.client.state_digests()
            state = eng.state()
            assert state["ranks"] == t.cold[2] and t.client.model_info()["weight_version"] == "v2"
            assert state["rank_events"] == [["ipc", "tensor", "tensor", "tensor"]] * TP, state["rank_events"]
            assert not state["session_open"] and t.client.server.sessions is False
            assert _same_bytes(digests, state["ranks"])
            # a direct load there: outside any session, post-processed by our loader as 0.5.17's IPC route does
            t._ok(t.ps_update(1, weight_version="direct", via="loader"))
            state = eng.state()
            assert state["ranks"] == t.cold[1] and [s["live"] for s in t.states()] == ["direct"] * TP
            assert [events[4:] for events in state["rank_events"]] == [["tensor"]] * TP, state["rank_events"]
        finally:
            t.close()


def test_a_plain_tp2_update_loads_every_rank_like_a_cold_start(tp2):
    """The world is real: SGLang's own /update_weights_from_ipc at TP 2 leaves each rank its own shard."""
    t = tp2
    _shards_differ(t.cold[1])
    t._ok(t.ps_update(1, weight_version="w1"))
    assert t.params() == t.cold[1]
    assert t.client.staging_ranks() == TP


def test_every_rank_takes_each_load_inside_its_own_weight_update_session(tp2):
    """SGLang 0.5.23 at TP 2: every rank's scheduler receives begin, the load inside the session and
    end, for the plain IPC update, a stage, its commit and the state digests; no session stays open;
    each rank's digests (``ckpt_sglang.probe.load``) are its own shard's bytes."""
    t = tp2
    seen = [len(events) for events in t.eng.state()["rank_events"]]
    t._ok(t.ps_update(1, weight_version="w1"))
    t.stage(2, "v5")
    t.client.commit("v5")
    digests = t.client.state_digests()
    state = t.eng.state()
    assert [events[n:] for events, n in zip(state["rank_events"], seen)] == \
        [["begin", "ipc (in session)", "end (in session)"] + IN_SESSION * 3] * TP, state["rank_events"]
    assert not state["session_open"] and t.client.server.sessions is True
    assert state["ranks"] == t.cold[2] and _same_bytes(digests, state["ranks"])


def test_a_stage_one_rank_refuses_is_refused_and_dropped_on_every_rank(tp2):
    """Issue 33, item 2: the handles lack rank 1's device. Before the fix rank 1 refused and kept its
    older stage while rank 0 dropped its own and received; a commit of the older version was then
    refused on rank 0 and applied on rank 1: TP shards of two versions."""
    t = tp2
    t._ok(t.ps_update(1, weight_version="w1"))
    t.stage(2, "v7")
    assert [s["staged"]["version"] for s in t.states()] == ["v7", "v7"]
    before, key1 = t.params(), t.world.device_uuids[1]
    with pytest.raises(RemoteWorkerError) as staged:
        t.client.stage({t.world.device_uuids[0]: "ipc://@ckpt-test-nobody-serves-this"}, "v8", timeout=20)
    with pytest.raises(RemoteWorkerError) as committed:
        t.client.commit("v7")
    assert t.params() == before, "a refused commit changed the weights of a TP rank"
    assert t.client.model_info()["weight_version"] == "w1", "a refused commit set a weight version"
    states = t.states()
    assert [(s["staged"], s["receiving"]) for s in states] == [(None, None)] * TP, states
    assert staged.match(f"{BOTH}: ConfigError: cannot stage version 'v8': no ZeroMQ handle for the device {key1}")
    assert staged.match("on TP rank 1 \\(of 2\\); nothing is staged on any TP rank now")
    assert committed.match(f"{BOTH}: ConfigError: cannot commit version 'v7': nothing is staged on TP ranks 0, 1 "
                           "\\(of 2\\); nothing was committed on any TP rank")
    t.stage(2, "v9")   # the next stage and commit work, and equal a cold load
    t.client.commit("v9")
    assert t.params() == t.cold[2] and t.client.model_info()["weight_version"] == "v9"
    assert [s["live"] for s in t.states()] == ["v9", "v9"]


def test_a_stage_that_failed_on_one_rank_is_never_committed_on_the_others(tp2):
    """Rank 1's receiver fails as it seals the stage, after rank 0 sealed its own: the PS update fails
    everywhere, but rank 0 holds a complete stage. Its commit must not run on rank 0 alone."""
    t = tp2
    t._ok(t.ps_update(1, weight_version="w1"))
    before = t.params()
    httpx.post(f"{t.eng.url}/ckpt_test/next_stage", params={"fail_seal": True, "rank": 1}, timeout=30).raise_for_status()
    failed = t.ps_update(2, stage="v10")
    assert all(not o.ok and "post-hook" in o.message and t.world.device_uuids[1] in o.message
               for o in failed.values()), failed
    states = t.states()   # what the commit meets:
    assert states[0]["staged"]["version"] == "v10" and states[1]["staged"] is None, states
    assert "injected failure on TP rank 1 as the stage was sealed" in states[1]["last_stage_error"], states
    with pytest.raises(RemoteWorkerError) as committed:
        t.client.commit("v10")
    assert t.params() == before, "a commit ran on some TP ranks only"
    assert t.client.model_info()["weight_version"] == "w1"
    assert [s["staged"] for s in t.states()] == [None, None], "the stage that failed on rank 1 was kept on rank 0"
    assert committed.match(f"{BOTH}: ConfigError: cannot commit version 'v10': nothing is staged on TP rank 1 "
                           "\\(of 2\\); nothing was committed on any TP rank, and what was staged was dropped")
    t.stage(1, "v11")
    t.client.commit("v11")
    assert t.params() == t.cold[1]


def test_a_load_weights_failure_on_one_rank_at_the_commit_is_reported_by_every_rank(tp2):
    t = tp2
    t.stage(2, "v12")
    httpx.post(f"{t.eng.url}/ckpt_test/next_commit", params={"fail_rank": 1}, timeout=30).raise_for_status()
    with pytest.raises(RemoteWorkerError) as committed:
        t.client.commit("v12")
    assert committed.match(f"{BOTH}: RemoteWorkerError: SGLang's load_weights failed while committing 'v12': "
                           "RuntimeError: injected load_weights failure on TP rank 1 on TP rank 1 \\(of 2\\); the "
                           "model may hold a mix of both versions: push a full update")
    assert [(s["live"], s["staged"], s["mixed"]) for s in t.states()] == [(None, None, True)] * TP, \
        "a rank claims a version live"
    assert t.client.model_info()["weight_version"] == mixed_weight_version("v12")   # not the old version's name
    t.stage(2, "v13")   # a full update repairs it
    t.client.commit("v13")
    assert t.params() == t.cold[2] and [s["live"] for s in t.states()] == ["v13", "v13"]
    assert t.client.model_info()["weight_version"] == "v13"
    assert t.eng.alive(), "a scheduler process of the engine ended"


def test_a_direct_tp2_load_through_our_loader_equals_a_cold_load_and_a_failure_is_reported_by_every_rank(tp2):
    """``via="loader"`` at TP 2: every rank's loader agrees, loads its own shard through SGLang's
    ``load_weights`` inside its session; A, B, A each equal a cold load on every rank. A load one rank
    cannot run (no handle for its device) is refused on both, nothing changed; a load whose PS ranks
    gave the update up before the receivers connected fails on both, both say that nothing was loaded
    and keep their live version; ``load_weights`` raising on rank 1 mid-way fails the update on every
    PS rank, both TP ranks report it and none reports a live version; the next load repairs it."""
    t = tp2
    seen = [len(events) for events in t.eng.state()["rank_events"]]
    for seed, version in ((1, "d1"), (2, "d2"), (1, "d1b")):
        t._ok(t.ps_update(seed, weight_version=version, via="loader"))
        assert t.params() == t.cold[seed], f"{version}: a rank differs from a cold load of its shard"
        assert [s["live"] for s in t.states()] == [version] * TP
        assert t.client.model_info()["weight_version"] == version
    state = t.eng.state()
    assert [events[n:] for events, n in zip(state["rank_events"], seen)][0][:3] == IN_SESSION
    before = t.params()
    with pytest.raises(RemoteWorkerError) as refused:
        t.client.update({t.world.device_uuids[0]: "ipc://@ckpt-test-nobody-serves-this"}, via="loader", timeout=20)
    assert refused.match(f"{BOTH}: ConfigError: cannot run the load: no ZeroMQ handle for the device "
                         f"{t.world.device_uuids[1]}")
    assert refused.match("on TP rank 1 \\(of 2\\); nothing was changed on any TP rank")
    assert t.params() == before
    held = [(s["live"], s["live_since"]) for s in t.states()]
    gone = {u: f"ipc://@checkpoint-engine-test-gone-{uuid.uuid4().hex}.sock" for u in t.world.device_uuids}
    with pytest.raises(RemoteWorkerError) as untouched:
        t.client.update(gone, weight_version="gone", via="loader", timeout=60)
    assert untouched.match(f"{BOTH}: RemoteWorkerError: the load of 'gone' failed: TransportError: the parameter "
                           f"server's socket {gone[t.world.device_uuids[0]]} is not bound")
    assert untouched.match("nothing was loaded on TP rank 1 \\(of 2\\); nothing was loaded on any TP rank: the "
                           "engine still holds version 'd1b'")
    assert "mix" not in str(untouched.value), untouched.value
    assert t.params() == before and [(s["live"], s["live_since"]) for s in t.states()] == held == [("d1b", held[0][1]),
                                                                                                   ("d1b", held[1][1])]
    assert t.client.model_info()["weight_version"] == "d1b", "a load that loaded nothing set a weight version"
    httpx.post(f"{t.eng.url}/ckpt_test/next_commit", params={"fail_rank": 1}, timeout=30).raise_for_status()
    failed = t.ps_update(2, weight_version="bad", via="loader")
    assert all(not o.ok and "injected load_weights failure on TP rank 1" in o.message for o in failed.values()), failed
    assert [(s["live"], s["mixed"]) for s in t.states()] == [(None, True)] * TP, "a rank claims a version live"
    # SGLang's own weight version no longer names 'd1b': the weights may be a mix
    assert t.client.model_info()["weight_version"] == mixed_weight_version("bad")
    assert t.eng.alive(), "a scheduler process of the engine ended"
    t._ok(t.ps_update(2, weight_version="d2b", via="loader"))
    assert t.params() == t.cold[2] and [s["live"] for s in t.states()] == ["d2b"] * TP
    assert t.client.model_info()["weight_version"] == "d2b"
