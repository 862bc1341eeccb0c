"""Fault injection on the parameter-server side, on CPU (gloo): a PS rank killed or frozen mid-update
(the cases live in ps_fault_cases, shared with the GPU tests), and PS worlds that die holding buffers."""

from __future__ import annotations

import os

import pytest

from support.asserts import report_case
from support.engine import EngineFront
from support.world import FreshCheckpoints, PsWorld
from support.ps_fault_cases import (ENV, INIT, assert_engines_left_and_a_new_world_delivers,
                                    freeze_a_ps_rank_mid_update, ipc_prefix, kill_a_ps_rank_mid_update)


@pytest.fixture(scope="module")
def front():
    f = EngineFront("cpu", 2)
    yield f
    f.close()


def assert_only_the_dead_ranks_buffer_is_left(prefix: str, dead: int) -> None:
    """The survivor released its IPC buffer; a SIGKILLed rank cannot unlink its own: remove it here."""
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert all(n.startswith(f"{prefix}{dead}-") for n in left), f"a surviving rank leaked its IPC buffer: {left}"


@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0-store-host"])
def test_a_ps_rank_killed_mid_update_fails_the_survivor_in_time_with_a_typed_error(front, victim, tmp_path):
    prefix = kill_a_ps_rank_mid_update("cpu", front, victim, tmp_path)
    assert_only_the_dead_ranks_buffer_is_left(prefix, victim)
    assert_engines_left_and_a_new_world_delivers(front, seed=80 + victim)


def test_a_frozen_ps_rank_fails_the_survivor_within_the_collective_timeout(front, tmp_path):
    prefix = freeze_a_ps_rank_mid_update("cpu", front, tmp_path)
    assert_only_the_dead_ranks_buffer_is_left(prefix, 1)
    assert_engines_left_and_a_new_world_delivers(front, seed=91)


def _kill_a_world_that_keeps_its_buffers(front: EngineFront, seed: int) -> str:
    """A world with keep_device_buffers: after one update both ranks and workers hold the buffer;
    then both PS processes are SIGKILLed. Returns the /dev/shm prefix of their buffers."""
    with PsWorld("cpu", 2, init=dict(INIT, keep_device_buffers=True), env=ENV) as ps:
        name, want = FreshCheckpoints(ps, seed=seed).new("kept")
        got = ps.update(name, front, 30)
        assert all(o.ok for o in got.values()) and all(front.digests(i) == want for i in range(2)), got
        prefix = ipc_prefix(ps)
        assert len([n for n in os.listdir("/dev/shm") if n.startswith(prefix)]) == 2
        assert all(len(front.stats(i)["mapped"]) == 1 for i in range(2))
        ps.kill(0)
        ps.kill(1)
    return prefix


def test_engines_drop_the_kept_buffer_of_a_dead_ps_when_the_next_one_maps_its_own(front):
    prefix = _kill_a_world_that_keeps_its_buffers(front, seed=95)
    try:
        with PsWorld("cpu", 2, init=dict(INIT, keep_device_buffers=True)) as ps:
            name, want = FreshCheckpoints(ps, seed=96).new("next")
            got = ps.update(name, front, 30)
            assert all(o.ok for o in got.values()) and all(front.digests(i) == want for i in range(2)), got
            new_prefix = ipc_prefix(ps)
            for i in range(2):
                mapped = front.stats(i)["mapped"]
                assert len(mapped) == 1 and new_prefix in mapped[0], f"engine worker {i} maps {mapped}"
        report_case("PS world with kept buffers SIGKILLed, next world updates",
                    "engines map only the new buffer (the dead one's memory is let go)", None)
    finally:
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")


def test_the_shm_buffer_of_a_killed_ps_is_reclaimed_by_the_next_ps_on_the_host(front):
    prefix = _kill_a_world_that_keeps_its_buffers(front, seed=97)
    try:
        with PsWorld("cpu", 2, init=INIT) as ps:
            name, want = FreshCheckpoints(ps, seed=98).new("next")
            got = ps.update(name, front, 30)              # allocates a buffer: the moment to sweep
            assert all(o.ok for o in got.values()), got
        left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
        assert left == [], f"orphaned IPC buffers of SIGKILLed PS ranks: {left}"
    finally:
        for n in os.listdir("/dev/shm"):
            if n.startswith(prefix):
                os.unlink(f"/dev/shm/{n}")
