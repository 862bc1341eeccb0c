"""What a rank's liveness reports (``ckpt_core.service._liveness.Liveness.problem``), on a fake clock
and a fake store: the beats are heard through rank 0's store, so while the store fails its silence,
not the peers' beat ages, decides (a killed rank 0 is named as the store it served)."""

import pytest

from ckpt_core.service._liveness import Liveness


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Store:
    """The TCPStore calls ``_exchange`` makes; ``beats`` holds each peer's doc; ``up`` False: every call fails."""

    def __init__(self):
        self.data, self.up = {}, True

    def _ok(self):
        if not self.up:
            raise RuntimeError("Connection reset by peer")

    def set(self, k, v):
        self._ok()
        self.data[k] = v

    def check(self, keys):
        self._ok()
        return all(k in self.data for k in keys)

    def get(self, k):
        self._ok()
        return self.data[k]


class State:
    def snapshot(self):
        return None


def _beat(live, store, clock, peer_beat=None):
    if peer_beat is not None:
        store.data["ckpt/live/0"] = f'{{"beat": {peer_beat}, "running": null}}'
    try:
        live._exchange(store)
    except RuntimeError as exc:
        live._store_error = str(exc)   # what the thread records


@pytest.fixture
def world():
    clock, store = Clock(), Store()
    live = Liveness(State(), 1, 2, "127.0.0.1", 1, beat_s=0.2, timeout_s=2.0, clock=clock)
    return live, store, clock


def test_a_silent_peer_is_named_while_the_store_answers(world):
    live, store, clock = world
    _beat(live, store, clock, peer_beat=1)
    clock.t += 2.5
    _beat(live, store, clock, peer_beat=1)   # the store answers, rank 0's beat did not change
    assert "rank(s) [0] sent no heartbeat" in live.problem()


def test_when_rank_0_dies_its_store_is_named_even_if_its_last_beats_were_late(world):
    live, store, clock = world
    _beat(live, store, clock, peer_beat=1)
    clock.t += 1.5
    _beat(live, store, clock, peer_beat=1)   # rank 0 starved: its beat is 1.5 s old, the store answered now
    store.up = False                          # then rank 0 is killed: its store goes with it
    clock.t += 1.0
    _beat(live, store, clock)
    assert live.problem() is None, "2.5 s since rank 0's beat changed, 1.0 s since the store answered: not yet"
    clock.t += 1.2
    problem = live.problem()
    assert "rendezvous store" in problem and "has not answered for 2.2 s" in problem, problem


def test_the_store_answering_again_brings_the_peers_beats_back(world):
    live, store, clock = world
    _beat(live, store, clock, peer_beat=1)
    store.up = False
    clock.t += 1.0
    _beat(live, store, clock)
    store.up = True
    clock.t += 1.5
    _beat(live, store, clock, peer_beat=1)   # answered, but rank 0's beat has not changed for 2.5 s
    assert "rank(s) [0] sent no heartbeat" in live.problem()
